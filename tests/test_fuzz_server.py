"""Property-based fuzzing of a real voxpipe server on loopback (real models, SmolLM2).

Hypothesis draws random client sequences (tests/fuzz_strategies.py: random and hostile
JSON, every client event with valid and invalid fields, binary frames of 0–70,000 bytes of
noise, silence or real speech, invalid UTF-8 text frames, fragmented messages, oversize
frames, pauses) and plays each one over a fresh WebSocket connection. For every example:

- the server process is alive;
- every text frame the server sends is a valid server event (the classes of
  pipeline/session/events.py), every binary frame is reply audio of a started response;
- every ``error`` has a documented ``code`` (``ErrorCode``, plus ``rate_limited``), never
  ``internal`` and never ``fatal``;
- the protocol errors are exactly the ones the frames call for (a local oracle parses
  every text frame with ``server.protocol.parse_client_event``: ``bad_json``,
  ``unknown_type`` and ``no_session`` counted exactly, ``bad_event`` within bounds);
- a connection the server closes was closed for a documented reason with the matching
  code: 1000 after ``session.end``, 1007 after invalid UTF-8, 1009 after an oversize
  message — never 1011, and never without a close frame (1006);
- otherwise the SAME connection still answers a fresh ``session.start`` with
  ``session.started``, and every reply it started ends (``response.done`` or
  ``response.cancelled``) once cancelled.

Meanwhile a well-behaved session in a background thread speaks a real clip in real time,
turn after turn: each turn must end in ``response.done`` with the right transcript (a
``busy`` refusal is retried). At the end ``/healthz`` still answers 200 and the server log
has no traceback.

Default (CI): a derandomized, database-less run of 100 examples (``VOXPIPE_FUZZ_EXAMPLES``)
of up to 16 actions, about 1.5 minutes after the server is up. A longer run:
``VOXPIPE_FUZZ_EVENTS=10000`` keeps drawing examples (up to 40 actions each, a random seed;
``VOXPIPE_FUZZ_SEED=N`` fixes it) until that many WebSocket messages were sent.
``VOXPIPE_FUZZ_FLOOD=1`` adds bursts far past the client's budget (1,500 text frames, 5
minutes of audio at once: each costs the server a minute or more). A summary line is
printed (``-s``) and appended to ``$VOXPIPE_FUZZ_SUMMARY`` when set;
``VOXPIPE_FUZZ_TRACE=FILE`` writes one JSON line per example (its actions, the events it got).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import typing
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from pydantic import TypeAdapter, ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from audio.frames import parse_audio_frame
from audio.pcm import resample
from audio.wav import read_mono
from pipeline.session import events as ev
from server.protocol import ProtocolError, parse_client_event
from tests import fuzz_strategies as fz
from tests.wsclient import CONTROL_DEADLINE_S, MODEL_DEADLINE_S, Client, normalize, wer

EVENTS_TARGET = int(os.environ.get("VOXPIPE_FUZZ_EVENTS", "0") or 0)
LONG = EVENTS_TARGET > 0
MAX_ACTIONS = 40 if LONG else 16
MAX_EXAMPLES = int(os.environ.get("VOXPIPE_FUZZ_EXAMPLES", "0") or 0) or (EVENTS_TARGET // 2 + 100 if LONG else 50)
"""Examples per run: 50 in CI (a fixed, derandomized set; CI time), more with
``VOXPIPE_FUZZ_EXAMPLES`` or a long run (``VOXPIPE_FUZZ_EVENTS``)."""
FUZZ_SEED = os.environ.get("VOXPIPE_FUZZ_SEED")
FLOOD = os.environ.get("VOXPIPE_FUZZ_FLOOD", "") not in ("", "0")  # bursts far past the client's budget
TRACE = os.environ.get("VOXPIPE_FUZZ_TRACE")  # a file: one JSON line per example (actions, events received)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(6 * 3600 if LONG else 1800)]

ALLOWED_CODES = (set(typing.get_args(ev.ErrorCode)) | {"rate_limited"}) - {"internal"}
"""Error codes a fuzzed session may get: the documented set (rate_limited may not be in
it yet), never ``internal``."""

CLOSE_AFTER = {"session.end": 1000, "utf8": 1007, "oversize": 1009}
"""The close code a connection must get after the first frame of each terminal kind."""

SERVER_EVENT = TypeAdapter(ev.ServerEvent)
EXAMPLE_DEADLINE_S = 600.0  # one example, end to end: bounds a hang, asserts no speed
SPEECH_CLIP = "en_jfk_inaugural_1961.wav"  # sliced into the fuzzer's speech frames
STEADY_CLIP = "en_cmu_goforward.wav"  # the well-behaved session's turn


def clip16k(audio_dir, name) -> np.ndarray:
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, 16000)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


# ---- what one example expects (a local oracle of the protocol) ------------------------------


DEEP = 200
"""JSON nested deeper than this may or may not fit the server's stack (``json.loads`` gives
up at ~980 levels there, at another depth here): such a frame is ``bad_json`` or what it
would be with a stack to spare."""


def json_depth(text: str) -> int:
    """Deepest nesting of arrays and objects in ``text`` (outside strings; 0 when it has
    too few brackets to matter)."""
    if text.count("[") + text.count("{") <= DEEP:
        return 0
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def parse_with_stack(text: str, depth: int):
    """:func:`parse_client_event` with the recursion limit raised for ``depth`` levels:
    the answer of a server with a deep enough stack."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 3 * depth + 2000))
    try:
        return parse_client_event(text)
    finally:
        sys.setrecursionlimit(old)


