// voxpipe browser demo, audio: the AudioContext, the microphone (AudioWorklet, or a
// ScriptProcessor where there is none), gapless playback of streamed reply audio (PCM16 or
// decoded Opus),
// and the input/output levels the page's meters show. No DOM here.

const PLAYBACK_LEAD_S = 0.06; // head start for the first chunk of a reply (s)
const DUCK_GAIN = 0.25; // reply volume while the user may be talking over it
const ANALYSER_SIZE = 1024; // samples per level reading (~21 ms at 48 kHz)

// RMS level of an AnalyserNode's latest window, in [0, 1].
function rmsLevel(analyser, buf) {
  analyser.getFloatTimeDomainData(buf);
  let s = 0;
  for (let i = 0; i < buf.length; i++) s += buf[i] * buf[i];
  return Math.sqrt(s / buf.length);
}

// A level meter on `node`: level() is the RMS of its latest window, in [0, 1].
function meter(ctx, node) {
  const analyser = ctx.createAnalyser();
  analyser.fftSize = ANALYSER_SIZE;
  node.connect(analyser);
  const buf = new Float32Array(analyser.fftSize);
  return { analyser, level: () => rmsLevel(analyser, buf) };
}

// The page's AudioContext (48 kHz where the device rate is outside the protocol's 8–48 kHz,
// or not one of `rates` when given: Opus takes only its own rates), or null where the
// browser has none (typed turns still work, without sound).
// Must be made inside a user gesture so that it may play sound.
export function makeContext(rates = null) {
  const AC = window.AudioContext || window.webkitAudioContext;
  if (!AC) return null;
  let ctx = new AC({ latencyHint: "interactive" });
  if (ctx.sampleRate < 8000 || ctx.sampleRate > 48000 || (rates && !rates.includes(ctx.sampleRate))) {
    ctx.close();
    ctx = new AC({ latencyHint: "interactive", sampleRate: 48000 });
  }
  return ctx;
}

// Why getUserMedia failed, as one of: "denied", "no_mic", "mic_busy", "insecure", "mic_failed".
export function micErrorKind(err) {
  const name = (err && err.name) || "";
  if (name === "NotAllowedError" || name === "SecurityError" || name === "PermissionDeniedError") return "denied";
  if (name === "NotFoundError" || name === "DevicesNotFoundError" || name === "OverconstrainedError") return "no_mic";
  if (name === "NotReadableError" || name === "TrackStartError" || name === "AbortError") return "mic_busy";
  if (name === "NoMic") return "insecure";
  return "mic_failed";
}

// The microphone: mono float32 batches of `batchMs` to `onSamples(Float32Array)`, and its
// level for the meter. Uses capture-worklet.js, or a ScriptProcessorNode where the browser
// has no AudioWorklet (an insecure origin, an old browser).
export class Mic {
  static async open(ctx, batchMs, onSamples) {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      const err = new Error("this page cannot use a microphone here (it needs https or localhost)");
      err.name = "NoMic";
      throw err;
    }
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    return new Mic(ctx, stream, batchMs, onSamples, await Mic.workletReady(ctx));
  }

  // Resolves true once capture-worklet.js is loaded, false where there is no AudioWorklet.
  static workletReady(ctx) {
    if (!ctx.voxpipeWorklet) {
      ctx.voxpipeWorklet = ctx.audioWorklet && window.AudioWorkletNode
        ? ctx.audioWorklet.addModule("capture-worklet.js").then(() => true, () => false)
        : Promise.resolve(false);
    }
    return ctx.voxpipeWorklet;
  }

  constructor(ctx, stream, batchMs, onSamples, worklet) {
    this.stream = stream;
    this.source = ctx.createMediaStreamSource(stream);
    this.onFlushed = null;
    this.kind = worklet ? "worklet" : "script-processor";
    if (worklet) {
      this.node = new AudioWorkletNode(ctx, "capture-processor", {
        numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1], processorOptions: { batchMs },
      });
      this.node.port.onmessage = (e) => {
        if (e.data instanceof Float32Array) onSamples(e.data);
        else if (e.data && e.data.flushed && this.onFlushed) this.onFlushed();
      };
    } else {
      this.node = ctx.createScriptProcessor(2048, 1, 1);
      this.node.onaudioprocess = (e) => onSamples(new Float32Array(e.inputBuffer.getChannelData(0)));
    }
    this.source.connect(this.node);
    this.node.connect(ctx.destination); // silent output; keeps the node pulled by the graph
    this.meter = meter(ctx, this.source);
  }

  level() {
    return this.meter.level();
  }

  // Sends the partial batch still in the worklet; resolves when it has been sent (or 300 ms).
  flush() {
    if (this.kind !== "worklet") return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, 300);
      this.onFlushed = () => {
        clearTimeout(timer);
        resolve();
      };
      this.node.port.postMessage({ cmd: "flush" });
    });
  }

  close() {
    this.stream.getTracks().forEach((t) => t.stop());
    this.source.disconnect();
    if (this.node.port) this.node.port.onmessage = null;
    else this.node.onaudioprocess = null;
    this.node.disconnect();
    this.meter.analyser.disconnect();
  }
}

