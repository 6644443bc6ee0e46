// voxpipe browser demo: microphone → WebSocket (Opus where the browser and the server can,
// else f32, at the AudioContext rate), live transcripts, reply text and reply audio back
// (Opus or PCM16). Protocol: docs/PROTOCOL.md.
// Modules: audio.js (context, microphone, playback, levels), protocol.js (the socket and
// reconnection), opus.js (WebCodecs Opus), ui.js (what is on screen), settings.js (saved
// choices), tools.js (tool calls).

import { makeContext, Mic, micErrorKind, ReplyPlayer } from "./audio.js";
import * as opus from "./opus.js";
import { Connection } from "./protocol.js";
import { bindSettingsForm, loadSettings, sessionFields } from "./settings.js";
import * as tools from "./tools.js";
import * as ui from "./ui.js";
import { bindTransportToggle, RtcConnection, wantWebRtc } from "./webrtc.js";

const { $, log } = ui;
const BATCH_MS = 20; // audio per binary message
const TICK_MS = 100; // state, meters and playback counts refresh

// State a test (or a curious user in the console) can read.
const vp = (window.voxpipe = {
  status: "disconnected",
  state: "off", // the conversation state badge's key (ui.STATES)
  sampleRate: null, // AudioContext rate: declared input rate and (by default) output_sample_rate
  declared: null, // the last session.start sent
  events: [], // every JSON event from the server, in order (all sessions)
  sent: [], // every JSON event sent to the server
  sessionId: null, // the current session's id
  sessions: 0, // sessions started on this page (a reconnect is a new one)
  micActive: false,
  micError: null, // why the microphone could not start: audio.js micErrorKind
  micKind: null, // "worklet" | "script-processor"
  codec: null, // "opus" | "pcm": the audio codec of the session (declared; as started once it is)
  audioFramesSent: 0,
  samplesSent: 0,
  bytesSent: 0, // binary messages' bytes sent (the audio's, whatever its codec)
  bytesReceived: 0, // binary messages' bytes received (response_id headers included)
  audioFramesReceived: 0,
  audioSamplesReceived: 0,
  audioFramesDropped: 0, // frames of cancelled replies, not played
  underruns: 0, // reply chunks that arrived after the previous one had finished playing
  toolCalls: [], // this session's tool calls: {response_id, call_id, name, arguments, runs_on, output, error, ms}
  responses: {}, // this session's replies: response_id -> {userText, text, frames, samples, playedSamples, done, cancelled}
  replyText: "", // text of the latest reply so far
  busy: [], // every refusal shown: {reason, retry_after_ms, message} (busy events, 503, close 1013)
  degraded: [], // the latest server.status's conditions ([]: normal service)
  refused: null, // {status, message}: the server refused the connection (401 token, 403 Host/Origin)
  reconnects: [], // every scheduled reconnection: {attempt, delayMs}
  playback: null, // the player's counts: {scheduledSamples, playedSamples, underruns, flushes, playing}
  settings: loadSettings(),
});
const settings = vp.settings;
vp.transport = wantWebRtc() && window.RTCPeerConnection ? "webrtc" : "websocket"; // webrtc.js

let ctx = null; // AudioContext (one per page; null where the browser has none)
let player = null; // ReplyPlayer
let mic = null; // Mic
let talking = false; // push-to-talk: the talk button is held
let userSpeaking = false; // between speech.started and speech.stopped
let thinking = false; // a turn ended, its reply not started yet
let activeRid = null; // reply in progress (started, not done or cancelled)
let lastSpeechTid = 0; // the turn_id of the latest speech.started
let lastUser = null; // the latest user turn: {el, spoken, sentAt}
let turns = new Map(); // turn_id -> {el, spoken: true, final}: this session's spoken turns
let views = new Map(); // response id -> {el: reply bubble, user: its user turn}
let cancelRequested = new Set(); // response ids the user cancelled
let encoder = null; // opus.OpusMicEncoder of the latest session.start (made at its first audio)
let outFormat = "pcm16"; // the reply audio's format, as session.started says
let declaring = false; // a session.start awaits its session.started
let opusRefused = false; // Opus is off for this page: the server refused it (an older one) or the encoder failed
const decoders = new opus.OpusReplyDecoders( // decoded Opus plays as PCM would (playFrame)
  ({ rid, r }, pcm, rate, first) => playFrame(rid, r, { pcm, rate, first }),
  (k, err) => log(`reply audio ${k}: the Opus decoder failed: ${err.message || err}`, "error"),
);

