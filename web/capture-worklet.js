// AudioWorklet processor: mixes the microphone input to mono and hands it to the
// main thread in batches of `batchMs` milliseconds (the render quantum is only 128
// samples, far too small to send one WebSocket message each).
//
// Messages to the main thread: a Float32Array of `batch` samples (its buffer is
// transferred). A {cmd: "flush"} message from the main thread sends what is left
// of the current batch, then {flushed: true}.

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const batchMs = (options.processorOptions && options.processorOptions.batchMs) || 20;
    this.batch = Math.max(128, Math.round((sampleRate * batchMs) / 1000));
    this.buf = new Float32Array(this.batch);
    this.fill = 0;
    this.port.onmessage = (e) => {
      if (e.data && e.data.cmd === "flush") {
        this.send(this.fill);
        this.port.postMessage({ flushed: true });
      }
    };
  }

  send(n) {
    if (n > 0) {
      const out = this.buf.slice(0, n);
      this.port.postMessage(out, [out.buffer]);
    }
    this.fill = 0;
  }

  process(inputs) {
    const input = inputs[0];
    if (!input || input.length === 0) return true; // no input connected (yet)
    const chans = input.length;
    const frames = input[0].length;
    for (let i = 0; i < frames; i++) {
      let s = 0;
      for (let c = 0; c < chans; c++) s += input[c][i];
      s /= chans;
      this.buf[this.fill++] = s > 1 ? 1 : s < -1 ? -1 : s;
      if (this.fill === this.batch) this.send(this.batch);
    }
    return true; // outputs stay silent
  }
}

registerProcessor("capture-processor", CaptureProcessor);
