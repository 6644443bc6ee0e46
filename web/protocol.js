// voxpipe browser demo, the socket: one WebSocket session at a time (docs/PROTOCOL.md),
// why a connection was refused, and automatic reconnection with exponential backoff.
// No DOM here: the page hears about everything through the handlers given to Connection.

export const CLOSE_NORMAL = 1000;
export const CLOSE_TRY_AGAIN_LATER = 1013; // close code of the session cap
export const SESSIONS_RETRY_MS = 5000; // a refused connection without a Retry-After: the server's own hint
export const BACKOFF = { baseMs: 500, capMs: 10000, jitter: 0.25 };

// The delay before reconnection attempt `attempt` (1, 2, ...): 0.5 s doubling up to 10 s,
// less up to 25 % at random ("equal jitter", so pages that lost one server do not all come
// back in step; AWS Architecture Blog, "Exponential Backoff and Jitter", 2015), and never
// below `floorMs` (a server's own Retry-After).
export function backoffMs(attempt, floorMs = 0, rand = Math.random) {
  const d = Math.min(BACKOFF.capMs, BACKOFF.baseMs * 2 ** Math.max(0, attempt - 1));
  return Math.round(Math.max(floorMs, d * (1 - BACKOFF.jitter * rand())));
}

// A server started with --token needs it on /ws; browsers cannot set headers on a
// WebSocket, so the page passes it as ?token=, taken from its own URL (/?token=...).
const TOKEN = new URLSearchParams(location.search).get("token");
const TOKEN_QUERY = TOKEN ? `?token=${encodeURIComponent(TOKEN)}` : "";
const WS_URL = `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/ws${TOKEN_QUERY}`;

// Why a WebSocket was refused before it opened (browsers say only 1006): ask /ws over plain
// HTTP. Returns {kind: "token"|"forbidden", status, message}, {kind: "sessions", retryMs,
// message}, or {kind: "gone"} (no answer: no server there, or it accepts WebSockets again).
export async function whyRefused() {
  try {
    const r = await fetch(`/ws${TOKEN_QUERY}`, { cache: "no-store" });
    const message = (await r.text()).trim();
    if (r.status === 401) return { kind: "token", status: 401, message };
    if (r.status === 403) return { kind: "forbidden", status: 403, message };
    if (r.status === 503) {
      const secs = parseFloat(r.headers.get("Retry-After"));
      return { kind: "sessions", retryMs: Number.isFinite(secs) ? secs * 1000 : SESSIONS_RETRY_MS, message };
    }
    return { kind: "gone" };
  } catch {
    return { kind: "gone" };
  }
}

// One session over /ws, reconnected after it is lost. Handlers (all optional):
//   hello()           -> the session.start event to send once the socket opens
//   onEvent(ev)       every JSON event from the server
//   onAudio(buf)      every binary frame (ArrayBuffer)
//   onSent(obj)       every JSON event sent
//   onState(state, info)  "connecting" | "open" (session.started) | "closed" (info: {code,
//                     reason, refused, retryInMs, attempt}) | "retrying" (info: {attempt, delayMs})
export class Connection {
  constructor(handlers) {
    this.h = handlers;
    this.ws = null;
    this.pending = null; // promise of the session in progress of opening
    this.wanted = false; // the page wants a session: reconnect when it is lost
    this.attempt = 0; // failed connections in a row
    this.timer = null; // the scheduled reconnection
    this.retryAt = 0; // performance.now() of the scheduled reconnection
    this.sessionOpen = false;
  }

  get open() {
    return !!this.ws && this.ws.readyState === WebSocket.OPEN && this.sessionOpen;
  }

  send(obj) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify(obj));
    if (this.h.onSent) this.h.onSent(obj);
    return true;
  }

  sendBinary(buf) {
    if (!this.open) return false;
    this.ws.send(buf);
    return true;
  }

  // A session: resolves on session.started, rejects when this attempt fails (a retry may
  // follow on its own while `wanted`).
  connect() {
    this.wanted = true;
    if (this.open) return Promise.resolve();
    if (this.pending) return this.pending;
    clearTimeout(this.timer);
    this.timer = null;
    this.h.onState("connecting", {});
    this.pending = new Promise((resolve, reject) => {
      let opened = false; // false at close: the upgrade itself failed (or was refused)
      let fatal = null; // the code of a fatal error event, if one came
      const ws = (this.ws = new WebSocket(WS_URL));
      ws.binaryType = "arraybuffer";
      ws.onopen = () => {
        opened = true;
        this.send(this.h.hello());
      };
      ws.onmessage = (e) => {
        if (ws !== this.ws) return;
        if (typeof e.data !== "string") {
          this.h.onAudio(e.data);
          return;
        }
        const ev = JSON.parse(e.data);
        if (ev.type === "session.started") {
          this.sessionOpen = true;
          this.attempt = 0;
        }
        if (ev.type === "error" && ev.fatal) fatal = ev.code;
        this.h.onEvent(ev);
        if (ev.type === "session.started") {
          this.h.onState("open", {});
          resolve();
        }
      };
      ws.onclose = async (e) => {
        if (ws !== this.ws) return;
        this.ws = null;
        this.sessionOpen = false;
        const info = { code: e.code, reason: e.reason, fatal, refused: null, retryInMs: null, attempt: 0 };
        if (e.code === CLOSE_TRY_AGAIN_LATER) info.refused = { kind: "sessions", retryMs: SESSIONS_RETRY_MS,
                                                                message: e.reason || "server full" };
        else if (!opened) info.refused = await whyRefused();
        reject(new Error(`connection closed (${e.code})`));
        const retry = this.wanted && this.shouldRetry(info);
        if (retry) {
          this.attempt++;
          const floor = info.refused && info.refused.kind === "sessions" ? info.refused.retryMs : 0;
          info.retryInMs = backoffMs(this.attempt, floor);
          info.attempt = this.attempt;
        } else {
          this.wanted = false;
        }
        this.h.onState("closed", info);
        if (retry) this.schedule(info.retryInMs);
      };
    }).finally(() => {
      this.pending = null;
    });
    this.pending.catch(() => {}); // a failed attempt is reported through onState
    return this.pending;
  }

  // Reconnect after a lost session, unless the server refused this page for good (token,
  // Host/Origin) or closed it on purpose (idle, session.end).
  shouldRetry(info) {
    if (info.refused && (info.refused.kind === "token" || info.refused.kind === "forbidden")) return false;
    if (info.fatal === "idle_timeout") return false;
    return !(info.code === CLOSE_NORMAL && info.fatal === null && info.reason === "idle");
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

  // Reconnect now instead of waiting for the backoff.
  retryNow() {
    if (this.timer) this.connect();
  }

  // Ms until the scheduled reconnection (null: none scheduled).
  retryInMs() {
    return this.timer ? Math.max(0, this.retryAt - performance.now()) : null;
  }
}