PROTOCOL_CODES = ("bad_json", "unknown_type", "bad_event", "no_session")
"""The errors the oracle predicts, frame by frame."""


@dataclass
class Expect:
    """What the server must answer to the frames sent so far (up to the first terminal one)."""

    ctx: fz.AudioContext
    declared: bool = False
    starts: int = 0  # valid session.start frames
    exact: Counter = field(default_factory=Counter)  # one error of this code per frame
    either: list[frozenset[str]] = field(default_factory=list)  # one error of one of these codes per frame
    maybe: Counter = field(default_factory=Counter)  # zero or one error of this code per frame
    uncertain: bool = False  # a frame whose effect cannot be told: counts are not checked
    audio_epochs: int = 0  # declared formats that received audio: at most one bad_audio each
    epoch_has_audio: bool = False
    texts: int = 0  # valid text.input frames (each may start a reply)
    terminal: str | None = None  # the first frame that ends the connection: CLOSE_AFTER's key

    def bounds(self, code: str) -> tuple[int, int]:
        lo = self.exact[code]
        return lo, lo + sum(code in e for e in self.either) + self.maybe[code]

    def text(self, text: str) -> None:
        if self.terminal:
            return
        if len(text.encode("utf-8", "surrogatepass")) > fz.MAX_MESSAGE_BYTES:
            self.terminal = "oversize"
            return
        depth = json_depth(text)
        deep = DEEP < depth <= 3000  # the server's stack may give up first (bad_json), or not
        try:
            event = parse_with_stack(text, depth) if deep else parse_client_event(text)
        except ProtocolError as exc:
            if deep:
                self.either.append(frozenset({"bad_json", exc.code}))
            else:
                self.exact[exc.code] += 1
            return
        if deep:  # a valid event, or bad_json: what follows cannot be told
            self.uncertain = True
            return
        if isinstance(event, ev.SessionStart):
            self.starts += 1
            self.declared = True
            self.epoch_has_audio = False
            self.ctx.fmt = (event.sample_rate, event.format, event.channels)
            if event.language not in (None, "en"):  # English-only ASR, or a code it does not know
                self.maybe["bad_event"] += 1
        elif isinstance(event, ev.InputEnd):
            if not self.declared:
                self.exact["no_session"] += 1
        elif isinstance(event, ev.TextInput):
            self.texts += 1
        elif isinstance(event, ev.SessionEnd):
            self.terminal = "session.end"

    def raw(self, data: bytes) -> None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            if not self.terminal:
                self.terminal = "utf8"
            return
        self.text(text)

    def audio(self, n: int) -> None:
        if self.terminal:
            return
        if n > fz.MAX_MESSAGE_BYTES:
            self.terminal = "oversize"
        elif not self.declared:
            self.exact["no_session"] += 1
        elif not self.epoch_has_audio:
            self.epoch_has_audio = True
            self.audio_epochs += 1


