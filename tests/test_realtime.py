"""The OpenAI Realtime API subset at ``/v1/realtime`` (server/realtime/, docs/REALTIME.md),
driven by the official ``openai`` package's realtime clients (GA ``client.realtime`` and
beta ``client.beta.realtime``): over fake engines for the mapping, then against the real
server with real speech."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import pytest
from openai import AsyncOpenAI

from audio.pcm import resample
from audio.wav import read_mono
from pipeline.config import VoxpipeConfig
from pipeline.errors import Busy
from server.realtime.types import REALTIME_RATE
from tests.fake_server import fake_server
from tests.fakes import FakeLlm, LlmReply, fake_engines
from tests.wsclient import CONTROL_DEADLINE_S, MODEL_DEADLINE_S, wer

CHUNK = REALTIME_RATE // 10  # 100 ms appends
JFK = "en_jfk_inaugural_1961.wav"
ONE_BREATH = "en_librispeech_1988-24833-0003.wav"
"""5 s of speech without a pause over 0.1 s: one turn under server VAD (JFK pauses 1.1 s
after "fellow Americans", which ends a turn at the default 500 ms end silence)."""


def pcm24(x: np.ndarray) -> bytes:
    """Float32 in [-1, 1] → PCM16 little-endian bytes."""
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def tone24(ms: float) -> np.ndarray:
    """A loud sine at 24 kHz: speech with words to the fake VAD and ASR."""
    t = np.arange(int(ms * REALTIME_RATE / 1000)) / REALTIME_RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def client(port: int, key: str = "any") -> AsyncOpenAI:
    return AsyncOpenAI(api_key=key, base_url=f"http://127.0.0.1:{port}/v1",
                       websocket_base_url=f"ws://127.0.0.1:{port}/v1")


async def append(conn, x: np.ndarray, speed: float | None = None) -> None:
    """Append ``x`` (24 kHz float32) in 100 ms base64 chunks, at ``speed`` × real time
    (None: as fast as the server reads)."""
    data, t0 = pcm24(x), time.perf_counter()
    for i in range(0, len(data), 2 * CHUNK):
        if speed is not None:
            await asyncio.sleep(max(0.0, t0 + i / 2 / REALTIME_RATE / speed - time.perf_counter()))
        await conn.input_audio_buffer.append(audio=base64.b64encode(data[i:i + 2 * CHUNK]).decode())


async def collect(conn, until, deadline_s: float = CONTROL_DEADLINE_S, seen: list | None = None) -> list:
    """Events from ``conn`` up to and including the first for which ``until(event)``;
    fails after ``deadline_s`` (appended to ``seen`` as they come)."""
    seen = [] if seen is None else seen
    async with asyncio.timeout(deadline_s):
        async for e in conn:
            seen.append(e)
            if until(e):
                return seen
    raise AssertionError(f"connection closed; got {[e.type for e in seen]}")


def types(events) -> list[str]:
    return [e.type for e in events]


def audio_of(events, kind: str = "response.output_audio.delta") -> np.ndarray:
    raw = b"".join(base64.b64decode(e.delta) for e in events if e.type == kind)
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768


def is_done(e) -> bool:
    return e.type == "response.done"


# ---- the mapping, over fake engines ---------------------------------------------------------


async def test_server_vad_turn_maps_onto_ga_events():
    """A spoken turn (tone, then silence) with the GA client: every Realtime event in order,
    OpenAI-style ids, base64 PCM16 24 kHz reply audio of the fake TTS's length."""
    async with fake_server() as srv, client(srv.port).realtime.connect(model="voxpipe") as conn:
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                           "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                                               "turn_detection": {"type": "server_vad"}}}})
        await append(conn, np.concatenate([tone24(1200), np.zeros(REALTIME_RATE, np.float32)]))
        events = await collect(conn, is_done)
    names = types(events)
    assert names[:2] == ["session.created", "session.updated"]
    assert events[1].session.instructions == "Be brief."
    expected = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                "input_audio_buffer.committed", "conversation.item.input_audio_transcription.delta",
                "conversation.item.input_audio_transcription.completed", "response.created",
                "response.output_item.added", "response.output_audio_transcript.delta",
                "response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.done",
                "response.output_item.done", "conversation.item.done", "response.done"]
    assert [n for n in names if n in expected] == sorted(set(expected) & set(names), key=names.index)
    assert set(expected) <= set(names), set(expected) - set(names)
    first = {e.type: e for e in reversed(events)}
    user_item = first["input_audio_buffer.speech_started"].item_id
    assert user_item.startswith("item_") and first["input_audio_buffer.committed"].item_id == user_item
    assert first["conversation.item.input_audio_transcription.completed"].transcript == "alpha bravo charlie delta"
    done = first["response.done"].response
    assert done.status == "completed" and done.id.startswith("resp_") and done.usage.output_tokens == 1
    assert done.output[0].content[0].transcript == "Okay."
    assert all(e.event_id.startswith("event_") for e in events)
    assert len(audio_of(events)) == int(len("Okay.") * 0.02 * REALTIME_RATE)  # FakeTts: 20 ms per character


