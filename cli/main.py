"""The ``voxpipe`` command line: ``serve``, ``ask`` and ``mic``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from pipeline.turn_config import EAGERNESS, END_OF_TURN


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it as a usage error)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The ``voxpipe`` command line: ``serve`` (its configuration flags generated from the config
    dataclasses, :mod:`cli.flags`), ``ask``, ``bench`` and ``mic``."""
    from cli.flags import add_config_flags
    from pipeline.config import AdmissionConfig, LlmConfig, SchedulerConfig, ServerConfig

    p = argparse.ArgumentParser(prog="voxpipe", description="Real-time voice assistant server.")
    sub = p.add_subparsers(dest="command", required=True)
    server = ServerConfig()
    url = f"ws://{server.host}:{server.port}/ws"

    s = sub.add_parser("serve", help="run the WebSocket server", usage="%(prog)s [options]",
                       description="Run the WebSocket server. Every setting has a flag; the groups below follow the "
                                   "configuration's sections (pipeline/config.py).")
    s.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="logging level: DEBUG, INFO, WARNING, ... (default: INFO)")
    add_config_flags(s)
    r = s.add_argument_group("ray", "Run the model stages as Ray Serve deployments.")
    r.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run ASR, LLM and TTS as Ray Serve deployments (docs/RAY.md): "
                        "auto joins this machine's Ray cluster or starts a local one; ADDRESS: a cluster's HOST:PORT")
    r.add_argument("--ray-config", default=None, metavar="PATH",
                   help="with --ray: per-stage deployment options from a Serve config (e.g. deploy/ray-serve.yaml)")
    r.add_argument("--ray-replicas", action="append", default=[], metavar="STAGE=N",
                   help="with --ray: replicas of a stage deployment, e.g. llm=2 (repeatable)")
    r.add_argument("--ray-existing", action="store_true",
                   help="with --ray: use the stage deployments already running (serve deploy) instead of deploying")
    r.add_argument("--ray-cpus", type=int, default=None, metavar="N",
                   help="with --ray auto: CPUs of the local Ray cluster it starts when there is none (default: all)")

    a = sub.add_parser("ask", help="send an audio file, print and save the spoken reply")
    a.add_argument("audio", help="audio file (WAV, FLAC, ...)")
    a.add_argument("--url", default=url)
    out = a.add_mutually_exclusive_group()
    out.add_argument("--out", default="reply.wav", metavar="PATH",
                     help="where to write the reply audio (WAV; default: reply.wav in the current folder, "
                          "written only when a reply with audio came)")
    out.add_argument("--no-out", dest="out", action="store_const", const=None,
                     help="do not write the reply audio anywhere")
    a.add_argument("--fast", action="store_true", help="send as fast as possible, not in real time")
    a.add_argument("--json", action="store_true", help="print exactly one JSON object")
    a.add_argument("--language", default=None)
    a.add_argument("--codec", choices=["pcm", "opus"], default="pcm",
                   help="audio on the wire: pcm (PCM16), or opus both ways (about 1/10 of the bytes)")
    a.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the reply")
    a.add_argument("--token", default=os.environ.get("VOXPIPE_TOKEN") or None,
                   help="the server's bearer token (default: $VOXPIPE_TOKEN)")

    b = sub.add_parser("bench", help="run a benchmark and print its table")
    bsub = b.add_subparsers(dest="bench", required=True)
    bl = bsub.add_parser("llm", help="LLM batching modes: the design article's table")
    bl.add_argument("--llm", default="smollm2")
    bl.add_argument("--device", default="cpu", choices=["cpu", "cpu-int4", "cuda"],
                    help="cpu: bf16 rows and a continuous-batching int4 row; cpu-int4: every row int4 "
                         "(the CPU serving default) and a continuous-batching bf16 row")
    bl.add_argument("--requests", type=int, default=72,
                    help="requests per mode and load (72)")
    bl.add_argument("--concurrency", type=int, default=8)
    bl.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals per second")
    bl.add_argument("--max-batch-size", type=int, default=SchedulerConfig().max_batch_size)
    bl.add_argument("--threads", type=int, default=LlmConfig().threads)
    bl.add_argument("--rounds", type=int, default=0,
                    help="then run no batching and continuous batching (closed loop) this many more times "
                         "in turns and print each round's ratio and their median (0)")
    bl.add_argument("--json", action="store_true")

    from bench.asr import add_arguments as asr_bench_arguments

    asr_bench_arguments(bsub.add_parser("asr", help="streaming ASR: 1-8 sessions on one engine, batching"))
    from bench.load import add_arguments as load_bench_arguments

    load_bench_arguments(bsub.add_parser("load", help="turn floods at 0.5-3x the sustainable rate: SLO, goodput, busy"))
    from bench.edge import add_arguments as edge_bench_arguments

    edge_bench_arguments(bsub.add_parser("edge", help="does one abusive client (20x real time, 4 MiB frames) slow "
                                                      "another session's voice-to-voice?"))
    from bench.llm_quant import add_arguments as quant_bench_arguments
    from bench.ray_overhead import add_arguments as ray_bench_arguments
    from bench.silent import add_arguments as silent_bench_arguments

    quant_bench_arguments(bsub.add_parser("quant", help="quantized LLM (int8/int4) vs bf16: greedy agreement, "
                                                        "perplexity, decode tok/s, llama.cpp"))
    silent_bench_arguments(bsub.add_parser("silent", help="what connected sessions streaming silence cost the server"))
    ray_bench_arguments(bsub.add_parser("ray", help="per-call latency a Ray Serve deployment handle adds (loopback)"))
    from bench.roof import add_arguments as roof_bench_arguments

    roof_bench_arguments(bsub.add_parser("roof", help="int4 decode against the CPU's vpdpbusd peak: what batching "
                                                      "can gain at most"))
    from bench.eot import add_arguments as eot_bench_arguments

    eot_bench_arguments(bsub.add_parser("eot", help="the end-of-turn model (Smart Turn v3.2): ms per call at "
                                                    "batch 1, 4, 8 and per turn's features"))
    from bench.replies import add_arguments as replies_bench_arguments

    replies_bench_arguments(bsub.add_parser("replies", help="do replies answer or parrot? parrot rate per model "
                                                            "and chat framing on bench/prompts.tsv"))
    from bench.quality import add_arguments as quality_bench_arguments

    quality_bench_arguments(bsub.add_parser("quality", help="are replies right, short and on point? fact accuracy, "
                                                            "rules, parrots and an LLM judge on bench/quality_set.tsv"))
    from bench.tools import add_arguments as tools_bench_arguments

    tools_bench_arguments(bsub.add_parser("tools", help="tool calling: right tool and arguments, false calls on "
                                                        "chit-chat, the first token's cost of the tools, per model"))
    from bench.turns import add_arguments as turns_bench_arguments

    turns_bench_arguments(bsub.add_parser("turns", help="turn-taking: thinking pauses, backchannels, interruptions "
                                                        "and noise over replies, per end-of-turn configuration"))
    from bench.memory import add_arguments as memory_bench_arguments

    memory_bench_arguments(bsub.add_parser("memory", help="does the server grow conversation after conversation? "
                                                          "RSS and each memory part after every one"))
    from bench.echo import add_arguments as echo_bench_arguments

    echo_bench_arguments(bsub.add_parser("echo", help="voxpipe mic without headphones through a PulseAudio room: "
                                                      "self-cut replies, self-answered turns, barge-in, v2v"))
    from bench.words import add_arguments as words_bench_arguments

    words_bench_arguments(bsub.add_parser("words", help="one-word turns (yeah, stop) heard per final-decode "
                                                        "encoder window"))
    bv = bsub.add_parser("voice", help="per-response voice latencies through a real server")
    bv.add_argument("--llm", default="smollm2")
    bv.add_argument("--sessions", type=int, nargs="+", default=None,
                    help="concurrent sessions; one row per value (default 1 4); multi-turn mode: one value (4)")
    bv.add_argument("--repeat", type=int, default=1)
    bv.add_argument("--jfk-only", action="store_true")
    bv.add_argument("--lockstep", action="store_true",
                    help="every session plays the clips in the same order (turns end together)")
    bv.add_argument("--server-log", default=None, help="write the server's INFO log to this file")
    bv.add_argument("--slo-ms", type=float, default=AdmissionConfig().slo_ms,
                    help="count answered turns within this voice-to-voice (ms)")
    bv.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options, e.g. '--tts-threads 2'")
    bv.add_argument("--variant", action="append", default=[], metavar="NAME=SERVE_ARGS",
                    help="one server run per variant with these extra 'voxpipe serve' options (after --serve-args; "
                         "repeatable), one table with a row per variant, e.g. --variant piper= "
                         "--variant coqui='--tts coqui:DIR'")
    bv.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    bv_turns = bv.add_mutually_exclusive_group()
    bv_turns.add_argument("--turns", type=int, default=None, metavar="N",
                          help="multi-turn: each session keeps one connection and takes N turns in a row (its "
                               "history grows); prints TTFT and voice-to-voice per turn index and a soak summary")
    bv_turns.add_argument("--duration", type=float, default=None, metavar="S",
                          help="multi-turn soak: take turns until S seconds have passed (e.g. 300)")
    bv.add_argument("--compare-cache", action="store_true",
                    help="multi-turn: run twice, with the server's default and with --no-prefix-cache appended "
                         "to --serve-args; rows 'cache' / 'no cache'")
    bv.add_argument("--transport", nargs="+", choices=["pcm", "opus", "webrtc"], default=["pcm"],
                    help="the audio's way: pcm (PCM16) or opus on the WebSocket, webrtc (POST /webrtc/offer, the "
                         "webrtc extra); several take turns clip round by clip round, one row each, with bytes per "
                         "second and the Opus codec's CPU")
    bv.add_argument("--turn-end", choices=["client", "server"], default=None,
                    help="how a WebSocket turn ends: client (input.end after the clip, as voxpipe ask) or server "
                         "(silence after it, as a live microphone; the server's end-of-turn detection decides, as "
                         "always over WebRTC); default server when --transport has webrtc, else client")
    bv.add_argument("--idle-cpu-s", type=float, default=0.0, metavar="S",
                    help="after the turns, one idle session per --transport for S seconds: the server's and the "
                         "client's CPU per second (what the transport costs with the models idle; 0: skip)")
    bv.add_argument("--lang", nargs="+", default=None, metavar="CODE",
                    help="per spoken language (e.g. en de): the clips of --audio-dir in each through one server "
                         "with the multilingual ASR; a row each: WER of the final, detected language, reply in "
                         "the language (%%), voice-to-voice p50")
    bv.add_argument("--max-clips", type=_positive_int, default=None, metavar="N",
                    help="--lang: each language's first N clips")
    bv.add_argument("--json", action="store_true")

    m = sub.add_parser("mic", help="talk to a server with the local microphone and speaker")
    m.add_argument("--url", default=url)
    m.add_argument("--input-device", default=None, metavar="INDEX|NAME",
                   help="microphone: an index (all digits) or part of a name (see --list-devices)")
    m.add_argument("--output-device", default=None, metavar="INDEX|NAME",
                   help="speaker: an index (all digits) or part of a name (see --list-devices)")
    m.add_argument("--list-devices", action="store_true", help="list the audio devices and exit")
    m.add_argument("--echo", default="auto", choices=["auto", "aec", "half-duplex", "off"],
                   help="keep the assistant from hearing itself: aec (WebRTC echo cancellation, needs the mic "
                        "extra), half-duplex (mute the microphone while it speaks unless you are louder), auto "
                        "(aec if installed, else half-duplex; default), off (headphones)")
    m.add_argument("--codec", default="auto", choices=["auto", "opus", "pcm"],
                   help="audio on the wire: auto (Opus both ways when the server has it, else PCM16; default), "
                        "opus, or pcm")
    m.add_argument("--barge-in-db", type=float, default=6.0, metavar="DB",
                   help="half-duplex: how much louder than the speaker (dB) your voice must be to cut in (6)")
    m.add_argument("--token", default=os.environ.get("VOXPIPE_TOKEN") or None,
                   help="the server's bearer token (default: $VOXPIPE_TOKEN)")
    m.add_argument("--end-of-turn", default=None, choices=list(END_OF_TURN),
                   help="how the server ends your turns: after a silence, or when its end-of-turn model hears you "
                        "are done (the server needs --end-of-turn smart-turn; default: the server's)")
    m.add_argument("--eagerness", default=None, choices=list(EAGERNESS),
                   help="smart-turn: how soon a turn ends (low waits longest; default: the server's)")
    return p