const conn = new (vp.transport === "webrtc" ? RtcConnection : Connection)({
  hello,
  onEvent,
  onAudio,
  onSent: (obj) => {
    vp.sent.push(obj);
    log(`→ ${obj.type}${obj.text ? `: ${obj.text}` : ""}`, "out");
  },
  onState,
});

function setConnection(state, text) {
  vp.status = text;
  ui.setConnection(state, text);
}

// The session.start for a new socket (or for new settings on this one): Opus where wanted
// and the browser can (opus.js audioFields; probeOpus() asked it before), else PCM.
function hello() {
  const rate = ctx ? ctx.sampleRate : 16000;
  const fields = sessionFields(settings, ctx ? ctx.sampleRate : 24000);
  vp.declared = { type: "session.start", sample_rate: rate, channels: 1,
                  ...opus.audioFields(wantOpus(), rate, fields.output_sample_rate), ...fields };
  vp.codec = vp.declared.format === "opus" ? "opus" : "pcm";
  if (encoder) encoder.close(); // a new declaration reads a new stream
  encoder = null;
  declaring = true;
  return vp.declared;
}

const wantOpus = () => !!ctx && settings.codec === "auto" && !opusRefused;
const probeOpus = () => (wantOpus() ? opus.probe(ctx.sampleRate, sessionFields(settings, ctx.sampleRate)
  .output_sample_rate) : Promise.resolve());

const key = (rid) => `${vp.sessionId}:${rid}`; // replies are keyed per session: ids restart at 1

// ---- the connection --------------------------------------------------------------------

function micWord() {
  return { denied: "mic blocked", no_mic: "no microphone", insecure: "no microphone here" }[vp.micError]
    || "microphone failed";
}

function showConnected() {
  const declared = vp.declared ? `${vp.declared.sample_rate} Hz ${vp.declared.format}` : "";
  const input = vp.transport === "webrtc" ? "WebRTC" : declared;
  if (vp.micError) setConnection("warn", `connected · ${micWord()}`);
  else setConnection("open", `connected · ${input}`);
}

function onState(state, info) {
  if (state === "connecting") {
    setConnection("connecting", "connecting…");
    vp.degraded = ui.showStatus(null); // a new connection: the server says again if it is degraded
  } else if (state === "open") {
    showConnected();
    ui.hideBanner("gone", "not_ready", "error", "idle", "busy");
  } else if (state === "retrying") {
    vp.reconnects.push({ attempt: info.attempt, delayMs: info.delayMs });
  } else if (state === "closed") {
    onClosed(info);
  }
  refresh();
}

function onClosed(info) {
  log(`connection closed: code ${info.code}${info.reason ? ` ${info.reason}` : ""}`, info.code === 1000 ? "" : "error");
  if (player) player.stopAll();
  decoders.dropAll();
  // what the session left unfinished stays on screen as such
  for (const tid of [...turns.keys()]) dropEmptyTurn(tid, "not answered: the connection was lost");
  const v = activeRid === null ? null : views.get(activeRid);
  if (v) {
    v.el.classList.add("cancelled");
    ui.setMeta(v.el, "cut off: the connection was lost");
  }
  activeRid = null;
  userSpeaking = thinking = false;
  const until = info.retryInMs === null ? null : performance.now() + info.retryInMs;
  const retry = { until, action: { label: "Reconnect now", run: () => conn.retryNow() } };
  const refused = info.refused;
  if (refused && (refused.kind === "token" || refused.kind === "forbidden")) {
    const hint = refused.status === 401 ? " — open this page as /?token=YOUR_TOKEN" : "";
    log(`connection refused: HTTP ${refused.status}: ${refused.message}${hint}`, "error");
    setConnection("closed", refused.status === 401 ? "refused: token needed" : "refused");
    vp.refused = { status: refused.status, message: refused.message };
    ui.showBanner(refused.kind);
  } else if (refused && refused.kind === "sessions") {
    log(`connection refused (sessions): ${refused.message}`, "error");
    const ev = { reason: "sessions", retry_after_ms: Math.max(refused.retryMs, info.retryInMs || 0),
                 message: refused.message || "server full" };
    if (info.attempt <= 1) busy(ev); // a bubble for the refusal, the banner alone for the retries after it
    else ui.busyBanner(ev.reason, ev.retry_after_ms);
    setConnection("closed", "busy (sessions)");
  } else if (info.fatal === "not_ready") {
    setConnection("connecting", "server warming up");
    ui.showBanner("not_ready", { ...retry, countdown: (s) => (s > 0 ? ` Trying again in ${s} s…` : " Trying again…") });
  } else if (info.fatal === "idle_timeout" || info.reason === "idle") {
    setConnection("closed", "closed (idle)");
    ui.showBanner("idle");
  } else {
    setConnection("closed", `closed (${info.code}${info.reason ? ` ${info.reason}` : ""})`);
    if (until !== null) {
      ui.showBanner("gone", { ...retry, countdown: (s) => (s > 0 ? ` Reconnecting in ${s} s (attempt ${info.attempt})…`
                                                           : " Reconnecting…") });
    } else {
      ui.showBanner("gone", { detail: "Press Start or send a message to reconnect." });
    }
  }
  if (until === null) stopMic(); // not coming back on its own; a reconnect keeps the microphone
}