async def test_beta_client_gets_beta_names_and_session_shape():
    """``client.beta.realtime`` (``OpenAI-Beta: realtime=v1``) gets the beta names:
    ``response.audio.delta``, ``response.audio_transcript.*``, ``conversation.item.created``."""
    async with fake_server() as srv, client(srv.port).beta.realtime.connect(model="voxpipe") as conn:
        await conn.session.update(session={"input_audio_format": "pcm16", "output_audio_format": "pcm16",
                                           "turn_detection": {"type": "server_vad"}})
        await append(conn, np.concatenate([tone24(800), np.zeros(REALTIME_RATE, np.float32)]))
        events = await collect(conn, is_done)
    names = types(events)
    assert events[0].session.input_audio_format == "pcm16"
    for name in ("response.audio.delta", "response.audio_transcript.delta", "response.audio_transcript.done",
                 "response.audio.done", "conversation.item.created"):
        assert name in names, names
    assert not [n for n in names if "output_audio" in n or n in ("conversation.item.added", "conversation.item.done")]
    assert len(audio_of(events, "response.audio.delta")) > 0


async def test_bad_events_get_realtime_errors_and_the_connection_lives():
    """Bad JSON, an unknown type, bad base64, a binary frame, an unsupported format, a
    cancel with nothing to cancel: each an ``error`` event of the Realtime shape; then a
    typed turn still works."""
    async with fake_server() as srv, client(srv.port).realtime.connect(model="voxpipe") as conn:
        await collect(conn, lambda e: e.type == "session.created")
        bad = [('{"type": "session.update", ', "invalid_json", None),
               ('{"type": "conversation.item.truncate", "event_id": "ev1"}', "invalid_value", "type"),
               ('{"type": "input_audio_buffer.append", "audio": "@@not base64@@", "event_id": "ev2"}',
                "invalid_value", "audio"),
               ('{"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": '
                '{"type": "audio/pcmu"}}}}}', "invalid_value", "session.audio.input.format"),
               ('{"type": "input_audio_buffer.append"}', "invalid_event", "audio"),
               ('{"type": "response.cancel"}', "response_cancel_not_active", None),
               ('{"type": "response.create"}', "response_create_without_input", None),
               # lone surrogates: echoed back (session.updated, an error's event_id) they failed
               # to encode and the connection was dropped without a close frame
               ('{"type": "session.update", "session": {"instructions": "be \\ud800 brief"}}', "invalid_json", None),
               ('{"type": "nope", "event_id": "\\udfff"}', "invalid_json", None)]
        for frame, code, param in bad:
            await conn.send_raw(frame)
            (err,) = [e for e in await collect(conn, lambda e: e.type == "error")]
            assert (err.error.code, err.error.param, err.error.type) == (code, param, "invalid_request_error"), frame
            assert err.event_id.startswith("event_")
            if '"event_id": "ev' in frame:
                assert err.error.event_id == frame.split('"event_id": "')[1].split('"')[0]
        await conn._connection.send(b"\x00\x01")
        err = (await collect(conn, lambda e: e.type == "error"))[-1]
        assert err.error.code == "invalid_frame"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello there"}]})
        await conn.response.create()
        events = await collect(conn, is_done)
    assert "conversation.item.added" in types(events) and events[-1].response.status == "completed"
    assert events[-1].response.output[0].content[0].transcript == "Okay."


