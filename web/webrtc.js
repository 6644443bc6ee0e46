// voxpipe browser demo over WebRTC (docs/PROTOCOL.md, "WebRTC"): the microphone goes out
// as an Opus track (the browser's echo cancellation, jitter buffer and packet-loss
// concealment), the reply comes back as a track played by an <audio> element, and the
// protocol's JSON events travel both ways on a data channel named "events".
// RtcConnection has the interface of protocol.js's Connection, so the page feeds the
// same event handler either way. No DOM here but the <audio> element it plays through.

import { backoffMs, CLOSE_NORMAL, SESSIONS_RETRY_MS } from "./protocol.js";

const KEY = "voxpipe.transport";
const TOKEN = new URLSearchParams(location.search).get("token");
const GATHER_MS = 3000; // non-trickle ICE: the offer goes once gathering is complete, or after this
const STATS_MS = 250; // how often the reply's level and the byte counts are read
const PLAYING_LEVEL = 0.005; // the reply track's audioLevel above which the assistant is speaking
const CLOSE_LOST = 1006; // the close code the page reports for a connection lost (as a WebSocket's)

// Whether this page talks over WebRTC: ?transport=webrtc|websocket in its URL, else the
// choice saved by the toggle (default: the WebSocket).
export function wantWebRtc() {
  const q = new URLSearchParams(location.search).get("transport");
  if (q) return q === "webrtc";
  try {
    return localStorage.getItem(KEY) === "webrtc";
  } catch {
    return false;
  }
}

// The "Connect over WebRTC" checkbox: shows the choice; changing it saves it and reloads
// the page with it (a session cannot change its transport).
export function bindTransportToggle(box) {
  if (!box) return;
  box.checked = wantWebRtc();
  box.disabled = !window.RTCPeerConnection;
  box.onchange = () => {
    const transport = box.checked ? "webrtc" : "websocket";
    try {
      localStorage.setItem(KEY, transport);
    } catch {
      /* storage off: the URL carries it */
    }
    const url = new URL(location.href);
    url.searchParams.set("transport", transport);
    location.assign(url.href);
  };
}

// Resolves once `pc` has gathered its ICE candidates (or after GATHER_MS).
function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, GATHER_MS);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") {
        clearTimeout(timer);
        resolve();
      }
    });
  });
}

// Why an offer was refused, in protocol.js's words: {kind, status, message[, retryMs]}.
async function refusal(r) {
  const message = (await r.text()).trim();
  if (r.status === 401) return { kind: "token", status: 401, message };
  if (r.status === 403) return { kind: "forbidden", status: 403, message };
  if (r.status === 503) {
    const secs = parseFloat(r.headers.get("Retry-After"));
    const retryMs = Number.isFinite(secs) ? secs * 1000 : SESSIONS_RETRY_MS;
    if (message.startsWith("server full")) return { kind: "sessions", status: 503, retryMs, message };
    return { kind: "unavailable", status: 503, retryMs, message };
  }
  return { kind: "failed", status: r.status, message }; // 400 (a bad offer), 501 (no aiortc): not retried
}

// One session over a peer connection, reconnected after it is lost. Handlers as for
// protocol.js's Connection: hello(), onEvent(ev), onSent(obj), onState(state, info).
export class RtcConnection {
  constructor(handlers) {
    this.h = handlers;
    this.pc = null;
    this.channel = null;
    this.sender = null; // the microphone's RTP sender
    this.micTrack = null;
    this.pending = null;
    this.wanted = false;
    this.attempt = 0;
    this.timer = null;
    this.retryAt = 0;
    this.sessionOpen = false;
    this.audio = new Audio(); // plays the reply track
    this.audio.autoplay = true;
    this.statsTimer = null;
    // what a test (or the console) can read: window.voxpipe.rtc
    this.stats = { state: "new", offers: 0, answerMs: null, connectedMs: null, bytesSent: 0, bytesReceived: 0,
                   packetsLost: 0, audioLevel: 0, totalAudioEnergy: 0, totalSamplesDuration: 0,
                   concealedSamples: 0, totalSamplesReceived: 0, jitterBufferMs: null, playing: false,
                   elementPlaying: false };
    if (window.voxpipe) window.voxpipe.rtc = this.stats;
  }