BENCHES = {"asr": "bench.asr", "load": "bench.load", "quant": "bench.llm_quant", "silent": "bench.silent",
           "edge": "bench.edge", "ray": "bench.ray_overhead", "voice": "bench.voice", "replies": "bench.replies",
           "llm": "bench.llm", "roof": "bench.roof", "eot": "bench.eot", "turns": "bench.turns",
           "words": "bench.words", "tools": "bench.tools", "quality": "bench.quality", "memory": "bench.memory",
           "echo": "bench.echo"}
"""``voxpipe bench NAME`` → the module whose ``main(args)`` runs it."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``voxpipe`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from cli.serve import serve_command

        return serve_command(args)
    if args.command == "ask":
        from cli.ask import ask_command

        return ask_command(args)
    if args.command == "bench":
        from cli.serve import runtime_env

        runtime_env()
        logging.basicConfig(level="WARNING")
        return importlib.import_module(BENCHES[args.bench]).main(args)
    if args.command == "mic":
        from clients.mic import list_devices_command, run_mic

        if args.list_devices:
            return list_devices_command()
        return run_mic(args.url, input_device=args.input_device, output_device=args.output_device, token=args.token,
                       echo=args.echo, barge_in_db=args.barge_in_db, end_of_turn=args.end_of_turn,
                       eagerness=args.eagerness, codec=args.codec)
    return 2


if __name__ == "__main__":
    sys.exit(main())