async def test_typed_turn_and_cancel_mid_reply():
    """``conversation.item.create`` + ``response.create`` is a typed turn; ``response.cancel``
    mid-reply ends it with ``response.done`` ``cancelled`` (``client_cancelled``) and
    aborts the LLM stream."""
    llm = FakeLlm(default=LlmReply.of(*[f"Word {i}." for i in range(40)], delay_s=0.1))
    async with fake_server(engines=fake_engines(llm=llm)) as srv, \
            client(srv.port).realtime.connect(model="voxpipe") as conn:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Count to forty"}]})
        await conn.response.create()
        events = await collect(conn, lambda e: e.type == "response.output_audio.delta")
        await conn.response.cancel()
        events = await collect(conn, is_done, seen=events)
    done = events[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
    assert llm.requests[0].messages[-1]["content"] == "Count to forty"
    assert llm.aborted == [0]


async def test_manual_turn_waits_for_commit_and_response_create():
    """``turn_detection: null``: no VAD events; ``commit`` reports the item; the reply comes
    only after ``response.create``. An empty commit is an error."""
    async with fake_server() as srv, client(srv.port).realtime.connect(model="voxpipe") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        events = await collect(conn, lambda e: e.type == "session.updated")
        assert events[-1].session.audio.input.turn_detection is None
        await conn.input_audio_buffer.commit()
        assert (await collect(conn, lambda e: e.type == "error"))[-1].error.code == "input_audio_buffer_commit_empty"
        await append(conn, np.concatenate([tone24(800), np.zeros(REALTIME_RATE, np.float32)]))
        await conn.input_audio_buffer.commit()
        events = await collect(conn, lambda e: e.type == "conversation.item.added")  # after .committed
        with pytest.raises(TimeoutError):  # committed, not answered: the client has not asked yet
            await collect(conn, lambda e: True, deadline_s=1.0, seen=events)
        await conn.response.create()
        events = await collect(conn, is_done, deadline_s=CONTROL_DEADLINE_S, seen=events)
    names = types(events)
    assert "input_audio_buffer.speech_started" not in names and "input_audio_buffer.speech_stopped" not in names
    completed = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert completed[0].transcript == "alpha bravo charlie"
    assert completed[0].item_id == [e for e in events if e.type == "input_audio_buffer.committed"][0].item_id
    assert events[-1].response.status == "completed"


async def test_busy_is_an_error_and_a_failed_response():
    """voxpipe's ``busy`` (here: the LLM refuses) → ``error`` ``server_busy`` and a
    ``response.done`` with status ``failed``."""
    llm = FakeLlm([Busy("llm is busy", retry_after_ms=1500)])
    async with fake_server(engines=fake_engines(llm=llm)) as srv, \
            client(srv.port).realtime.connect(model="voxpipe") as conn:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hi"}]})
        await conn.response.create()
        events = await collect(conn, lambda e: e.type == "response.done" and e.response.status == "failed")
    err = [e for e in events if e.type == "error"][-1].error
    assert err.code == "server_busy" and err.type == "server_error" and f"{err.retry_after_ms} ms" in err.message
    assert events[-1].response.status_details.error.code == "server_busy"


async def test_token_is_the_api_key():
    """With ``--token``, the openai client's ``api_key`` (``Authorization: Bearer``) is
    the token: the right one connects, a wrong one is refused with 401 at the upgrade."""
    cfg = VoxpipeConfig()
    cfg.server.token = "s3cret"
    async with fake_server(cfg) as srv:
        async with client(srv.port, "s3cret").realtime.connect(model="voxpipe") as conn:
            assert (await collect(conn, lambda e: True))[0].type == "session.created"
        with pytest.raises(Exception, match="401"):
            async with client(srv.port, "wrong").realtime.connect(model="voxpipe") as conn:
                await conn.recv()


# ---- the real server, real speech -------------------------------------------------------------


def clip24(audio_dir, name: str = JFK) -> np.ndarray:
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, REALTIME_RATE)