// ---- server events -----------------------------------------------------------------

function response(rid) {
  if (!vp.responses[rid]) {
    vp.responses[rid] = { userText: "", text: "", frames: 0, samples: 0, playedSamples: 0, done: null,
                          cancelled: false, reason: null, spokenText: null };
  }
  return vp.responses[rid];
}

function setText(rid, text) {
  const v = views.get(rid);
  if (v) v.el.querySelector(".text").textContent = text;
}

// A new session (not a re-declared one): everything keyed by its ids starts afresh.
function newSession(id) {
  vp.sessionId = id;
  vp.sessions++;
  vp.responses = {};
  vp.toolCalls = [];
  views = new Map();
  turns = new Map();
  lastSpeechTid = 0;
  cancelRequested = new Set();
  activeRid = null;
  userSpeaking = thinking = false;
  if (player) player.stopAll();
  decoders.dropAll();
}

// The bubble of spoken turn `tid` (made when its speech starts; reused when it continues).
function userTurn(tid) {
  let t = turns.get(tid);
  if (!t) {
    t = { el: ui.bubble("user", ""), spoken: true, final: false, finalText: "", tid };
    ui.showTranscript(t.el, "", "…", false);
    t.el.dataset.turn = String(tid);
    turns.set(tid, t);
  }
  return t;
}

// Speech (again) in turn `t`: its bubble is live until the turn's next transcript.final.
function resumeTurn(t) {
  t.final = false;
  t.el.dataset.final = "false";
  t.el.classList.add("partial");
}

// A turn that ended without a (new) transcript (no words, refused): a continued turn shows
// its words as before; a new one keeps its bubble only if it heard words and `note` says why
// no reply follows (turn.empty: null, the bubble goes).
function dropEmptyTurn(tid, note) {
  const t = turns.get(tid);
  if (!t || t.final) return;
  if (t.finalText) {
    t.final = true;
    ui.showTranscript(t.el, t.finalText, "", true);
    return;
  }
  const words = t.el.querySelector(".text").textContent.replace(/…$/, "").trim();
  if (note === null || !words) {
    t.el.remove();
    turns.delete(tid);
    return;
  }
  t.final = true;
  ui.showTranscript(t.el, words, "", true);
  ui.setMeta(t.el, note);
}

// The user speaks while a reply plays: a reply already fully sent (the server can no longer
// stop it) or one of the turn the user is continuing stops now; one still being sent is
// turned down until the server decides (response.cancelled on a barge-in) or speech ends.
function userResumed(tid) {
  if (!player || !player.isPlaying()) return;
  for (const [rid, v] of views) {
    const r = vp.responses[rid];
    if (!player.isPlayingKey(key(rid)) || !r) continue;
    if (r.done || (v.user && v.user.tid === tid)) {
      player.stop(key(rid));
      r.flushed = true;
      ui.setMeta(v.el, `${v.el.querySelector(".meta").textContent} · stopped: you went on talking`);
      log(`reply #${rid}: playback stopped (you spoke)`);
    } else {
      player.duck(true);
    }
  }
}

