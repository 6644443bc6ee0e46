"""``voxpipe mic``: talk to a voxpipe server with the local microphone and speaker.

The microphone's 20 ms frames go through the echo control (:mod:`clients.echo`) to the
server; the reply's audio goes to the speaker, and its text is shown as it is played
(:class:`ReplyView`: the position in the reply's audio, in characters). What the user sees is
:class:`~clients.mic_console.Console`'s; a reply's tool calls and their results get a line
each (:mod:`clients.mic_tools`).

Exit statuses of :func:`run_mic`: 0 (Ctrl+C: ``session.end``, close 1000), 1 (another
error), 2 (an audio device or PortAudio problem, or ``--echo aec`` unavailable), 3 (no voxpipe
server at the URL: connection refused, or an HTTP answer other than the upgrade, e.g. 404 for a
wrong path), 5 (refused: the server's session cap), 6 (refused: HTTP 401/403), 7 (the server
closed the session or the connection was lost mid-session).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from audio.frames import parse_audio_frame
from audio.pcm import RATE
from clients.client import EXIT_DENIED, access_denied, auth_headers, refused_session
from clients.echo import BARGE_IN_DB, EchoControl, EchoUnavailable, make_echo_control
from clients.mic_console import LISTENING, SPEAKING, SPEAKING_USER, THINKING, Console, latency_line
from clients.mic_tools import tool_line
from clients.mic_wire import CODECS, OUT_RATE, Wire

__all__ = ["CODECS", "EXIT_BUSY", "EXIT_GONE", "Console", "ReplyView", "ServerGone", "Wire", "list_devices_command",
           "run_mic"]

EXIT_BUSY = 5
"""Exit status when the server refused the session (its session cap)."""
EXIT_GONE = 7
"""Exit status when the server closed the session or the connection was lost."""
CHARS_PER_S = 15.0
"""Speaking rate (characters of text per second of audio) used to place a reply's text on its
audio until the whole reply has arrived (then the exact ratio text : audio is known). Piper's
English voices speak about 14-16 characters a second."""
TICK_S = 0.1
"""How often the reply's shown text follows the playback position."""
PHRASE_END = re.compile(r"[.!?;:,](?=\s)|\n")
CANCEL_REASONS = {"barge_in": "you talked over it", "continued": "you went on", "new_turn": "a new turn began",
                  "client": "cancelled", "restart": "restarted", "error": "the reply failed"}
"""Why a reply was cut, in words (``response.cancelled``'s ``reason``; the client's own cut on
``speech.started`` uses ``continued`` or ``barge_in`` too)."""
CLOSE_WORDS = {1000: "the server closed the session", 1001: "the server is shutting down",
               1006: "the connection to the server was lost", 1008: "the server closed the session (policy)",
               1011: "the server closed the session after an internal error"}


class ServerGone(ConnectionError):
    """The server closed the session, or the connection was lost, while the user was in it."""


@dataclass(slots=True)
class ReplyView:
    """One reply being played: its text, its audio (samples received at the output rate),
    and how much of the text has been shown (characters)."""

    response_id: int
    turn_id: int | None
    text: str = ""
    received: int = 0
    done: bool = False
    audio: bool = True  # False: a text-only reply (nothing to follow)
    latency: str | None = None
    shown: int = 0
    phrases_out: int = 0  # off a terminal: characters already printed as phrases
    finished: bool = False
    dropped: bool = False  # the client stopped it: more of its audio is not played

    def reveal(self, played: int, rate: int) -> int:
        """Characters of :attr:`text` spoken by sample ``played`` of the reply (whole words,
        never fewer than already shown)."""
        if self.done and self.received:
            n = int(len(self.text) * min(1.0, played / self.received))
        else:
            n = int(min(len(self.text), played / rate * CHARS_PER_S))
        if n < len(self.text):
            n = max(0, self.text.rfind(" ", 0, n + 1))
        self.shown = max(self.shown, n)
        return self.shown


def _describe_close(exc: BaseException | None, ws) -> str:
    rcvd = getattr(exc, "rcvd", None) or getattr(ws, "close_rcvd", None)
    if rcvd is None:
        return CLOSE_WORDS[1006]
    words = CLOSE_WORDS.get(rcvd.code, f"the server closed the session (code {rcvd.code})")
    return f"{words}: {rcvd.reason}" if rcvd.reason else words


