// voxpipe browser demo, Opus on the socket (docs/PROTOCOL.md "binary audio" and "Reply
// audio") with the browser's own codec: WebCodecs' AudioEncoder and AudioDecoder. No codec
// is written in JavaScript here: this module only feeds them and collects their output.
// WebCodecs works on the browser's codec threads; the page only queues work and gets
// callbacks, so encoding and decoding never block it. No DOM here.
//
// Microphone: one AudioEncoder per session.start (the server reads one stream per
// declaration); each EncodedAudioChunk it outputs is one raw 20 ms Opus packet, sent as one
// binary message. Replies: one AudioDecoder per response_id (each reply is an Opus stream of
// its own), fed the packet after the 4-byte response_id of each binary frame.

export const OPUS_RATES = [8000, 12000, 16000, 24000, 48000]; // the rates Opus (and the protocol) take
export const FRAME_US = 20000; // the microphone's packets: 20 ms, as the server's replies
export const MIC_BITRATE = 24000; // bit/s: clean speech for the ASR, ~3 KB/s on the wire

const probes = new Map(); // "encode:48000" -> {done, ok, promise}

// Resolves true where this browser can `kind` ("encode" | "decode") mono Opus at `rate`
// (WebCodecs' isConfigSupported; false without WebCodecs). Asked once per kind and rate.
export function canOpus(kind, rate) {
  const id = `${kind}:${rate}`;
  if (!probes.has(id)) {
    const probe = { done: false, ok: false };
    const Codec = kind === "encode" ? window.AudioEncoder : window.AudioDecoder;
    const config = { codec: "opus", sampleRate: rate, numberOfChannels: 1,
                     ...(kind === "encode" ? { bitrate: MIC_BITRATE } : {}) };
    probe.promise = (OPUS_RATES.includes(rate) && Codec && window.AudioData && window.EncodedAudioChunk
      ? Codec.isConfigSupported(config).then((r) => !!r.supported, () => false)
      : Promise.resolve(false)
    ).then((ok) => Object.assign(probe, { done: true, ok }).ok);
    probes.set(id, probe);
  }
  return probes.get(id).promise;
}

// The answer of a finished canOpus probe, at once: false while not asked or not finished.
export function knownOpus(kind, rate) {
  const probe = probes.get(`${kind}:${rate}`);
  return !!probe && probe.done && probe.ok;
}

// Samples an Opus packet holds at 48 kHz, from its TOC byte (RFC 6716 §3.1: the
// configuration gives the frame size, the code the number of frames); 0 for no packet.
// Only the header is read, as the server does (audio/opus.py packet_seconds).
export function packetSamples48k(p) {
  if (!p.length) return 0;
  const config = p[0] >> 3;
  const frame = config < 12 ? [480, 960, 1920, 2880][config % 4] // SILK: 10, 20, 40, 60 ms
    : config < 16 ? [480, 960][config % 2] // Hybrid: 10, 20 ms
      : [120, 240, 480, 960][config % 4]; // CELT: 2.5, 5, 10, 20 ms
  const code = p[0] & 3;
  const frames = code === 0 ? 1 : code < 3 ? 2 : p.length > 1 ? p[1] & 0x3f : 0;
  return frame * frames;
}

// The microphone as Opus: push() mono float32 samples at `rate` (any batch size);
// `onPacket(Uint8Array)` gets each packet, in order; `onError(err)` if the codec fails
// (it is closed then).
export class OpusMicEncoder {
  constructor(rate, onPacket, onError) {
    this.rate = rate;
    this.samples = 0; // pushed so far: the next batch's timestamp
    this.enc = new AudioEncoder({
      output: (chunk) => {
        const packet = new Uint8Array(chunk.byteLength);
        chunk.copyTo(packet);
        onPacket(packet);
      },
      error: onError,
    });
    // voip: speech; no DTX, so silences still arrive as packets (the server's VAD counts
    // silence in the audio it receives to end a turn)
    this.enc.configure({ codec: "opus", sampleRate: rate, numberOfChannels: 1, bitrate: MIC_BITRATE,
                         opus: { frameDuration: FRAME_US, application: "voip", usedtx: false } });
  }

  push(samples) {
    if (this.enc.state !== "configured" || !samples.length) return;
    const data = new AudioData({ format: "f32", sampleRate: this.rate, numberOfChannels: 1,
                                 numberOfFrames: samples.length,
                                 timestamp: Math.round((this.samples * 1e6) / this.rate), data: samples });
    this.samples += samples.length;
    this.enc.encode(data); // takes its own copy
    data.close();
  }