// Gapless playback of reply audio, keyed by a reply key (the page uses "session:response"),
// with instant stop for a cancelled reply, ducking, and counts of what was really played.
export class ReplyPlayer {
  constructor(ctx) {
    this.ctx = ctx;
    this.gain = ctx.createGain();
    this.gain.connect(ctx.destination);
    this.out = meter(ctx, this.gain);
    this.playhead = 0; // context time where the next chunk starts
    this.stopped = new Set(); // keys whose audio is dropped
    this.playing = new Map(); // key -> Set of scheduled AudioBufferSourceNodes
    this.played = new Map(); // key -> samples whose playback ran to its end
    this.stats = { scheduledSamples: 0, playedSamples: 0, underruns: 0, flushes: 0 };
  }

  // Schedule `pcm` (Int16Array, or Float32Array in [-1, 1], at `rate` Hz) of reply `key`
  // right after what is queued; `count`: the samples it stands for in the counts (played,
  // scheduled), by default its length (decoded Opus may come at another rate than the
  // reply's). Returns false if the reply was stopped (the samples are dropped), else
  // {underrun} (true: the previous chunk had already finished: the reply's audio ran dry).
  play(key, pcm, rate, firstChunk, count = pcm.length) {
    if (this.stopped.has(key)) return false;
    const ctx = this.ctx;
    const audio = ctx.createBuffer(1, pcm.length, rate);
    const out = audio.getChannelData(0);
    if (pcm instanceof Float32Array) out.set(pcm);
    else for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 32768;
    const src = ctx.createBufferSource();
    src.buffer = audio;
    src.connect(this.gain);
    const now = ctx.currentTime;
    const underrun = !firstChunk && this.playhead < now;
    if (underrun) this.stats.underruns++;
    const at = Math.max(this.playhead, now + PLAYBACK_LEAD_S);
    src.start(at);
    this.playhead = at + audio.duration;
    this.stats.scheduledSamples += count;
    if (!this.playing.has(key)) this.playing.set(key, new Set());
    const set = this.playing.get(key);
    set.add(src);
    src.onended = () => {
      if (!src.voxpipeStopped) {
        this.played.set(key, (this.played.get(key) || 0) + count);
        this.stats.playedSamples += count;
      }
      set.delete(src);
      if (set.size === 0 && this.playing.get(key) === set) this.playing.delete(key);
    };
    return { underrun };
  }

  // True while some reply audio is queued or sounding.
  isPlaying() {
    return this.playing.size > 0 && this.playhead > this.ctx.currentTime;
  }

  // Is reply `key` still queued or sounding?
  isPlayingKey(key) {
    return this.playing.has(key);
  }

  level() {
    return this.isPlaying() ? this.out.level() : 0;
  }

  // Lower the reply's volume (the user may be talking over it), or back to full.
  duck(on) {
    this.gain.gain.setTargetAtTime(on ? DUCK_GAIN : 1, this.ctx.currentTime, 0.03);
  }

  // Silence reply `key` now and drop any of its audio that still arrives.
  stop(key) {
    this.stopped.add(key);
    const set = this.playing.get(key);
    if (set) {
      for (const src of set) {
        src.voxpipeStopped = true;
        try {
          src.stop();
        } catch (_) {
          /* not started yet or already stopped */
        }
      }
      this.playing.delete(key);
      this.stats.flushes++;
    }
    if (this.playing.size === 0) {
      this.playhead = this.ctx.currentTime;
      this.duck(false);
    }
  }

  // Silence every reply.
  stopAll() {
    for (const key of [...this.playing.keys()]) this.stop(key);
  }
}