async def _session(url: str, input_device, output_device, console: Console, token: str | None = None, *,
                   echo: str = "auto", barge_in_db: float = BARGE_IN_DB, stop: asyncio.Event | None = None,
                   turn: dict[str, str] | None = None, codec: str = "auto") -> None:
    """One mic session until ``stop`` is set (then ``session.end`` and a normal close).
    ``turn``: ``session.start``'s ``end_of_turn`` / ``eagerness``, if chosen; ``codec``: one
    of :data:`CODECS`.

    Raises:
        ServerGone: the server closed the session or the connection was lost before ``stop``.
        DeviceError, EchoUnavailable, and the connection's own errors (see :func:`run_mic`).
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from audio.devices import Player, open_microphone

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    mic_q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=100)
    control: list[EchoControl] = []  # set once both devices are open (their latencies are known)

    def on_pcm(data: bytes) -> None:
        if not control:
            return
        frame = control[0].near(np.frombuffer(data, dtype="<i2")).astype("<i2").tobytes()

        def put() -> None:
            if mic_q.full():
                mic_q.get_nowait()  # drop the oldest 20 ms rather than grow
            mic_q.put_nowait(frame)

        loop.call_soon_threadsafe(put)

    def on_output(block: np.ndarray) -> None:
        if control:
            control[0].far(block)

    async with connect(url, max_size=None, additional_headers=auth_headers(token), open_timeout=15) as ws:
        wire = Wire(ws, codec, turn or {})
        await wire.start()
        player = Player(OUT_RATE, output_device, on_output=on_output)
        mic = None
        try:
            player.start()
            mic = open_microphone(RATE, on_pcm, input_device)
            latency = player.latency_s + float(getattr(mic, "latency", 0.0) or 0.0)
            control.append(make_echo_control(echo, out_rate=OUT_RATE, latency_s=latency, barge_in_db=barge_in_db))
            console.say(f"voxpipe mic: echo: {control[0].description}")
            console.say("listening — speak; Ctrl+C to quit")
            console.state(LISTENING)
            await _converse(ws, player, mic_q, console, stop, ConnectionClosed, wire,
                            asked_rule=(turn or {}).get("end_of_turn"), reply_ends=control[0].reply_ends)
        finally:
            console.close()
            for close in ([] if mic is None else [mic.stop, mic.close]) + [player.close]:
                try:
                    close()
                except Exception:  # noqa: BLE001 - a device that fails to close: nothing to do at exit
                    pass


async def _converse(ws, player, mic_q: asyncio.Queue[bytes], console: Console, stop: asyncio.Event,
                    closed_exc: type[BaseException], wire: Wire, *, asked_rule: str | None = None,
                    reply_ends: Callable[[float], None] | None = None) -> None:
    """The conversation: mic frames out, events and audio in, the view kept in step.
    ``asked_rule``: the ``end_of_turn`` asked for (the user hears if the server has another);
    ``reply_ends``: told, when a reply with audio has all arrived, how much of the speaker's
    audio is still to play (s: :meth:`clients.echo.EchoControl.reply_ends`)."""
    replies: dict[int, ReplyView] = {}
    # the latest final turn id, the reply being played, whether the user is speaking
    state: dict = {"turn": None, "reply": None, "user": False}

    async def send() -> None:
        await wire.started.wait()
        while True:
            for frame in await wire.encode(await mic_q.get()):
                await ws.send(frame)

    def current() -> ReplyView | None:
        return state["reply"]

    def finish(view: ReplyView, note: str | None = None) -> None:
        """A reply is over: its whole text (or, cut, the spoken part) and its latency line."""
        view.finished = True
        if note is not None:  # off a terminal, the phrases already printed are not said again
            spoken = view.text[0 if console.live else view.phrases_out:].strip()
            console.say(f"voxpipe: {spoken + ' ' if spoken else ''}(interrupted: {note})")
        elif console.live:
            console.say(f"voxpipe: {view.text.strip()}")
        else:
            console.phrase(view.text[view.phrases_out:])
        if view.latency:
            console.say(f"  {view.latency}")
        if state["reply"] is view:
            state["reply"] = None
            console.state(SPEAKING_USER if state["user"] else LISTENING)

    def follow() -> None:
        """Show the current reply up to the playback position."""
        view = current()
        if view is None or view.finished or not view.audio:
            return
        played = player.played(view.response_id)
        n = view.reveal(played, player.sample_rate)
        if state["user"]:
            pass  # the status line stays on the user's words
        elif played == 0:
            console.state(THINKING)
            return
        elif console.live:
            console.state(SPEAKING, view.text[:n])
        else:
            console.state(SPEAKING)
        if not console.live:
            ends = [m.end() for m in PHRASE_END.finditer(view.text, view.phrases_out, n + 1)]
            if ends:
                console.phrase(view.text[view.phrases_out:ends[-1]])
                view.phrases_out = ends[-1]
        if view.done and played >= view.received:
            finish(view)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(TICK_S)
            follow()

    def cut(view: ReplyView, note: str, sent: str | None = None) -> None:
        """Stop a reply: show the part the speaker played. ``sent``: the server's
        ``spoken_text``, the text of exactly the audio received, so the part played is its
        share of that audio."""
        played = player.played(view.response_id)
        view.dropped = True
        player.flush()
        if sent is not None:
            view.text, view.done, view.shown = sent, True, 0
        view.text = view.text[:view.reveal(played, player.sample_rate)]
        finish(view, note)

    async def receive() -> None:
        async for msg in ws:
            if isinstance(msg, bytes):
                rid, payload = parse_audio_frame(msg)
                view = replies.get(rid)
                if view is not None and not view.dropped:
                    pcm = wire.decode(rid, payload)
                    player.push(pcm, rid)
                    view.received += len(pcm) // 2
                continue
            ev = json.loads(msg)
            kind = ev["type"]
            view = current()
            if await wire.answered(ev):
                continue  # the server has no Opus: the session starts again in PCM16
            if kind == "session.started" and asked_rule and ev.get("end_of_turn") not in (None, asked_rule):
                console.say(f"voxpipe mic: the server ends turns by {ev['end_of_turn']} (it has no "
                            "end-of-turn model: start it with --end-of-turn smart-turn)")
            if kind == "speech.started":
                # the user spoke again while a reply plays: if it answers this same turn (a pause
                # mid-sentence) or has all arrived (nothing left for the server to cancel), stop it
                # ("you went on": the server takes the speech as going on over it)
                same = view is not None and view.turn_id == ev.get("turn_id")
                if view is not None and not view.finished and (same or view.done):
                    cut(view, CANCEL_REASONS["continued"])
                state["user"] = True
                console.state(SPEAKING_USER)
            elif kind == "transcript.partial":
                console.partial(ev["text"])
            elif kind == "speech.stopped":
                state["user"] = False
                if current() is None:
                    console.state(THINKING)
            elif kind == "transcript.final" and ev.get("unanswered"):  # a refused turn's words (its busy came)
                console.say(f"you (not answered): {ev['text']}")
            elif kind == "transcript.final":
                state["turn"] = ev.get("turn_id")
                console.say(f"you: {ev['text']}")
                if current() is None:
                    console.state(THINKING)
            elif kind == "turn.empty":
                if ev.get("reason") in ("no_speech", "no_words"):  # a backchannel or the echo: the reply goes on
                    console.say("voxpipe mic: (didn't catch that)")
                if current() is None:
                    console.state(LISTENING)
            elif kind == "response.started":
                rid = ev["response_id"]
                replies[rid] = state["reply"] = ReplyView(rid, state["turn"])
                console.state(THINKING)
            elif kind == "response.text.delta":
                if (r := replies.get(ev["response_id"])) is not None:
                    r.text += ev["delta"]
            elif kind == "response.done":
                r = replies.get(ev["response_id"])
                if r is None or r.finished:
                    continue
                r.text, r.done = ev.get("text", r.text), True
                r.latency = latency_line(ev.get("timings_ms"))
                if ev.get("text_only") or r.received == 0:
                    r.audio = False
                    r.finished = True
                    console.reply(ev)
                    if r.latency:
                        console.say(f"  {r.latency}")
                    if state["reply"] is r:
                        state["reply"] = None
                        console.state(LISTENING)
                elif reply_ends is not None and not r.dropped:
                    reply_ends(player.pending / player.sample_rate)
            elif kind == "response.cancelled":
                r = replies.get(ev["response_id"])
                if r is not None and not r.finished:
                    cut(r, CANCEL_REASONS.get(ev.get("reason"), str(ev.get("reason"))), ev.get("spoken_text", ""))
            elif kind in ("tool.call", "tool.output"):
                console.say(tool_line(ev))
            elif kind == "busy":
                console.busy(ev)
                if current() is None:
                    console.state(LISTENING)
            elif kind == "server.status":
                console.status(ev)
            elif kind == "error":
                console.say(f"voxpipe mic: server error {ev['code']}: {ev['message']}")

    tasks = [asyncio.create_task(send()), asyncio.create_task(ticker())]
    receiver = asyncio.create_task(receive())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({receiver, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            exc = receiver.exception() if receiver.done() else None
            if exc is not None and not isinstance(exc, closed_exc):
                raise exc
            raise ServerGone(_describe_close(exc, ws))
        tasks[0].cancel()  # nothing more from the microphone
        try:
            await ws.send(json.dumps({"type": "session.end"}))
            await asyncio.wait_for(asyncio.shield(receiver), 5)  # until the server's close (1000)
        except (closed_exc, TimeoutError):
            pass
    finally:
        for t in (*tasks, receiver, stopper):
            t.cancel()
        await asyncio.gather(*tasks, receiver, stopper, return_exceptions=True)


def run_mic(url: str, *, input_device=None, output_device=None, token: str | None = None,
            echo: str = "auto", barge_in_db: float = BARGE_IN_DB, console: Console | None = None,
            end_of_turn: str | None = None, eagerness: str | None = None, codec: str = "auto") -> int:
    """Run the microphone client until Ctrl+C; returns an exit status (see the module
    docstring). ``input_device``/``output_device``: an index or a name (an all-digit value is
    an index); ``token``: the server's bearer token; ``echo``: ``auto``, ``aec``,
    ``half-duplex`` or ``off`` (:mod:`clients.echo`); ``end_of_turn`` (``silence`` or
    ``smart-turn``) and ``eagerness`` (``auto``, ``low``, ``medium``, ``high``): how the server
    ends this session's turns (None: the server's choice); ``codec``: ``auto`` (Opus when the
    server has it, else PCM16), ``opus`` or ``pcm``."""
    from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI, WebSocketException

    from audio.devices import DeviceError, resolve_device

    console = console or Console()

    def fail(text: str, code: int) -> int:
        console.say(f"voxpipe mic: {text}")
        return code

    try:
        inp, out = resolve_device(input_device, "input"), resolve_device(output_device, "output")
    except DeviceError as exc:
        return fail(str(exc), 2)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_sigint() -> None:
            if stop.is_set() and task is not None:
                task.cancel()  # a second Ctrl+C: do not wait for the server
            stop.set()

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (RuntimeError, ValueError):  # not the main thread: Ctrl+C stays KeyboardInterrupt
            pass
        turn = {k: v for k, v in (("end_of_turn", end_of_turn), ("eagerness", eagerness)) if v is not None}
        await _session(url, inp, out, console, token, echo=echo, barge_in_db=barge_in_db, stop=stop, turn=turn,
                       codec=codec)

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    except ServerGone as exc:
        return fail(f"{exc}; the session is over", EXIT_GONE)
    except InvalidURI as exc:
        return fail(f"bad --url: {exc}", 2)
    except InvalidHandshake as exc:
        denied = access_denied(exc)
        if denied is not None:
            return fail(str(denied), EXIT_DENIED)
        busy = refused_session(exc)
        if busy is not None:
            console.busy(busy, countdown=False)  # the session is over: nothing to count down for
            return EXIT_BUSY
        if isinstance(exc, InvalidStatus):
            return fail(f"no voxpipe WebSocket at {url}: the server answered HTTP {exc.response.status_code} "
                        "(voxpipe serves it at /ws)", 3)
        return fail(f"no voxpipe server at {url} ({exc})", 3)
    except WebSocketException as exc:
        busy = refused_session(exc)
        if busy is None:
            return fail(str(exc), 1)
        console.busy(busy, countdown=False)
        return EXIT_BUSY
    except (DeviceError, EchoUnavailable) as exc:
        return fail(str(exc), 2)
    except OSError as exc:
        return fail(f"no voxpipe server at {url} ({exc})", 3)
    return 0


def list_devices_command() -> int:
    """``voxpipe mic --list-devices``: the devices on stdout; 0, or 2 with one line on stderr
    when PortAudio is missing or cannot list them."""
    import sys

    from audio.devices import DeviceError, list_devices

    try:
        print(list_devices())
    except DeviceError as exc:
        print(f"voxpipe mic: {exc}", file=sys.stderr)
        return 2
    return 0
