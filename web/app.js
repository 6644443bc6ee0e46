// voxpipe browser demo: microphone → WebSocket (f32 at the AudioContext rate),
// reply text and PCM16 reply audio back. Protocol: docs/PROTOCOL.md.
"use strict";

(() => {
  const BATCH_MS = 20; // audio per binary message
  const PLAYBACK_LEAD_S = 0.06; // head start for the first chunk of a reply
  const CLOSE_TRY_AGAIN_LATER = 1013; // close code of the session cap
  const $ = (id) => document.getElementById(id);
  // A server started with --token needs it on /ws; browsers cannot set headers on a
  // WebSocket, so the page passes it as ?token=, taken from its own URL (/?token=...).
  const TOKEN = new URLSearchParams(location.search).get("token");
  const TOKEN_QUERY = TOKEN ? `?token=${encodeURIComponent(TOKEN)}` : "";

  // State a test (or a curious user in the console) can read.
  const vp = (window.voxpipe = {
    status: "disconnected",
    sampleRate: null, // AudioContext rate: declared input rate and output_sample_rate
    declared: null, // the last session.start sent
    events: [], // every JSON event from the server, in order
    sent: [], // every JSON event sent to the server
    micActive: false,
    audioFramesSent: 0,
    samplesSent: 0,
    audioFramesReceived: 0,
    audioSamplesReceived: 0,
    audioFramesDropped: 0, // frames of cancelled replies, not played
    underruns: 0, // reply chunks that arrived after the previous one had finished playing
    responses: {}, // response_id -> {userText, text, frames, samples, done, cancelled}
    replyText: "", // text of the latest reply so far
    busy: [], // every refusal shown: {reason, retry_after_ms, message} (busy events, 503, close 1013)
    degraded: [], // the latest server.status's conditions ([]: normal service) — see showStatus
    refused: null, // {status, message}: the server refused the connection (401 token, 403 Host/Origin)
  });

  let ctx = null; // AudioContext (one per page)
  let workletLoaded = null; // promise of ctx.audioWorklet.addModule
  let ws = null;
  let connecting = null; // promise resolved on session.started
  let mic = null; // {stream, source, node}
  let activeRid = null; // reply in progress (started, not done or cancelled)
  let lastUser = null; // {el, spoken} of the latest user turn
  const views = new Map(); // response id -> {el: reply bubble, user: its user turn}
  const cancelRequested = new Set(); // response ids the user cancelled

  // ---- UI helpers --------------------------------------------------------------

  function setStatus(state, text) {
    vp.status = text;
    $("status").dataset.state = state;
    $("status").textContent = text;
  }

  function setSpeech(state, text) {
    $("speech").dataset.state = state;
    $("speech").textContent = text;
  }

  function log(text, cls = "") {
    const li = document.createElement("li");
    li.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
    if (cls) li.className = cls;
    const box = $("log");
    box.appendChild(li);
    while (box.children.length > 300) box.removeChild(box.firstChild);
    box.scrollTop = box.scrollHeight;
  }

  // ---- busy: a refused turn or session, with a retry countdown ----------------------

  // What each `busy` reason means, in plain words (docs/PROTOCOL.md, "Admission" and
  // "Degraded service").
  const BUSY_REASONS = {
    queue: "the reply would miss the latency target",
    memory: "the language model's memory is full",
    sessions: "too many sessions are open",
    stage: "a processing stage's queue is full",
    ladder: "a model ran out of memory: new turns are refused while it recovers",
    breaker: "a processing stage is failing or too slow: its circuit breaker is open",
    rate_limited: "this page sends faster than the server allows",
  };
  const SESSIONS_RETRY_MS = 5000; // a refused connection without a Retry-After: the server's own hint

  // A refused turn (a `busy` event) or connection (HTTP 503 / close 1013: reason
  // "sessions"): a bubble in the conversation saying why, and a countdown to when a retry
  // may succeed. `ev`: {reason, retry_after_ms, message}.
  function showBusy(ev) {
    const reason = ev.reason || "unknown";
    const retryMs = Math.max(0, Number(ev.retry_after_ms) || 0);
    vp.busy.push({ reason, retry_after_ms: retryMs, message: ev.message || "" });
    const el = bubble("assistant busy", "");
    el.dataset.reason = reason;
    const text = el.querySelector(".text");
    text.textContent = `Server busy (${reason}): ${BUSY_REASONS[reason] || "it cannot take this turn now"}`;
    const countdown = document.createElement("span");
    countdown.className = "countdown";
    countdown.setAttribute("aria-live", "off"); // the bubble is announced once, not every tick
    text.after(countdown);
    el.querySelector(".meta").textContent = ev.message || "";
    const until = performance.now() + retryMs;
    const tick = () => {
      const left = Math.ceil(Math.max(0, until - performance.now()) / 1000); // whole seconds, 0 at the end
      el.dataset.left = String(left);
      if (left > 0) {
        countdown.textContent = `retry in ${left} s`;
        // next tick at the next whole second (at most 1 s away)
        setTimeout(tick, Math.max(50, until - performance.now() - (left - 1) * 1000));
      } else {
        countdown.textContent = "you can try again now";
        el.classList.add("retry-ok");
      }
    };
    tick();
  }

  // ---- degraded service: the server's latest server.status ---------------------------

  // One condition in words, e.g. "llm out-of-memory step 2" (what), for the tooltip.
  function conditionName(c) {
    const stage = c.stage || "a stage";
    if (c.source === "ladder") return `${stage} out-of-memory step ${c.level}`;
    if (c.source === "breaker") return `${stage} breaker ${String(c.level).replace("_", "-")}`;
    if (c.source === "slo") return `latency over the SLO, level ${c.level}`;
    return [c.source, c.stage, c.level].filter(Boolean).join(" ");
  }

  // A `server.status` (or null: a new connection, nothing known yet): the "degraded" badge
  // next to the connection status, and a line under the header listing each condition's
  // effect, while the server says it is degraded; both hidden otherwise.
  function showStatus(ev) {
    const conditions = ev && ev.degraded ? ev.conditions || [] : [];
    const degraded = !!(ev && ev.degraded);
    vp.degraded = conditions;
    const badge = $("degraded");
    const line = $("degraded-effects");
    badge.hidden = line.hidden = !degraded;
    if (!degraded) {
      badge.title = "";
      line.textContent = "";
      return;
    }
    const effects = conditions.map((c) => c.effect).filter(Boolean);
    badge.title = conditions.length
      ? conditions.map((c) => `${conditionName(c)}: ${c.effect || "no details"}`).join("\n")
      : "degraded service";
    line.textContent = `Degraded service: ${effects.length ? effects.join("; ") : "no details"}`;
  }

  // The upgrade failed before the socket opened (the browser reports only code 1006):
  // ask the same URL over plain HTTP whether it is the session cap (503 + Retry-After).
  // Why a WebSocket was refused before it opened (browsers do not say): ask /ws over plain
  // HTTP. 503 = the session cap (shown as busy); 401/403 = the token, Host or Origin.
  async function refusedForSessions() {
    try {
      const r = await fetch(`/ws${TOKEN_QUERY}`, { cache: "no-store" });
      if (r.status === 401 || r.status === 403) {
        const body = (await r.text()).trim();
        const hint = r.status === 401 ? " — open this page as /?token=YOUR_TOKEN" : "";
        log(`connection refused: HTTP ${r.status}: ${body}${hint}`, "error");
        setStatus("closed", r.status === 401 ? "refused: token needed" : "refused");
        vp.refused = { status: r.status, message: body };
        return false;
      }
      if (r.status !== 503) return false;
      const secs = parseFloat(r.headers.get("Retry-After"));
      const body = (await r.text()).trim();
      log(`connection refused: HTTP 503 (sessions), Retry-After ${r.headers.get("Retry-After")} s: ${body}`, "error");
      showBusy({
        reason: "sessions",
        retry_after_ms: Number.isFinite(secs) ? secs * 1000 : SESSIONS_RETRY_MS,
        message: body || "the server is at its session cap",
      });
      return true;
    } catch {
      return false; // no server at all: the close already said so
    }
  }

  function bubble(role, text) {
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

  function refreshButtons() {
    const open = ws && ws.readyState === WebSocket.OPEN;
    $("start").disabled = !!mic || !!connecting;
    $("stop").disabled = !mic;
    $("cancel").disabled = !open;
  }

  // ---- audio context -----------------------------------------------------------

  // Must run inside a user gesture (click) so the context may play sound.
  function ensureContext() {
    if (!ctx) {
      ctx = new AudioContext({ latencyHint: "interactive" });
      if (ctx.sampleRate < 8000 || ctx.sampleRate > 48000) {
        ctx.close(); // the protocol takes 8–48 kHz
        ctx = new AudioContext({ latencyHint: "interactive", sampleRate: 48000 });
      }
      vp.sampleRate = ctx.sampleRate;
      player = new window.ReplyPlayer(ctx, PLAYBACK_LEAD_S);
      workletLoaded = ctx.audioWorklet.addModule("capture-worklet.js");
    }
    return ctx.resume();
  }

  // ---- WebSocket -----------------------------------------------------------------

  function send(obj) {
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      log(`not connected: ${obj.type} not sent`, "error");
      return false;
    }
    ws.send(JSON.stringify(obj));
    vp.sent.push(obj);
    log(`→ ${obj.type}${obj.text ? `: ${obj.text}` : ""}`, "out");
    return true;
  }

  function connect() {
    if (ws && ws.readyState === WebSocket.OPEN) return Promise.resolve();
    if (connecting) return connecting;
    const url = `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/ws${TOKEN_QUERY}`;
    setStatus("connecting", "connecting…");
    showStatus(null); // a new connection: the server says again if it is degraded
    connecting = new Promise((resolve, reject) => {
      let opened = false; // false at close: the upgrade itself failed (or was refused)
      ws = new WebSocket(url);
      ws.binaryType = "arraybuffer";
      ws.onopen = () => {
        opened = true;
        vp.declared = {
          type: "session.start",
          sample_rate: ctx.sampleRate,
          format: "f32",
          channels: 1,
          output_sample_rate: ctx.sampleRate, // play replies without resampling
        };
        send(vp.declared);
      };
      ws.onmessage = (e) => {
        if (typeof e.data === "string") {
          const ev = JSON.parse(e.data);
          onEvent(ev);
          if (ev.type === "session.started") resolve();
          else if (ev.type === "error" && ev.fatal) reject(new Error(ev.message));
        } else {
          onAudio(e.data);
        }
      };
      ws.onclose = (e) => {
        setStatus("closed", `closed (${e.code}${e.reason ? ` ${e.reason}` : ""})`);
        log(`connection closed: code ${e.code}`, e.code === 1000 ? "" : "error");
        if (e.code === CLOSE_TRY_AGAIN_LATER) {
          // the session cap, hit right after the upgrade
          setStatus("closed", "busy (sessions)");
          showBusy({ reason: "sessions", retry_after_ms: SESSIONS_RETRY_MS, message: e.reason || "server full" });
        } else if (!opened) {
          refusedForSessions().then((busy) => busy && !ws && setStatus("closed", "busy (sessions)"));
        }
        reject(new Error(`connection closed (${e.code})`));
        stopMic();
        ws = null;
        activeRid = null;
        refreshButtons();
      };
      ws.onerror = () => log("WebSocket error", "error");
    }).finally(() => {
      connecting = null;
      refreshButtons();
    });
    refreshButtons();
    return connecting;
  }

  // ---- server events -------------------------------------------------------------

  function response(rid) {
    if (!vp.responses[rid]) {
      vp.responses[rid] = { userText: "", text: "", frames: 0, samples: 0, done: null, cancelled: false };
    }
    return vp.responses[rid];
  }

  function setText(rid, part, text) {
    const v = views.get(rid);
    if (v) v.el.querySelector(part).textContent = text;
  }

  function onEvent(ev) {
    vp.events.push(ev);
    let r;
    switch (ev.type) {
      case "session.started":
        setStatus("open", `connected · ${ev.input.sample_rate} Hz ${ev.input.format}`);
        log(`← session.started ${ev.session_id} in ${JSON.stringify(ev.input)} out ${JSON.stringify(ev.output)}`);
        break;
      case "speech.started":
        setSpeech("speech", "speaking");
        log(`← speech.started at ${ev.audio_ms} ms`);
        break;
      case "speech.stopped":
        setSpeech(mic ? "listening" : "off", mic ? "listening" : "mic off");
        log(`← speech.stopped at ${ev.audio_ms} ms (${ev.reason})`);
        break;
      case "transcript.final":
        lastUser = { el: bubble("user", ev.text), spoken: true };
        lastUser.el.querySelector(".meta").textContent = `spoken · ${(ev.audio_ms / 1000).toFixed(1)} s · ${ev.language}`;
        log(`← transcript.final: ${ev.text}`);
        break;
      case "turn.empty":
        log(`← turn.empty (${ev.reason})`);
        break;
      case "response.started":
        r = response(ev.response_id);
        r.userText = ev.user_text;
        views.set(ev.response_id, { el: bubble("assistant", ""), user: lastUser });
        activeRid = ev.response_id;
        vp.replyText = "";
        log(`← response.started #${ev.response_id}`);
        break;
      case "response.text.delta":
        r = response(ev.response_id);
        r.text += ev.delta;
        setText(ev.response_id, ".text", r.text);
        if (ev.response_id === activeRid) vp.replyText = r.text;
        break;
      case "response.done": {
        r = response(ev.response_id);
        r.done = ev;
        if (activeRid === ev.response_id) activeRid = null;
        const t = ev.timings_ms || {};
        const ms = (k) => (t[k] === undefined ? "–" : `${Math.round(t[k])} ms`);
        const meta = `${ev.audio_s.toFixed(1)} s audio · ${ev.output_tokens} tokens · asr ${ms("asr")} · ` +
          `ttft ${ms("llm_ttft")} · tpot ${ms("llm_tpot")} · first audio ${ms("first_audio")} · ` +
          `voice→voice ${ms("voice_to_voice")}`;
        setText(ev.response_id, ".meta", meta);
        if (!r.text && ev.text) setText(ev.response_id, ".text", ev.text); // no deltas came (a stock line)
        if (ev.text_only && views.has(ev.response_id)) {
          // no speech: the TTS stage's circuit breaker was open (degraded service)
          const el = views.get(ev.response_id).el;
          el.classList.add("text-only");
          const note = document.createElement("span");
          note.className = "note";
          note.textContent = "text only (speech unavailable)";
          el.querySelector(".text").after(note);
        }
        log(`← response.done #${ev.response_id}${ev.text_only ? " (text only)" : ""}: ${meta}`);
        break;
      }
      case "response.cancelled":
        r = response(ev.response_id);
        r.cancelled = true;
        stopReplyAudio(ev.response_id);
        if (activeRid === ev.response_id) activeRid = null;
        setText(ev.response_id, ".meta", cancelRequested.has(ev.response_id) ? "cancelled" : "cancelled by a newer turn");
        if (views.has(ev.response_id)) {
          const { el, user } = views.get(ev.response_id);
          el.classList.add("cancelled");
          // A spoken turn the user went on with: a longer transcript replaces it.
          if (user && user.spoken && !cancelRequested.has(ev.response_id)) user.el.classList.add("cancelled");
        }
        log(`← response.cancelled #${ev.response_id}`);
        break;
      case "busy":
        showBusy(ev);
        log(`← busy (${ev.reason}): retry in ${ev.retry_after_ms} ms: ${ev.message}`, "error");
        break;
      case "server.status":
        showStatus(ev);
        log(ev.degraded
          ? `← server.status degraded: ${(ev.conditions || []).map((c) => `${conditionName(c)} (${c.effect})`).join("; ")}`
          : "← server.status: back to normal", ev.degraded ? "error" : "");
        break;
      case "error":
        log(`← error ${ev.code}${ev.fatal ? " (fatal)" : ""}: ${ev.message}`, "error");
        if (ev.fatal) setStatus("error", `error: ${ev.code}`);
        break;
      default:
        log(`← ${ev.type}`);
    }
    refreshButtons();
  }

  // ---- reply audio (played by player.js) --------------------------------------------

  let player = null; // ReplyPlayer, made with the AudioContext

  function onAudio(buf) {
    vp.audioFramesReceived++;
    if (buf.byteLength < 6) return;
    const rid = new DataView(buf).getUint32(0, true);
    const n = (buf.byteLength - 4) >> 1;
    const r = response(rid);
    r.frames++;
    r.samples += n;
    vp.audioSamplesReceived += n;
    const rate = (vp.declared && vp.declared.output_sample_rate) || ctx.sampleRate;
    const played = r.cancelled ? false : player.play(rid, new Int16Array(buf, 4, n), rate, r.frames === 1);
    if (!played) vp.audioFramesDropped++;
    else if (played.underrun) vp.underruns++;
  }

  function stopReplyAudio(rid) {
    if (player) player.stop(rid);
  }

  // ---- microphone ------------------------------------------------------------------

  async function startMic() {
    await workletLoaded;
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    const source = ctx.createMediaStreamSource(stream);
    const node = new AudioWorkletNode(ctx, "capture-processor", {
      numberOfInputs: 1,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { batchMs: BATCH_MS },
    });
    node.port.onmessage = (e) => {
      if (e.data instanceof Float32Array) sendAudio(e.data);
      else if (e.data && e.data.flushed && mic && mic.onFlushed) mic.onFlushed();
    };
    source.connect(node);
    node.connect(ctx.destination); // silent output; keeps the node pulled by the graph
    mic = { stream, source, node, onFlushed: null };
    vp.micActive = true;
    setSpeech("listening", "listening");
    log(`microphone on (${ctx.sampleRate} Hz, ${BATCH_MS} ms messages)`);
  }

  function sendAudio(samples) {
    if (!ws || ws.readyState !== WebSocket.OPEN) return;
    ws.send(samples.buffer); // Float32Array: little-endian f32 on every browser platform
    vp.audioFramesSent++;
    vp.samplesSent += samples.length;
  }

  // Sends the partial batch still in the worklet; resolves when it has been sent.
  function flushMic() {
    if (!mic) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, 300);
      mic.onFlushed = () => {
        clearTimeout(timer);
        resolve();
      };
      mic.node.port.postMessage({ cmd: "flush" });
    });
  }

  function stopMic() {
    if (!mic) return;
    mic.stream.getTracks().forEach((t) => t.stop());
    mic.source.disconnect();
    mic.node.port.onmessage = null;
    mic.node.disconnect();
    mic = null;
    vp.micActive = false;
    setSpeech("off", "mic off");
  }

  // ---- buttons ---------------------------------------------------------------------

  $("start").onclick = async () => {
    $("start").disabled = true;
    try {
      const resumed = ensureContext();
      await connect();
      await resumed;
      if (!mic) await startMic();
    } catch (err) {
      log(`could not start: ${err.message || err}`, "error");
    }
    refreshButtons();
  };

  $("stop").onclick = async () => {
    if (!mic) return;
    await flushMic();
    stopMic();
    send({ type: "input.end" }); // the turn ends now; the socket stays open for the reply
    refreshButtons();
  };

  $("cancel").onclick = () => {
    // Silence everything now; the server confirms with response.cancelled.
    if (player) player.stopAll();
    if (activeRid !== null) {
      cancelRequested.add(activeRid);
      stopReplyAudio(activeRid);
    }
    send({ type: "response.cancel" });
  };

  $("text-form").onsubmit = async (e) => {
    e.preventDefault();
    const text = $("text").value.trim();
    if (!text) return;
    try {
      ensureContext();
      await connect();
    } catch (err) {
      log(`could not connect: ${err.message || err}`, "error");
      return;
    }
    if (send({ type: "text.input", text })) {
      lastUser = { el: bubble("user", text), spoken: false };
      lastUser.el.querySelector(".meta").textContent = "typed";
      $("text").value = "";
    }
  };

  refreshButtons();
})();