function onEvent(ev) {
  vp.events.push(ev);
  let r;
  switch (ev.type) {
    case "session.started":
      if (ev.session_id !== vp.sessionId) newSession(ev.session_id);
      declaring = false;
      vp.codec = ev.input.format === "opus" ? "opus" : "pcm";
      outFormat = ev.output.format;
      log(`← session.started ${ev.session_id} in ${JSON.stringify(ev.input)} out ${JSON.stringify(ev.output)}`
          + ` · turns end by ${ev.end_of_turn}${ev.eagerness ? ` (eagerness ${ev.eagerness})` : ""}`);
      if (vp.declared && vp.declared.end_of_turn && vp.declared.vad !== false
          && ev.end_of_turn !== vp.declared.end_of_turn) {
        log(`the server ends turns by ${ev.end_of_turn}: it has no end-of-turn model`, "error");
      }
      break;
    case "speech.started":
      userSpeaking = true;
      lastSpeechTid = ev.turn_id;
      userResumed(ev.turn_id);
      resumeTurn(userTurn(ev.turn_id));
      log(`← speech.started turn ${ev.turn_id} at ${ev.audio_ms} ms`);
      break;
    case "speech.stopped":
      userSpeaking = false;
      if (player) player.duck(false);
      if (ev.reason !== "restart") thinking = true;
      log(`← speech.stopped turn ${ev.turn_id} at ${ev.audio_ms} ms (${ev.reason})`);
      break;
    case "transcript.partial": {
      const t = userTurn(ev.turn_id);
      ui.showTranscript(t.el, ev.committed, ev.unstable, false);
      log(`← transcript.partial: ${ev.committed} [${ev.unstable}]`);
      break;
    }
    case "transcript.final": {
      if (ev.continues_turn_id != null) joinInto(turns.get(ev.continues_turn_id), ev.turn_id);
      const t = userTurn(ev.turn_id);
      t.final = true;
      t.finalText = ev.text;
      ui.showTranscript(t.el, ev.text, "", true);
      ui.setMeta(t.el, ev.unanswered // a refused turn's words (its busy came first): no reply follows
        ? "not answered: the server was busy"
        : `spoken · ${(ev.audio_ms / 1000).toFixed(1)} s${ev.language ? ` · ${ev.language}` : ""}`);
      if (!ev.unanswered) lastUser = t;
      log(`← transcript.final: ${ev.text}`);
      break;
    }
    case "turn.empty":
      thinking = false;
      dropEmptyTurn(ev.turn_id, null);
      log(`← turn.empty (${ev.reason})`);
      break;
    case "response.started":
      r = response(ev.response_id);
      r.userText = ev.user_text;
      views.set(ev.response_id, { el: ui.bubble("assistant", ""), user: lastUser });
      if (lastUser && !lastUser.spoken) r.sentAt = lastUser.sentAt;
      activeRid = ev.response_id;
      thinking = false;
      vp.replyText = "";
      log(`← response.started #${ev.response_id}`);
      break;
    case "response.text.delta":
      r = response(ev.response_id);
      r.text += ev.delta;
      if (!r.cancelled) setText(ev.response_id, r.text);
      if (ev.response_id === activeRid) vp.replyText = r.text;
      break;
    case "response.done":
      onDone(ev);
      break;
    case "response.cancelled":
      onCancelled(ev);
      break;
    case "response.paused": // the user speaks over it: hold its later audio until the server decides
      response(ev.response_id).held = [];
      log(`← response.paused #${ev.response_id} (${ev.reason})`);
      break;
    case "response.resumed": // a false interruption: what was held plays on
      r = response(ev.response_id);
      for (const frame of r.held || []) playFrame(ev.response_id, r, frame);
      r.held = null;
      if (r.done) decoders.end(key(ev.response_id)); // its last packets were held
      log(`← response.resumed #${ev.response_id} after ${ev.paused_ms} ms`);
      break;
    case "tool.call":
    case "tool.output":
      onTool(ev);
      break;
    case "busy":
      thinking = false;
      busy(ev);
      dropEmptyTurn(ev.turn_id, "not answered: the server was busy");
      log(`← busy (${ev.reason}): retry in ${ev.retry_after_ms} ms: ${ev.message}`, "error");
      break;
    case "server.status":
      vp.degraded = ui.showStatus(ev);
      log(ev.degraded
        ? `← server.status degraded: ${(ev.conditions || []).map((c) => `${ui.conditionName(c)} (${c.effect})`).join("; ")}`
        : "← server.status: back to normal", ev.degraded ? "error" : "");
      break;
    case "error":
      if (opus.refusesOpus(ev, vp.declared, declaring)) { // an older server: PCM for this page
        opusRefused = true;
        log("← error bad_event: the server does not take Opus; sending PCM instead");
        conn.send(hello());
        break;
      }
      log(`← error ${ev.code}${ev.fatal ? " (fatal)" : ""}: ${ev.message}`, "error");
      if (!ev.fatal) ui.showBanner("error", { detail: ev.message });
      else if (ev.code === "internal") ui.showBanner("error", { detail: ev.message });
      break;
    default:
      log(`← ${ev.type}`);
  }
  refresh();
}