# ---- one connection -------------------------------------------------------------------------


@dataclass
class Received:
    events: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # frames that are not what the protocol says
    audio_frames: int = 0
    new: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("type") == kind]

    async def until(self, cond, deadline_s: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while not cond():
            self.new.clear()
            if cond():
                return
            if self.closed.is_set():
                raise AssertionError(f"the connection closed while waiting for {what}")
            left = end - loop.time()
            if left <= 0:
                kinds = [e.get("type") for e in self.events]
                raise AssertionError(f"hang: no {what} in {deadline_s:.0f} s; got {kinds}")
            try:
                await asyncio.wait_for(self.new.wait(), min(left, 1.0))
            except TimeoutError:
                pass


async def read_all(ws: ClientConnection, rx: Received) -> None:
    started: set[int] = set()
    try:
        async for msg in ws:
            if isinstance(msg, bytes):
                rx.audio_frames += 1
                try:
                    rid, pcm = parse_audio_frame(msg)
                except ValueError:
                    rx.problems.append(f"binary frame of {len(msg)} bytes: shorter than its header")
                else:
                    if rid not in started:
                        rx.problems.append(f"audio for response {rid}, which never started")
                    if len(pcm) % 2:
                        rx.problems.append(f"audio for response {rid}: {len(pcm)} bytes is not PCM16")
            else:
                try:
                    event = SERVER_EVENT.validate_json(msg)
                except ValidationError as exc:
                    rx.problems.append(f"not a server event: {msg[:300]!r}: {str(exc)[:300]}")
                    try:
                        rx.events.append(json.loads(msg))
                    except ValueError:
                        pass
                else:
                    if isinstance(event, ev.ResponseStarted):
                        started.add(event.response_id)
                    rx.events.append(json.loads(msg))
            rx.new.set()
    except ConnectionClosed:
        pass
    finally:
        rx.closed.set()
        rx.new.set()


async def send(ws: ClientConnection, act: fz.Action, ctx: fz.AudioContext, exp: Expect) -> int:
    """Send one action (updating the oracle first); returns the frames it sent."""
    if isinstance(act, fz.Pause):
        await asyncio.sleep(act.ms / 1000)
        return 0
    if isinstance(act, fz.RawText):
        exp.raw(act.data)
        await ws.send(act.data, text=True)
        return 1
    if isinstance(act, fz.Fragmented):
        data = act.text.encode("utf-8", "surrogatepass")
        exp.raw(data)
        parts = act.fragments()
        await ws.send(parts, text=True)
        return len(parts)
    if isinstance(act, fz.Burst):
        frames = act.frames()
        for frame in frames:
            if isinstance(frame, str):
                exp.text(frame)
            else:
                exp.audio(len(frame))
            await ws.send(frame)
        return len(frames)
    if isinstance(act, fz.Utterance):
        chunks = act.frames(ctx)
        for chunk in chunks:
            exp.audio(len(chunk))
            await ws.send(chunk)
        await asyncio.sleep(act.then_ms / 1000)
        return len(chunks)
    if isinstance(act, fz.Audio | fz.FragmentedAudio):
        audio = act if isinstance(act, fz.Audio) else act.audio
        data = audio.payload(ctx)
        exp.audio(len(data))
        if isinstance(act, fz.FragmentedAudio):
            parts = fz.split_at(data, act.cuts)
            await ws.send(parts)
            return len(parts)
        await ws.send(data)
        return 1
    text = act.payload(ctx)
    exp.text(text)
    await ws.send(text)
    return 1


@dataclass
class Stats:
    examples: int = 0
    frames: int = 0
    actions: int = 0
    closes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    server_events: Counter = field(default_factory=Counter)
    audio_frames: int = 0
    survived: int = 0  # connections that answered the final session.start
    trace: dict | None = None  # the latest example: its actions and the events it got


async def play(url: str, actions: list[fz.Action], ctx: fz.AudioContext, stats: Stats) -> None:
    """One example: play ``actions`` over a fresh connection and check everything."""
    exp = Expect(ctx)
    ctx.fmt = (16000, "pcm16", 1)
    rx = Received()
    ws = await connect(url, max_size=None, ping_interval=None, open_timeout=CONTROL_DEADLINE_S, close_timeout=10)
    reader = asyncio.create_task(read_all(ws, rx))
    try:
        for act in actions:
            if rx.closed.is_set() or ws.state is not State.OPEN:
                break
            try:
                n = await send(ws, act, ctx, exp)
            except ConnectionClosed:
                break
            except AttributeError:
                # websockets aborts the transport of a connection the server already closed,
                # after asyncio let go of its loop (Python 3.11): the connection is closed
                if not ws.connection_lost_waiter.done():
                    raise
                break
            stats.frames += n
            stats.actions += 1
            if exp.terminal:
                # the server ends the connection here; a later bad frame could race it (the
                # protocol layer may fail the connection with 1007/1009 before the handler
                # has closed it with 1000)
                break
        if exp.terminal is None and not rx.closed.is_set():
            try:
                await final_checks(ws, rx, exp)
            except AssertionError as exc:
                if rx.closed.is_set():
                    rcvd = ws.protocol.close_rcvd
                    raise AssertionError(f"the server closed the connection ({rcvd.code if rcvd else 1006} "
                                         f"{rcvd.reason if rcvd else ''!r}) though no frame called for it; "
                                         f"last events {rx.events[-5:]}") from exc
                raise
            stats.survived += 1
        else:
            try:
                await asyncio.wait_for(rx.closed.wait(), CONTROL_DEADLINE_S)
            except TimeoutError:
                raise AssertionError(f"hang: the connection was not closed {CONTROL_DEADLINE_S:.0f} s after "
                                     f"a {exp.terminal!r} frame") from None
            rcvd = ws.protocol.close_rcvd
            code = rcvd.code if rcvd is not None else 1006
            stats.closes[code] += 1
            assert rcvd is not None, "the server dropped the connection without a close frame (1006)"
            assert exp.terminal is not None, (
                f"the server closed the connection ({code} {rcvd.reason!r}) though no frame called for it")
            assert code == CLOSE_AFTER[exp.terminal], (
                f"close code {code} {rcvd.reason!r} after a {exp.terminal!r} frame; "
                f"expected {CLOSE_AFTER[exp.terminal]}")
    finally:
        if not ws.connection_lost_waiter.done():
            await ws.close()
        await asyncio.wait_for(reader, 30)
        for e in rx.events:
            stats.server_events[e.get("type")] += 1
        stats.audio_frames += rx.audio_frames
        for e in rx.of("error"):
            stats.errors[e.get("code")] += 1
        stats.trace = {"actions": [repr(a) for a in actions],
                       "received": [e.get("type") if e.get("type") != "error" else "error:" + e["code"]
                                    for e in rx.events]}
    assert not rx.problems, rx.problems[:5]
    errors = rx.of("error")
    assert all(e["code"] in ALLOWED_CODES for e in errors), [e for e in errors if e["code"] not in ALLOWED_CODES]
    assert not [e for e in errors if e["fatal"]], [e for e in errors if e["fatal"]]


async def final_checks(ws: ClientConnection, rx: Received, exp: Expect) -> None:
    """The connection is open and was not ended: it must still work."""
    await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
    await rx.until(lambda: len(rx.of("session.started")) >= exp.starts + 1, MODEL_DEADLINE_S,
                   "session.started for the final session.start")
    if not exp.uncertain:
        assert len(rx.of("session.started")) == exp.starts + 1, (exp.starts, rx.of("session.started"))
    # every reply that started ends once cancelled (a turn in flight may start one late)
    loop = asyncio.get_running_loop()
    end = loop.time() + MODEL_DEADLINE_S
    while True:
        ended = {e["response_id"] for e in rx.events if e.get("type") in ("response.done", "response.cancelled")}
        open_ = [e["response_id"] for e in rx.of("response.started") if e["response_id"] not in ended]
        if not open_:
            break
        assert loop.time() < end, f"hang: responses {open_} never ended; got {[e.get('type') for e in rx.events]}"
        await ws.send(json.dumps({"type": "response.cancel"}))
        try:
            await asyncio.wait_for(rx.new.wait(), 2.0)
        except TimeoutError:
            pass
        rx.new.clear()
    if exp.uncertain:
        return
    got = Counter(e["code"] for e in rx.of("error"))
    wrong = {c: (got[c], *exp.bounds(c)) for c in PROTOCOL_CODES if not exp.bounds(c)[0] <= got[c] <= exp.bounds(c)[1]}
    assert not wrong, f"error counts (got, expected at least, at most): {wrong}"
    total = sum(got[c] for c in PROTOCOL_CODES)
    low = sum(exp.exact.values()) + len(exp.either)
    assert low <= total <= low + sum(exp.maybe.values()), f"{total} protocol errors, expected {low}+"
    assert got["bad_audio"] <= exp.audio_epochs, f"bad_audio: {got['bad_audio']} > {exp.audio_epochs} formats"


# ---- the well-behaved session -----------------------------------------------------------------


class QuietClient(Client):
    """tests/wsclient.py's client without keepalive pings: websockets draws their payload
    from the global ``random``, which Hypothesis flags when another thread does it while it
    generates an example."""

    async def __aenter__(self) -> QuietClient:
        self.ws = await connect(self.url, max_size=None, ping_interval=None)
        self._reader = asyncio.create_task(self._read())
        return self


class Steady(threading.Thread):
    """Speaks ``pcm`` in real time, then ``input.end``, turn after turn, on one connection
    (its own event loop, in this thread) until :meth:`stop`; the first turn always runs to
    its end. Records each turn's outcome; a ``busy`` is retried after ``retry_after_ms``."""

    def __init__(self, url: str, pcm: bytes) -> None:
        super().__init__(name="steady-session", daemon=True)
        self.url, self.pcm = url, pcm
        self._stop_flag = threading.Event()
        self.turns: list[dict] = []  # {"final": text, "done": response.done}
        self.busy: Counter = Counter()  # refusals by reason
        self.failure: BaseException | None = None
        self.events: list[dict] = []

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc

    async def _main(self) -> None:
        async with QuietClient(self.url) as c:
            self.events = c.conv.events
            await c.start(sample_rate=16000, format="pcm16", channels=1)
            while True:
                n = len(c.conv.events)
                for i in range(0, len(self.pcm), 3200):  # 100 ms per frame, in real time
                    await c.ws.send(self.pcm[i : i + 3200])
                    await asyncio.sleep(0.1)
                await c.ws.send(bytes(16000))  # 0.5 s of silence, then the turn ends
                await c.send_json({"type": "input.end"})
                out = await c.wait_for(lambda e, n=n: e["type"] in ("response.done", "turn.empty", "busy", "error")
                                       and c.conv.events.index(e) >= n, MODEL_DEADLINE_S)
                if out["type"] == "busy":
                    self.busy[out["reason"]] += 1
                    await asyncio.sleep(out["retry_after_ms"] / 1000)
                    continue
                assert out["type"] == "response.done", f"steady turn ended with {out}"
                finals = [e for e in c.conv.events[n:] if e["type"] == "transcript.final"]
                self.turns.append({"final": finals[-1]["text"] if finals else None, "done": out})
                if self._stop_flag.is_set():
                    break
                await asyncio.sleep(0.5)
            await c.send_json({"type": "session.end"})
            await asyncio.wait_for(c.ws.wait_closed(), CONTROL_DEADLINE_S)
            assert c.ws.close_code == 1000, c.ws.close_code


# ---- the test ---------------------------------------------------------------------------------

START = fz.Text(json.dumps({"type": "session.start", "sample_rate": 16000}))
START_48K_F32_STEREO = fz.Text(json.dumps({"type": "session.start", "sample_rate": 48000, "format": "f32",
                                           "channels": 2}))
END = fz.Text(json.dumps({"type": "session.end"}))

EXAMPLES = [
    # invalid UTF-8 in a text frame: close 1007
    [START, fz.Audio("speech", 32000, 0), fz.RawText(b"\xff\xfe{bad")],
    # a message over the limit: close 1009
    [START, fz.Oversize(1)],
    # hostile JSON, then session.end: close 1000
    [fz.Big("deep_list_open", 100_000), fz.Big("huge_int_sample_rate", 5000), fz.Big("deep_type", 5000),
     fz.Text('{"type": "session.start", "sample_rate": NaN}'), fz.Text("Infinity"), fz.Text("[1, 2]"),
     fz.Audio("random", 70_000, 1), fz.Big("huge_text_input", 100_000), fz.Text('{"type": "input.end", "x": -1e999}'),
     END],
    # formats re-declared mid-stream, speech as declared, fragments, wrong-format audio
    [START_48K_F32_STEREO, fz.Audio("speech", 70_000, 0), fz.Audio("speech", 70_000, 8000),
     fz.Fragmented('{"type": "text.input", "text": "h\u00e9\u20ac"}', (1, 30, 31)),
     fz.FragmentedAudio(fz.Audio("speech", 64_000, 40_000), (1, 3, 5000)), START, fz.Audio("f32_noise", 64_000, 3),
     fz.Audio("speech", 64_000, 60_000), fz.Text('{"type": "input.end"}'), fz.Pause(300),
     fz.Text('{"type": "response.cancel"}')],
]


def _health(http: str) -> int:
    with urllib.request.urlopen(http + "/healthz", timeout=30) as r:
        return r.status


def test_fuzz_server(server, audio_dir, manifest):
    url, proc, log = server["url"], server["proc"], server["log"]
    log_start = log.stat().st_size
    ctx = fz.AudioContext(clip16k(audio_dir, SPEECH_CLIP))
    stats = Stats()
    t0 = time.monotonic()
    steady = Steady(url, pcm16(clip16k(audio_dir, STEADY_CLIP)))
    steady.start()

    def fuzz(actions: list[fz.Action]) -> None:
        if LONG and stats.frames >= EVENTS_TARGET:
            return  # the long run sent enough: the remaining examples are no-ops
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        stats.examples += 1
        try:
            asyncio.run(asyncio.wait_for(play(url, actions, ctx, stats), EXAMPLE_DEADLINE_S))
        except TimeoutError:
            raise AssertionError(f"hang: the example did not finish in {EXAMPLE_DEADLINE_S:.0f} s") from None
        finally:
            if TRACE and stats.trace is not None:
                with open(TRACE, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(stats.trace) + "\n")
                stats.trace = None
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"the server exited with {proc.returncode}:\n{tail}")

    run = given(fz.sequences(MAX_ACTIONS, flood=FLOOD))(fuzz)
    for ex in reversed(EXAMPLES):
        run = example(ex)(run)
    run = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=not LONG and not FUZZ_SEED,
                   print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much, HealthCheck.large_base_example])(run)
    if FUZZ_SEED:
        run = seed(int(FUZZ_SEED))(run)
    try:
        run()
    finally:
        steady.stop()
        steady.join(MODEL_DEADLINE_S + 60)
        took = time.monotonic() - t0
        line = (f"fuzz summary: {stats.examples} examples, {stats.actions} actions, {stats.frames} frames sent "
                f"in {took:.0f} s; {stats.survived} connections answered a fresh session.start; "
                f"closes {dict(stats.closes)}; errors {dict(stats.errors)}; "
                f"server events {dict(stats.server_events)}, {stats.audio_frames} audio frames; "
                f"steady session: {len(steady.turns)} turns, busy {dict(steady.busy)}")
        print("\n" + line)
        if os.environ.get("VOXPIPE_FUZZ_SUMMARY"):
            with open(os.environ["VOXPIPE_FUZZ_SUMMARY"], "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    assert proc.poll() is None, f"the server exited with {proc.returncode}"
    assert _health(server["http"]) == 200
    # the well-behaved session: real turns, the right transcript, concurrently with the fuzzing
    assert not steady.is_alive(), "the well-behaved session did not finish its turn"
    assert steady.failure is None, f"the well-behaved session failed: {steady.failure!r}"
    assert steady.turns, "the well-behaved session completed no turn"
    ref = manifest[STEADY_CLIP]["reference_transcript"]
    for turn in steady.turns:
        assert turn["final"] is not None and wer(ref, turn["final"]) <= 0.25, turn
        assert "forward" in normalize(turn["final"]) and turn["done"]["text"].strip(), turn
    assert not [e for e in steady.events if e["type"] == "error"], steady.events
    # nothing went wrong inside the server that the wire did not show
    text = log.read_bytes()[log_start:].decode(errors="replace")
    bad = [ln for ln in text.splitlines() if "Traceback" in ln or "crashed" in ln or "never retrieved" in ln]
    assert not bad, "\n".join(bad[:20]) + "\n" + text[-4000:]
