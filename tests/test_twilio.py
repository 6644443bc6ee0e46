"""Phone calls through ``/twilio``: a scripted client that speaks Twilio Media Streams as
Twilio documents it (connected, start, media at 20 ms, mark, stop; base64 μ-law at 8 kHz)
with real speech, against the real server (SmolLM2, Whisper, Piper); and the parser and the
μ-law codec on their own."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from audio.mulaw import MulawCodec
from audio.pcm import resample
from audio.wav import read_mono
from server.twilio.types import Media, Start, TwilioError
from server.twilio.wire import parse_message

SID = "MZ0123456789abcdef0123456789abcdef"
START = {"event": "start", "sequenceNumber": "1", "streamSid": SID,
         "start": {"accountSid": "AC01", "streamSid": SID, "callSid": "CA01", "tracks": ["inbound"],
                   "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                   "customParameters": {}}}


def mulaw8k(audio_dir, name: str) -> bytes:
    x, sr = read_mono(audio_dir / name)
    pcm = (np.clip(resample(x, sr, 8000), -1, 1) * 32767).astype("<i2").tobytes()
    return MulawCodec().encode(pcm)


def media(payload: bytes, chunk: int) -> str:
    return json.dumps({"event": "media", "sequenceNumber": str(chunk + 2), "streamSid": SID,
                       "media": {"track": "inbound", "chunk": str(chunk), "timestamp": str(chunk * 20),
                                 "payload": base64.b64encode(payload).decode()}})


# ---- the parts ------------------------------------------------------------------------------


def test_twilio_s_documented_messages_parse():
    assert isinstance(parse_message(json.dumps(START)), Start)
    m = parse_message(media(b"\xff" * 160, 1))
    assert isinstance(m, Media) and base64.b64decode(m.media.payload) == b"\xff" * 160
    for msg in ({"event": "connected", "protocol": "Call", "version": "1.0.0"},
                {"event": "mark", "sequenceNumber": "4", "streamSid": SID, "mark": {"name": "response-1"}},
                {"event": "dtmf", "streamSid": SID, "sequenceNumber": "5", "dtmf": {"track": "inbound_track",
                                                                                   "digit": "1"}},
                {"event": "stop", "sequenceNumber": "6", "streamSid": SID, "stop": {"accountSid": "AC01",
                                                                                   "callSid": "CA01"}}):
        assert parse_message(json.dumps(msg)).event == msg["event"]


@pytest.mark.parametrize("frame, says", [
    (b"\x00\x01", "binary frame"),
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"event": "transcription"}), "unknown event 'transcription'"),
    (json.dumps({"event": "media", "media": {"track": "inbound"}}), "invalid media: media.payload"),
    (json.dumps({"event": "start", "start": {"streamSid": SID}}), "invalid start: start.mediaFormat"),
])
def test_what_is_not_twilio_s_says_what_is_wrong(frame, says):
    with pytest.raises(TwilioError, match=says):
        parse_message(frame)


def test_mulaw_round_trip_keeps_speech(audio_dir):
    x, sr = read_mono(audio_dir / "en_cmu_goforward.wav")
    pcm = (np.clip(resample(x, sr, 8000), -1, 1) * 32767).astype("<i2")
    codec = MulawCodec()
    mulaw = codec.encode(pcm.tobytes()[:333]) + codec.encode(pcm.tobytes()[333:])  # a sample split across calls
    assert len(mulaw) == len(pcm)  # one byte a sample
    back = np.frombuffer(codec.decode(mulaw), dtype="<i2").astype(np.float32)
    err = back - pcm.astype(np.float32)
    assert 10 * np.log10(np.sum(pcm.astype(np.float32) ** 2) / np.sum(err ** 2)) > 30  # G.711: ~38 dB SNR


# ---- a call through the real server -----------------------------------------------------


class Call:
    """A scripted Twilio: sends as Twilio does, collects what voxpipe sends back."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.got: list[dict] = []
        self.new = asyncio.Event()

    async def read(self) -> None:
        async for msg in self.ws:
            self.got.append(json.loads(msg))
            self.new.set()

    async def speak(self, mulaw: bytes, chunk0: int = 1) -> int:
        """Send ``mulaw`` as 20 ms media messages in real time; returns the next chunk number."""
        t0 = asyncio.get_running_loop().time()
        for k, i in enumerate(range(0, len(mulaw), 160)):
            await asyncio.sleep(max(0.0, t0 + k * 0.02 - asyncio.get_running_loop().time()))
            await self.ws.send(media(mulaw[i:i + 160], chunk0 + k))
        return chunk0 + len(mulaw) // 160 + 1

    async def until(self, what, deadline_s: float = 300) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while not what(self.got):
            self.new.clear()
            left = end - loop.time()
            if left <= 0:
                raise TimeoutError(f"no {what.__doc__ or 'match'}: got {[m['event'] for m in self.got]}")
            try:
                await asyncio.wait_for(self.new.wait(), left)
            except TimeoutError:
                pass