// A reply's tool call, or its result: a line under the reply (tools.js) and vp.toolCalls.
function onTool(ev) {
  let call = vp.toolCalls.find((c) => c.call_id === ev.call_id);
  if (!call) {
    call = { response_id: ev.response_id, call_id: ev.call_id, name: ev.name, arguments: ev.arguments || {},
             runs_on: ev.runs_on || "server", output: null, error: null, ms: null };
    vp.toolCalls.push(call);
  }
  if (ev.type === "tool.output") Object.assign(call, { output: ev.output, error: ev.error ?? null, ms: ev.ms });
  const v = views.get(ev.response_id);
  if (v) (ev.type === "tool.call" ? tools.showToolCall : tools.showToolOutput)(v.el, ev);
  log(tools.logLine(ev), ev.error ? "error" : "");
}

function onDone(ev) {
  const r = response(ev.response_id);
  r.done = ev;
  if (!r.held) decoders.end(key(ev.response_id)); // its last packet came: decode the rest, free it
  if (activeRid === ev.response_id) activeRid = null;
  const v = views.get(ev.response_id);
  const spoken = !!(v && v.user && v.user.spoken);
  const replyMs = r.sentAt !== undefined && r.firstAudioAt !== undefined ? r.firstAudioAt - r.sentAt : null;
  const meta = ui.latencyLine(ev, spoken, replyMs);
  if (v) {
    ui.setMeta(v.el, meta);
    if (!r.text && ev.text) setText(ev.response_id, ev.text); // no deltas came (a stock line)
    if (ev.text_only) {
      // no speech: the TTS stage's circuit breaker was open (degraded service)
      v.el.classList.add("text-only");
      ui.addNote(v.el, "text only (speech unavailable)");
    }
  }
  log(`← response.done #${ev.response_id}${ev.text_only ? " (text only)" : ""}: ${meta}`);
}

// Spoken turn `tid` continues `t` after all: speech that began as a turn of its own (over
// the audible reply, a new turn_id) goes on with `t`, as the server says by cancelling `t`'s
// reply (`continued`; `tid` is then the latest speech) or, when that reply was already all
// sent, by the final's `continues_turn_id`. Its transcript, under the new id, holds the
// whole utterance: `tid`'s bubble goes and `t`'s shows it (its final, if it came; else `t`
// is live again). Returns false when there is nothing to join (already joined, no bubble).
function joinInto(t, tid) {
  const later = turns.get(tid);
  if (!t || !t.spoken || !later || later === t || tid <= t.tid) return false;
  later.el.remove();
  turns.set(tid, t);
  for (const v of views.values()) if (v.user === later) v.user = t;
  if (later.final) {
    t.final = true;
    t.finalText = later.finalText;
    ui.showTranscript(t.el, later.finalText, "", true);
  } else {
    resumeTurn(t);
  }
  return true;
}

function onCancelled(ev) {
  const r = response(ev.response_id);
  r.cancelled = true;
  r.reason = ev.reason;
  r.spokenText = ev.spoken_text;
  if (player) player.stop(key(ev.response_id));
  decoders.drop(key(ev.response_id));
  if (activeRid === ev.response_id) activeRid = null;
  const v = views.get(ev.response_id);
  if (v && ev.reason === "continued") joinInto(v.user, lastSpeechTid);
  if (v) {
    if (ev.reason === "continued" && !ev.spoken_text.trim()) {
      v.el.remove(); // a reply to half a sentence that never spoke: the turn goes on in its bubble
    } else {
      ui.showCancelled(v.el, ev.spoken_text, ev.reason);
    }
  }
  log(`← response.cancelled #${ev.response_id} (${ev.reason}); spoken: ${JSON.stringify(ev.spoken_text)}`);
}

function busy(ev) {
  vp.busy.push({ reason: ev.reason || "unknown", retry_after_ms: Math.max(0, Number(ev.retry_after_ms) || 0),
                 message: ev.message || "" });
  ui.showBusy(ev);
}

// ---- reply audio -----------------------------------------------------------------------