  get open() {
    return !!this.channel && this.channel.readyState === "open" && this.sessionOpen;
  }

  // The assistant's voice is sounding (the reply track's level, read every STATS_MS).
  get playing() {
    return this.stats.playing;
  }

  // The reply's level for the output meter, in [0, 1].
  level() {
    return this.stats.audioLevel;
  }

  send(obj) {
    if (!this.channel || this.channel.readyState !== "open") return false;
    this.channel.send(JSON.stringify(obj));
    if (this.h.onSent) this.h.onSent(obj);
    return true;
  }

  // Audio goes on the track, never as messages.
  sendBinary() {
    return false;
  }

  // The microphone to send (a MediaStreamTrack), or null: nothing is sent.
  setMicTrack(track) {
    this.micTrack = track;
    if (this.sender) this.sender.replaceTrack(track).catch(() => {});
  }

  connect() {
    this.wanted = true;
    if (this.open) return Promise.resolve();
    if (this.pending) return this.pending;
    clearTimeout(this.timer);
    this.timer = null;
    this.h.onState("connecting", {});
    this.pending = this.attemptOnce().finally(() => {
      this.pending = null;
    });
    this.pending.catch(() => {}); // a failed attempt is reported through onState
    return this.pending;
  }

  async attemptOnce() {
    const t0 = performance.now();
    const pc = (this.pc = new RTCPeerConnection()); // no STUN/TURN: this host or its network only
    const transceiver = pc.addTransceiver("audio", { direction: "sendrecv" });
    this.sender = transceiver.sender;
    if (this.micTrack) await this.sender.replaceTrack(this.micTrack);
    const channel = (this.channel = pc.createDataChannel("events"));
    let started; // resolves on session.started
    const sessionStarted = new Promise((resolve, reject) => (started = { resolve, reject }));
    sessionStarted.catch(() => {}); // a connection lost before its session.started: reported through onState
    let fatal = null;
    pc.ontrack = (e) => {
      this.audio.srcObject = e.streams[0] || new MediaStream([e.track]);
      this.audio.play().catch(() => {}); // allowed: the page had a click (Start or Send)
    };
    channel.onmessage = (e) => {
      if (pc !== this.pc || typeof e.data !== "string") return;
      const ev = JSON.parse(e.data);
      if (ev.type === "session.started") {
        this.sessionOpen = true;
        this.attempt = 0;
      }
      if (ev.type === "error" && ev.fatal) fatal = ev.code;
      this.h.onEvent(ev);
      if (ev.type === "session.started") {
        this.h.onState("open", {});
        started.resolve();
      }
    };
    const lost = (code) => {
      if (pc !== this.pc) return;
      this.lost({ code, reason: "", fatal, refused: null });
      started.reject(new Error(`connection closed (${code})`));
    };
    channel.onclose = () => lost(fatal === null ? CLOSE_LOST : CLOSE_NORMAL);
    pc.onconnectionstatechange = () => {
      this.stats.state = pc.connectionState;
      if (pc.connectionState === "connected" && this.stats.connectedMs === null) {
        this.stats.connectedMs = Math.round(performance.now() - t0);
      }
      if (pc.connectionState === "failed") lost(CLOSE_LOST);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    this.stats.offers++;
    let r;
    try {
      r = await fetch("/webrtc/offer", {
        method: "POST",
        cache: "no-store",
        headers: { "Content-Type": "application/json", ...(TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {}) },
        body: JSON.stringify({ type: "offer", sdp: pc.localDescription.sdp, session: this.h.hello() }),
      });
    } catch {
      r = null; // no server there
    }
    if (!r || !r.ok) {
      const refused = r ? await refusal(r) : { kind: "gone" };
      if (refused.kind === "failed") {
        this.h.onEvent({ type: "error", code: "webrtc", fatal: false,
                         message: `WebRTC offer refused (HTTP ${refused.status}): ${refused.message}` });
      }
      this.lost({ code: CLOSE_LOST, reason: "", fatal: refused.kind === "unavailable" ? "not_ready" : null,
                  refused: ["token", "forbidden", "sessions"].includes(refused.kind) ? refused : null,
                  noRetry: refused.kind === "failed", retryFloorMs: refused.retryMs || 0 });
      throw new Error(`offer refused (${r ? r.status : "no answer"})`);
    }
    await pc.setRemoteDescription(await r.json());
    this.stats.answerMs = Math.round(performance.now() - t0);
    this.watchStats(pc);
    await sessionStarted;
  }

  // The session is over (or never began): close the peer and reconnect unless refused for good.
  lost(why) {
    const pc = this.pc;
    this.pc = this.channel = this.sender = null;
    this.sessionOpen = false;
    clearInterval(this.statsTimer);
    this.stats.playing = false;
    this.stats.audioLevel = 0;
    if (pc) pc.close();
    const info = { code: why.code, reason: why.reason, fatal: why.fatal, refused: why.refused, retryInMs: null,
                   attempt: 0 };
    const retry = this.wanted && !why.noRetry && this.shouldRetry(info);
    if (retry) {
      this.attempt++;
      const floor = Math.max(why.retryFloorMs || 0, info.refused && info.refused.retryMs ? info.refused.retryMs : 0);
      info.retryInMs = backoffMs(this.attempt, floor);
      info.attempt = this.attempt;
    } else {
      this.wanted = false;
    }
    this.h.onState("closed", info);
    if (retry) this.schedule(info.retryInMs);
  }

  // As protocol.js's Connection: not after a refusal for good, an idle close or session.end.
  shouldRetry(info) {
    if (info.refused && (info.refused.kind === "token" || info.refused.kind === "forbidden")) return false;
    if (info.fatal === "idle_timeout") return false;
    return info.code !== CLOSE_NORMAL || info.fatal === "internal";
  }

  schedule(delayMs) {
    clearTimeout(this.timer);
    this.retryAt = performance.now() + delayMs;
    this.h.onState("retrying", { attempt: this.attempt, delayMs });
    this.timer = setTimeout(() => {
      this.timer = null;
      if (this.wanted) this.connect();
    }, delayMs);
  }

  retryNow() {
    if (this.timer) this.connect();
  }

  retryInMs() {
    return this.timer ? Math.max(0, this.retryAt - performance.now()) : null;
  }

  // Every STATS_MS: the reply track's level and energy, losses, jitter buffer, bytes.
  watchStats(pc) {
    clearInterval(this.statsTimer);
    this.statsTimer = setInterval(async () => {
      if (pc !== this.pc) return;
      const report = await pc.getStats();
      const s = this.stats;
      report.forEach((st) => {
        if (st.type === "inbound-rtp" && st.kind === "audio") {
          s.audioLevel = st.audioLevel || 0;
          s.totalAudioEnergy = st.totalAudioEnergy || 0;
          s.totalSamplesDuration = st.totalSamplesDuration || 0;
          s.totalSamplesReceived = st.totalSamplesReceived || 0;
          s.concealedSamples = st.concealedSamples || 0;
          s.packetsLost = st.packetsLost || 0;
          if (st.jitterBufferEmittedCount) {
            s.jitterBufferMs = Math.round((1000 * st.jitterBufferDelay) / st.jitterBufferEmittedCount);
          }
        } else if (st.type === "transport") {
          s.bytesSent = st.bytesSent || 0;
          s.bytesReceived = st.bytesReceived || 0;
        }
      });
      s.playing = s.audioLevel > PLAYING_LEVEL;
      s.elementPlaying = !this.audio.paused && this.audio.srcObject !== null;
    }, STATS_MS);
  }
}