def _audio(got: list[dict]) -> bytes:
    return b"".join(base64.b64decode(m["media"]["payload"]) for m in got if m["event"] == "media")


@pytest.mark.slow
async def test_a_phone_caller_gets_a_spoken_reply_in_mulaw_and_cuts_it_by_talking(server, audio_dir):
    from websockets.asyncio.client import connect

    url = server["url"].replace("/ws", "/twilio")
    silence = b"\xff" * 8000  # 1 s of μ-law silence
    async with connect(url, max_size=None) as ws:
        call = Call(ws)
        reader = asyncio.create_task(call.read())
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(json.dumps(START))
        await ws.send(json.dumps({"event": "transcription", "what": "not Twilio's"}))  # dropped, logged
        await ws.send("{not json")
        chunk = await call.speak(mulaw8k(audio_dir, "en_cmu_goforward.wav") + silence)
        await call.until(lambda got: any(m["event"] == "mark" for m in got))  # a whole reply, then its mark
        marks = [m for m in call.got if m["event"] == "mark"]
        first = call.got.index(marks[0])
        assert marks[0]["mark"]["name"].startswith("response-") and all(m["streamSid"] == SID for m in call.got)
        reply = _audio(call.got[:first])
        assert len(reply) / 8000 >= 0.5, len(reply)  # μ-law: a byte a sample at 8 kHz
        pcm = np.frombuffer(MulawCodec().decode(reply), dtype="<i2").astype(np.float32) / 32768
        assert float(np.sqrt(np.mean(pcm ** 2))) > 0.01, "the reply is silent"

        # a question with a long answer, then the caller talks over it: voxpipe sends clear
        n = len(call.got)
        ask = {"event": "start", **{k: v for k, v in START.items() if k != "event"}}
        ask["start"] = {**START["start"], "customParameters": {
            "system_prompt": "Answer every message with at least five long sentences."}}
        await ws.send(json.dumps(ask))  # a new start: the same call, a new system prompt
        chunk = await call.speak(mulaw8k(audio_dir, "en_librispeech_1995-1837-0001.wav") + silence, chunk)
        await call.until(lambda got: sum(m["event"] == "media" for m in got[n:]) >= 10)  # the reply plays
        speaker = asyncio.create_task(call.speak(mulaw8k(audio_dir, "en_jfk_inaugural_1961.wav"), chunk))
        await call.until(lambda got: any(m["event"] == "clear" for m in got[n:]))
        speaker.cancel()
        await ws.send(json.dumps({"event": "stop", "sequenceNumber": "999", "streamSid": SID,
                                  "stop": {"accountSid": "AC01", "callSid": "CA01"}}))
        await asyncio.wait_for(reader, 30)  # voxpipe closes the call after stop
    assert ws.close_code == 1000
    log = server["log"].read_text()
    assert "unknown event 'transcription'" in log and "dropped a message (1 so far)" in log
