// voxpipe browser demo, what the person sees: the badges (connection, conversation state,
// degraded service), plain-words banners, the conversation's bubbles (live partial
// transcripts, replies, cancelled replies, busy with a countdown), the level meters, the
// latency line and the event log. No socket or audio here.

export const $ = (id) => document.getElementById(id);

// ---- event log ---------------------------------------------------------------------

export function log(text, cls = "") {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  if (cls) li.className = cls;
  const box = $("log");
  box.appendChild(li);
  while (box.children.length > 300) box.removeChild(box.firstChild);
  box.scrollTop = box.scrollHeight;
}

// ---- badges ------------------------------------------------------------------------

// The connection badge: state "idle" | "connecting" | "open" | "warn" | "closed" | "error".
export function setConnection(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
}

// What the conversation is doing, in words (the badge's data-state is the key).
export const STATES = {
  off: "mic off",
  waiting: "waiting for the server",
  listening: "listening",
  user: "you're speaking",
  thinking: "thinking…",
  speaking: "assistant speaking",
  ready: "ready",
};

export function setState(state) {
  const el = $("speech");
  if (el.dataset.state === state) return;
  el.dataset.state = state;
  el.textContent = STATES[state];
}

// ---- banners: one at a time, the most recent problem, in plain words --------------

export const BANNERS = {
  denied: "Microphone blocked: this page may not use your microphone. Allow it (the icon in the address bar) " +
    "and press Start again — or type below.",
  no_mic: "No microphone found. Plug one in and press Start again — or type below.",
  mic_busy: "The microphone is in use by another program (or failed to start). Close it and press Start again.",
  insecure: "This browser gives the microphone only to pages on https or localhost. Type below, or open the page " +
    "through https.",
  mic_failed: "The microphone could not be started.",
  not_ready: "The server is warming up (loading its models).",
  gone: "The server is gone (connection lost).",
  busy: "The server is busy.",
  token: "This server needs a token: open this page as /?token=YOUR_TOKEN.",
  forbidden: "The server refused this page (its address or origin is not allowed).",
  idle: "The session was closed after a long silence. Press Start or send a message to reconnect.",
  error: "The server had a problem with this session.",
};

let bannerTimer = null;

// Show banner `kind` (BANNERS), with `detail` after it; `until` (performance.now() ms)
// adds a live countdown "… in N s" worded by `countdown(seconds)`; `action`: {label, run}.
export function showBanner(kind, { detail = "", until = null, countdown = null, action = null } = {}) {
  const box = $("banner");
  clearInterval(bannerTimer);
  box.hidden = false;
  box.dataset.kind = kind;
  box.querySelector(".banner-text").textContent = `${BANNERS[kind] || kind}${detail ? ` ${detail}` : ""}`;
  const cd = box.querySelector(".banner-countdown");
  const tick = () => {
    const left = Math.ceil(Math.max(0, until - performance.now()) / 1000);
    box.dataset.left = String(left);
    cd.textContent = countdown(left);
  };
  if (until !== null && countdown) {
    tick();
    bannerTimer = setInterval(tick, 250);
  } else {
    cd.textContent = "";
    delete box.dataset.left;
  }
  const btn = box.querySelector("button");
  btn.hidden = !action;
  if (action) {
    btn.textContent = action.label;
    btn.onclick = action.run;
  }
}

// Hide the banner (only if it shows one of `kinds`, when given).
export function hideBanner(...kinds) {
  const box = $("banner");
  if (kinds.length && !kinds.includes(box.dataset.kind)) return;
  clearInterval(bannerTimer);
  box.hidden = true;
  box.dataset.kind = "";
}

// ---- bubbles ------------------------------------------------------------------------

export function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("span");
  meta.className = "meta";
  div.append(body, meta);
  $("conversation").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

export function setMeta(el, text) {
  el.querySelector(".meta").textContent = text;
}

// A spoken turn's bubble, updated in place: the committed words, then the unstable tail
// (styled apart: the next partial may still change it); `final` once the turn ended.
export function showTranscript(el, committed, unstable, final) {
  const text = el.querySelector(".text");
  text.textContent = "";
  const c = document.createElement("span");
  c.className = "committed";
  c.textContent = committed;
  text.append(c);
  if (unstable) {
    const u = document.createElement("span");
    u.className = "unstable";
    u.textContent = (committed ? " " : "") + unstable;
    text.append(u);
  }
  el.dataset.final = String(final);
  el.classList.toggle("partial", !final);
}

// Why a reply was cut short, per response.cancelled's `reason` (docs/PROTOCOL.md).
export const CANCEL_REASONS = {
  client: "stopped: you cancelled it",
  barge_in: "interrupted: you spoke over it",
  continued: "dropped: you went on talking",
  new_turn: "replaced by your newer turn",
  restart: "stopped: the audio settings changed",
  error: "failed: the server had an error",
};

// A cancelled reply shows only what was spoken of it, labelled by why it stopped.
export function showCancelled(el, spokenText, reason) {
  el.classList.add("cancelled");
  el.dataset.reason = reason;
  const text = el.querySelector(".text");
  text.textContent = spokenText.trim() ? `${spokenText.trim()} …` : "(stopped before it said anything)";
  text.classList.toggle("nothing", !spokenText.trim());
  setMeta(el, CANCEL_REASONS[reason] || `cancelled (${reason})`);
}

// A note under a reply's text ("text only (speech unavailable)").
export function addNote(el, text) {
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = text;
  el.querySelector(".text").after(note);
}

// ---- latency line -------------------------------------------------------------------