// A binary frame: response_id, then PCM16 — or one Opus packet (session.started's output
// format), decoded by the reply's own decoder into the same playback. r.samples counts the
// samples at the output rate either way (Opus: as the packet's header says).
function onAudio(buf) {
  vp.audioFramesReceived++;
  vp.bytesReceived += buf.byteLength;
  const isOpus = outFormat === "opus";
  if (buf.byteLength < (isOpus ? 5 : 6)) return;
  const rid = new DataView(buf).getUint32(0, true);
  const packet = isOpus ? new Uint8Array(buf, 4) : null;
  const n = isOpus ? Math.round((opus.packetSamples48k(packet) * outRate()) / 48000) : (buf.byteLength - 4) >> 1;
  const r = response(rid);
  r.frames++;
  r.samples += n;
  if (r.firstAudioAt === undefined) r.firstAudioAt = performance.now();
  vp.audioSamplesReceived += n;
  const frame = isOpus ? { packet } : { pcm: new Int16Array(buf, 4, n), rate: outRate(), first: r.frames === 1 };
  if (r.held && !r.cancelled) r.held.push(frame); // paused: queued (undecoded) only once resumed
  else playFrame(rid, r, frame);
}

const outRate = () => (vp.declared && vp.declared.output_sample_rate) || 24000;

// Play a frame of reply `rid` (PCM at frame.rate, counted at the reply's rate), or decode it
// (an Opus packet); dropped if the reply was stopped.
function playFrame(rid, r, frame) {
  const live = !r.cancelled && !r.flushed && !!player;
  if (frame.packet && live) return decoders.decode(key(rid), frame.packet, outRate(), { rid, r }); // → playFrame
  const played = live && player.play(key(rid), frame.pcm, frame.rate, frame.first,
                                     Math.round((frame.pcm.length * outRate()) / frame.rate));
  if (!played) vp.audioFramesDropped++;
  else if (played.underrun) vp.underruns++;
}

// ---- audio context and microphone --------------------------------------------------------

// Must run inside a user gesture (a click) so the context may play sound.
function ensureContext() {
  if (!ctx) {
    try {
      ctx = makeContext(window.AudioEncoder ? opus.OPUS_RATES : null); // Opus, now or after a settings change
    } catch (err) {
      log(`no audio: ${err.message || err}`, "error");
    }
    if (!ctx) return Promise.resolve();
    vp.sampleRate = ctx.sampleRate;
    player = new ReplyPlayer(ctx);
  }
  return ctx.resume();
}

async function startMic() {
  if (!ctx) throw Object.assign(new Error("this browser has no Web Audio"), { name: "NoMic" });
  mic = await Mic.open(ctx, BATCH_MS, sendAudio);
  if (conn.setMicTrack) conn.setMicTrack(mic.stream.getAudioTracks()[0]); // WebRTC: the track carries it
  vp.micActive = true;
  vp.micError = null;
  vp.micKind = mic.kind;
  ui.hideBanner("denied", "no_mic", "mic_busy", "insecure", "mic_failed");
  if (conn.open) showConnected();
  log(`microphone on (${ctx.sampleRate} Hz, ${BATCH_MS} ms messages, ${mic.kind})`);
}

function micFailed(err) {
  vp.micError = micErrorKind(err);
  log(`microphone: ${err.name || "error"}: ${err.message || err}`, "error");
  ui.showBanner(vp.micError);
  if (conn.open) showConnected();
}

function sendAudio(samples) {
  if (vp.transport === "webrtc") return; // the peer connection's track carries the microphone
  if (settings.pushToTalk && !talking) return; // push-to-talk: only while the button is held
  if (vp.declared && vp.declared.format === "opus") {
    if (!conn.open) return;
    if (!encoder) encoder = new opus.OpusMicEncoder(vp.declared.sample_rate, sendPacket, encoderFailed);
    encoder.push(samples); // its packets go out in sendPacket
  } else if (!conn.sendBinary(samples.buffer)) { // Float32Array: little-endian f32 on every browser platform
    return;
  } else {
    vp.audioFramesSent++;
    vp.bytesSent += samples.byteLength;
  }
  vp.samplesSent += samples.length;
}

function sendPacket(packet) {
  if (!conn.sendBinary(packet)) return;
  vp.audioFramesSent++;
  vp.bytesSent += packet.byteLength;
}