@pytest.mark.slow
async def test_real_speech_through_the_openai_realtime_client(server, audio_dir, manifest):
    """A one-breath LibriSpeech clip at 2× real time with server VAD: VAD events, transcription
    deltas and a completed transcript within the WER bound, a reply with audio (base64
    PCM16 24 kHz) and its transcript, ``response.done`` completed."""
    port = int(server["http"].rsplit(":", 1)[1])
    async with client(port).realtime.connect(model="voxpipe") as conn:
        await conn.session.update(session={"type": "realtime", "instructions": "Answer in one short sentence."})
        await collect(conn, lambda e: e.type == "session.updated")
        x = np.concatenate([clip24(audio_dir, ONE_BREATH), np.zeros(2 * REALTIME_RATE, np.float32)])
        sender = asyncio.create_task(append(conn, x, speed=2.0))
        events = await collect(conn, is_done, MODEL_DEADLINE_S)
        await sender
    names = types(events)
    for name in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "conversation.item.input_audio_transcription.delta", "response.created",
                 "response.output_audio_transcript.delta", "response.output_audio_transcript.done"):
        assert name in names, names
    ref = manifest[ONE_BREATH]["reference_transcript"]
    final = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"][-1].transcript
    assert wer(ref, final) <= 0.15, final
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta")
    assert wer(ref, deltas) <= 0.3, deltas
    reply = audio_of(events)
    assert len(reply) > 0.5 * REALTIME_RATE and np.abs(reply).max() > 0.05
    said = [e for e in events if e.type == "response.output_audio_transcript.done"][-1].transcript
    written = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert said.strip() and said == written
    done = events[-1].response  # a reply that reached the token limit is "incomplete" (OpenAI's mapping)
    assert done.status == "completed" or (done.status == "incomplete"
                                          and done.status_details.reason == "max_output_tokens"), done


@pytest.mark.slow
async def test_real_manual_turn_and_cancel(server, audio_dir, manifest):
    """``turn_detection: null``: the clip appended as fast as the budget allows, committed,
    answered on ``response.create``; then a typed question whose reply ``response.cancel``
    stops mid-way (``response.done`` cancelled)."""
    port = int(server["http"].rsplit(":", 1)[1])
    async with client(port).realtime.connect(model="voxpipe") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await collect(conn, lambda e: e.type == "session.updated")
        await append(conn, clip24(audio_dir))
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await collect(conn, is_done, MODEL_DEADLINE_S)
        final = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"][-1]
        assert wer(manifest[JFK]["reference_transcript"], final.transcript) <= 0.15, final.transcript
        assert events[-1].response.status == "completed" and len(audio_of(events)) > 0
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]})
        await conn.response.create()
        events = await collect(conn, lambda e: e.type == "response.output_audio.delta", MODEL_DEADLINE_S)
        await conn.response.cancel()
        events = await collect(conn, is_done, MODEL_DEADLINE_S, seen=events)
    assert events[-1].response.status == "cancelled", types(events)
    assert events[-1].response.status_details.reason == "client_cancelled"


async def test_clear_drops_speech_in_progress_and_the_session_cap_holds():
    """``input_audio_buffer.clear`` mid-speech: ``cleared``, no ``speech_stopped``, no
    response; the next speech is a turn of its own. A second connection beyond
    ``--max-sessions 1`` is refused (503) before the upgrade, as on ``/ws``."""
    cfg = VoxpipeConfig()
    cfg.server.max_sessions = 1
    async with fake_server(cfg) as srv, client(srv.port).realtime.connect(model="voxpipe") as conn:
        await append(conn, tone24(1000))
        events = await collect(conn, lambda e: e.type == "input_audio_buffer.speech_started")
        await conn.input_audio_buffer.clear()
        events = await collect(conn, lambda e: e.type == "input_audio_buffer.cleared", seen=events)
        with pytest.raises(Exception, match="503"):
            async with client(srv.port).realtime.connect(model="voxpipe") as other:
                await other.recv()
        await append(conn, np.concatenate([tone24(600), np.zeros(REALTIME_RATE, np.float32)]))
        events = await collect(conn, is_done, seen=events)
    names = types(events)
    assert names.count("input_audio_buffer.speech_started") == 2 and names.count("response.created") == 1
    assert names.index("input_audio_buffer.speech_stopped") > names.index("input_audio_buffer.cleared")
    assert [e.transcript for e in events
            if e.type == "conversation.item.input_audio_transcription.completed"] == ["alpha bravo"]