  // Encode what the encoder still holds (the last partial frame, padded) and resolve once
  // its packets went to onPacket; the encoder takes more audio after it.
  flush() {
    return this.enc.state === "configured" ? this.enc.flush().catch(() => {}) : Promise.resolve();
  }

  close() {
    if (this.enc.state !== "closed") this.enc.close(); // pending packets are dropped
  }
}

// Reply audio as Opus: one AudioDecoder per reply key (a fresh one for each stream).
// decode(key, packet, rate, tag) in arrival order (`rate`: the stream's, `tag`: anything,
// handed back); `onPcm(tag, Float32Array, sampleRate, first)` gets the decoded audio (at the
// decoder's rate: browsers may decode at 48 kHz whatever the stream's rate), `first` for a
// stream's first piece; `onError(key, err)` when a stream fails (its decoder is dropped; a
// later packet of that reply starts a fresh one, like a loss). A dropped (closed) decoder
// outputs nothing more.
export class OpusReplyDecoders {
  constructor(onPcm, onError) {
    this.onPcm = onPcm;
    this.onError = onError;
    this.streams = new Map(); // key -> {dec, us: next packet's timestamp, first, tag}
  }

  decode(key, packet, rate, tag) {
    let s = this.streams.get(key);
    if (!s || s.dec.state === "closed") s = this.open(key, rate, tag);
    s.dec.decode(new EncodedAudioChunk({ type: "key", timestamp: s.us, data: packet }));
    s.us += Math.round((packetSamples48k(packet) * 1e6) / 48000) || FRAME_US;
  }

  open(key, rate, tag) {
    const s = { us: 0, first: true, tag };
    s.dec = new AudioDecoder({
      output: (data) => {
        const pcm = new Float32Array(data.numberOfFrames);
        try {
          data.copyTo(pcm, { planeIndex: 0, format: "f32-planar" }); // the first channel (mono)
        } catch {
          data.copyTo(pcm, { planeIndex: 0 }); // no conversion offered: f32 mono as it is
        }
        const rateOut = data.sampleRate;
        data.close();
        const first = s.first;
        s.first = false;
        this.onPcm(s.tag, pcm, rateOut, first);
      },
      error: (err) => {
        if (this.streams.get(key) === s) this.streams.delete(key);
        this.onError(key, err);
      },
    });
    s.dec.configure({ codec: "opus", sampleRate: rate, numberOfChannels: 1 });
    this.streams.set(key, s);
    return s;
  }

  // Reply `key` sent its last packet: decode what is queued, then free its decoder.
  end(key) {
    const s = this.streams.get(key);
    if (!s) return;
    this.streams.delete(key);
    s.dec.flush().then(() => s.dec.state !== "closed" && s.dec.close(), () => {});
  }

  // Reply `key` is cancelled: its decoder goes now, with what it still holds.
  drop(key) {
    const s = this.streams.get(key);
    if (!s) return;
    this.streams.delete(key);
    if (s.dec.state !== "closed") s.dec.close();
  }

  dropAll() {
    for (const key of [...this.streams.keys()]) this.drop(key);
  }
}

// ---- what the page declares ------------------------------------------------------------

// Ask the browser (once per rate) whether it can encode and decode Opus at the input `rate`
// and decode it at `outRate`, so that audioFields() knows at once.
export function probe(rate, outRate) {
  return Promise.all([canOpus("encode", rate), canOpus("decode", rate), canOpus("decode", outRate)]);
}

// session.start's audio format fields: Opus both ways where `want` and this browser can
// (as probe() found), the replies in Opus only at an Opus rate (a 22.05 kHz reply stays
// PCM16); else f32 in and no output_format (PCM16 out, the server's default).
export function audioFields(want, rate, outRate) {
  const useOpus = want && knownOpus("encode", rate) && knownOpus("decode", rate);
  const outOpus = useOpus && knownOpus("decode", outRate);
  return { format: useOpus ? "opus" : "f32", ...(outOpus ? { output_format: "opus" } : {}) };
}

// Is `ev` an older server refusing the `declared` session.start's Opus? It answers
// `error` bad_event about session.start, and no session.started (`declaring`: none yet).
export function refusesOpus(ev, declared, declaring) {
  return ev.code === "bad_event" && declaring && !!declared
    && (declared.format === "opus" || declared.output_format === "opus") && /session\.start/.test(ev.message);
}