function encoderFailed(err) {
  log(`microphone: the Opus encoder failed (${err.message || err}): sending PCM instead`, "error");
  opusRefused = true;
  if (conn.open) conn.send(hello());
}

// The microphone's audio still on its way (the worklet's partial batch, the encoder's last
// frame) sent: then input.end may follow.
async function flushAudio() {
  await mic.flush();
  if (encoder) await encoder.flush();
}

function stopMic() {
  if (!mic) return;
  if (conn.setMicTrack) conn.setMicTrack(null);
  mic.close();
  mic = null;
  talking = false;
  vp.micActive = false;
}

// ---- state, meters, buttons ---------------------------------------------------------------

function conversationState() {
  const playing = (!!player && player.isPlaying()) || !!conn.playing;
  if (userSpeaking || talking) return "user";
  if (playing) return "speaking";
  if (thinking || activeRid !== null) return "thinking";
  if (mic) return conn.open ? "listening" : "waiting";
  return "off";
}

function refresh() {
  vp.state = conversationState();
  ui.setState(vp.state);
  const playing = (!!player && player.isPlaying()) || !!conn.playing;
  $("start").disabled = !!mic || !!conn.pending;
  $("stop").disabled = !mic;
  $("cancel").disabled = activeRid === null && !playing;
  $("talk").hidden = !(settings.pushToTalk && mic);
  ui.setOutputActive(playing);
}

function tick() {
  refresh();
  ui.showLevels(mic ? mic.level() : 0, conn.level ? conn.level() : player ? player.level() : 0);
  if (player) {
    vp.playback = { ...player.stats, playing: player.isPlaying() };
    for (const rid of Object.keys(vp.responses)) vp.responses[rid].playedSamples = player.played.get(key(rid)) || 0;
  }
}

$("start").onclick = async () => {
  $("start").disabled = true;
  const resumed = ensureContext();
  try {
    await probeOpus();
    await conn.connect();
  } catch (err) {
    log(`could not connect: ${err.message || err}`, "error");
  }
  try {
    await resumed;
    if (!mic) await startMic();
  } catch (err) {
    micFailed(err);
  }
  refresh();
};

$("stop").onclick = async () => {
  if (!mic) return;
  await flushAudio();
  stopMic();
  conn.send({ type: "input.end" }); // the turn ends now; the socket stays open for the reply
  refresh();
};

$("cancel").onclick = () => {
  // Silence everything now; the server confirms with response.cancelled.
  if (player) player.stopAll();
  if (activeRid !== null) cancelRequested.add(activeRid);
  conn.send({ type: "response.cancel" });
  refresh();
};

// Push-to-talk: audio goes out while the button is held; letting go ends the turn.
function talk(on) {
  if (!mic || talking === on) return;
  talking = on;
  if (on) {
    if (player) player.stopAll();
  } else {
    flushAudio().then(() => conn.send({ type: "input.end" }));
  }
  refresh();
}
$("talk").onpointerdown = (e) => {
  e.preventDefault();
  talk(true);
};
$("talk").onpointerup = $("talk").onpointerleave = () => talk(false);
$("talk").onkeydown = (e) => (e.key === " " || e.key === "Enter") && !e.repeat && talk(true);
$("talk").onkeyup = (e) => (e.key === " " || e.key === "Enter") && talk(false);

$("text-form").onsubmit = async (e) => {
  e.preventDefault();
  const text = $("text").value.trim();
  if (!text) return;
  try {
    ensureContext();
    await probeOpus();
    await conn.connect();
  } catch (err) {
    log(`could not connect: ${err.message || err}`, "error");
    return;
  }
  const sentAt = performance.now();
  if (conn.send({ type: "text.input", text })) {
    lastUser = { el: ui.bubble("user", text), spoken: false, sentAt };
    ui.setMeta(lastUser.el, "typed");
    thinking = true;
    $("text").value = "";
  } else {
    log("not connected: text.input not sent", "error");
  }
  refresh();
};

bindSettingsForm(settings, async () => {
  // a session already open takes the new settings now (a new session.start re-declares it)
  refresh();
  await probeOpus();
  if (conn.open) conn.send(hello());
});

// the event log is folded on a small screen
const wide = window.matchMedia("(min-width: 700px)");
$("log-box").open = wide.matches;
wide.onchange = () => ($("log-box").open = wide.matches);
setInterval(tick, TICK_MS);
refresh();
bindTransportToggle($("webrtc")); // "Connect over WebRTC" (webrtc.js)
