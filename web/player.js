// voxpipe browser demo: gapless playback of streamed PCM16 reply audio, per response id,
// with instant stop for a cancelled reply. Used by app.js.
"use strict";

window.ReplyPlayer = class ReplyPlayer {
  // ctx: the page's AudioContext; leadS: head start for the first chunk of a reply (s).
  constructor(ctx, leadS) {
    this.ctx = ctx;
    this.leadS = leadS;
    this.playhead = 0; // context time where the next chunk starts
    this.cancelled = new Set(); // response ids whose audio is dropped
    this.playing = new Map(); // response id -> Set of scheduled AudioBufferSourceNodes
  }

  // Schedule samples (Int16Array at `rate` Hz) of reply `rid` right after what is queued.
  // Returns false if the reply was stopped (the samples are dropped), and
  // {underrun: bool} otherwise (true: the previous chunk had already finished).
  play(rid, pcm, rate, firstChunk) {
    if (this.cancelled.has(rid)) return false;
    const ctx = this.ctx;
    const audio = ctx.createBuffer(1, pcm.length, rate);
    const out = audio.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 32768;
    const src = ctx.createBufferSource();
    src.buffer = audio;
    src.connect(ctx.destination);
    const now = ctx.currentTime;
    const underrun = !firstChunk && this.playhead < now; // the reply's audio ran dry
    const at = Math.max(this.playhead, now + this.leadS);
    src.start(at);
    this.playhead = at + audio.duration;
    if (!this.playing.has(rid)) this.playing.set(rid, new Set());
    const set = this.playing.get(rid);
    set.add(src);
    src.onended = () => {
      set.delete(src);
      if (set.size === 0 && this.playing.get(rid) === set) this.playing.delete(rid);
    };
    return { underrun };
  }

  // Silence reply `rid` now and drop any of its audio that still arrives.
  stop(rid) {
    this.cancelled.add(rid);
    const set = this.playing.get(rid);
    if (set) {
      for (const src of set) {
        try {
          src.stop();
        } catch (_) {
          /* not started yet or already stopped */
        }
      }
      this.playing.delete(rid);
    }
    if (this.playing.size === 0) this.playhead = this.ctx.currentTime;
  }

  // Silence every reply.
  stopAll() {
    for (const rid of [...this.playing.keys()]) this.stop(rid);
  }
};