const ms = (v) => `${Math.round(v)} ms`;

// The line under a reply: what it was (audio length, tokens) and how fast, in the terms of
// its turn: a spoken turn from the end of speech (asr, ttft, first audio, voice→voice); a
// typed one from the moment it was sent (`replyMs`: sent → first audio heard, measured here).
export function latencyLine(done, spoken, replyMs) {
  const t = done.timings_ms || {};
  const parts = [`${done.audio_s.toFixed(1)} s audio`, `${done.output_tokens} tokens`];
  if (spoken) {
    if (t.asr !== undefined) parts.push(`asr ${ms(t.asr)}`);
  } else if (replyMs !== null) {
    parts.push(`reply in ${ms(replyMs)}`);
  }
  if (t.llm_ttft !== undefined) parts.push(`ttft ${ms(t.llm_ttft)}`);
  if (t.first_audio !== undefined) parts.push(`first audio ${ms(t.first_audio)}`);
  if (spoken && t.voice_to_voice !== undefined) parts.push(`voice→voice ${ms(t.voice_to_voice)}`);
  return parts.join(" · ");
}

// ---- level meters -------------------------------------------------------------------

// Levels in [0, 1] (RMS) shown as bar widths on a log-ish scale (-60 dBFS .. 0).
function width(level) {
  if (level <= 0.001) return 0;
  return Math.max(0, Math.min(1, 1 + (20 * Math.log10(level)) / 60));
}

export function showLevels(input, output) {
  $("mic-level").style.width = `${Math.round(width(input) * 100)}%`;
  $("out-level").style.width = `${Math.round(width(output) * 100)}%`;
}

export function setOutputActive(on) {
  $("out-meter").classList.toggle("active", on);
}

// ---- busy: a refused turn or session, with a countdown to when a retry may succeed ----

// What each `busy` reason means, in plain words (docs/PROTOCOL.md, "Admission" and
// "Degraded service").
export const BUSY_REASONS = {
  queue: "the reply would miss the latency target",
  memory: "the language model's memory is full",
  sessions: "too many sessions are open",
  stage: "a processing stage's queue is full",
  ladder: "a model ran out of memory: new turns are refused while it recovers",
  breaker: "a processing stage is failing or too slow: its circuit breaker is open",
  rate_limited: "this page sends faster than the server allows",
};

// The banner of a refusal: why, in plain words, and a countdown of `retryMs`.
export function busyBanner(reason, retryMs) {
  const why = BUSY_REASONS[reason] || "it cannot take this turn now";
  showBanner("busy", { detail: `${why[0].toUpperCase()}${why.slice(1)}.`, until: performance.now() + retryMs,
                       countdown: (s) => (s > 0 ? ` Try again in ${s} s.` : " You can try again now.") });
}

// A bubble saying why the turn (or session) was refused, with a countdown; the banner says
// it too. `ev`: {reason, retry_after_ms, message}.
export function showBusy(ev) {
  const reason = ev.reason || "unknown";
  const retryMs = Math.max(0, Number(ev.retry_after_ms) || 0);
  const el = bubble("assistant busy", "");
  el.dataset.reason = reason;
  const text = el.querySelector(".text");
  const why = BUSY_REASONS[reason] || "it cannot take this turn now";
  text.textContent = `Server busy (${reason}): ${why}`;
  const countdown = document.createElement("span");
  countdown.className = "countdown";
  countdown.setAttribute("aria-live", "off"); // the bubble is announced once, not every tick
  text.after(countdown);
  setMeta(el, ev.message || "");
  const until = performance.now() + retryMs;
  busyBanner(reason, retryMs);
  const tick = () => {
    const left = Math.ceil(Math.max(0, until - performance.now()) / 1000); // whole seconds, 0 at the end
    el.dataset.left = String(left);
    if (left > 0) {
      countdown.textContent = `retry in ${left} s`;
      setTimeout(tick, Math.max(50, until - performance.now() - (left - 1) * 1000)); // at the next whole second
    } else {
      countdown.textContent = "you can try again now";
      el.classList.add("retry-ok");
      setTimeout(() => hideBanner("busy"), 3000);
    }
  };
  tick();
}

// ---- degraded service: the server's latest server.status ---------------------------------

// One condition in words, e.g. "llm out-of-memory step 2", for the tooltip.
export function conditionName(c) {
  const stage = c.stage || "a stage";
  if (c.source === "ladder") return `${stage} out-of-memory step ${c.level}`;
  if (c.source === "breaker") return `${stage} breaker ${String(c.level).replace("_", "-")}`;
  if (c.source === "slo") return `latency over the SLO, level ${c.level}`;
  return [c.source, c.stage, c.level].filter(Boolean).join(" ");
}

// A `server.status` (or null: a new connection, nothing known yet): the "degraded" badge and
// a line listing each condition's effect while the server says it is degraded.
export function showStatus(ev) {
  const conditions = ev && ev.degraded ? ev.conditions || [] : [];
  const degraded = !!(ev && ev.degraded);
  const badge = $("degraded");
  const line = $("degraded-effects");
  badge.hidden = line.hidden = !degraded;
  if (!degraded) {
    badge.title = "";
    line.textContent = "";
    return conditions;
  }
  const effects = conditions.map((c) => c.effect).filter(Boolean);
  badge.title = conditions.length
    ? conditions.map((c) => `${conditionName(c)}: ${c.effect || "no details"}`).join("\n")
    : "degraded service";
  line.textContent = `Degraded service: ${effects.length ? effects.join("; ") : "no details"}`;
  return conditions;
}
