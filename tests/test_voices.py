"""Voices as a catalogue (issue 35): ``--voice LANG=VOICE`` parsed and loaded once, the
voice of each reply chosen by the session or by the turn's language, numbers said in the
voice's language, ``GET /v1/voices``, and a real server where a German spoken question is
answered by the German voice while an English session keeps the English one.

Real voices throughout: Piper ``joe`` and espeak-ng's German (``apt-get install espeak-ng``)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from openai import AsyncOpenAI

from audio.pcm import RATE, resample
from audio.wav import read_mono
from pipeline import model_files
from pipeline.config import AsrConfig, TtsConfig, VoxpipeConfig
from pipeline.tts.catalogue import UnknownVoice, VoiceCatalogue, parse_voice, parse_voices
from pipeline.tts.choice import multilingual_asr, resolve_tts
from pipeline.tts.chunker import SentenceChunker, speakable
from pipeline.tts.engine import TtsEngine
from pipeline.tts.loader import load_voices
from pipeline.tts.types import Phrase, VoiceInfo, VoiceSpec
from pipeline.tts.voices import EspeakSynth
from tests.conftest import running_server
from tests.fake_server import fake_server
from tests.fakes import FakeAsr, FakeTts, fake_engines
from tests.wsclient import CONTROL_DEADLINE_S, MODEL_DEADLINE_S, Client

GERMAN = "de_fleurs_001.wav"
ENGLISH = "en_librispeech_3752-4944-0000.wav"
OUT_RATE = 24000  # the sessions' reply rate: the voices speak at 22050 Hz
VOICES = ("en=joe", "de=espeak:de")

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed "
                                  "(.ci/setup.sh installs it)")


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def clip16k(audio_dir, name: str) -> np.ndarray:
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, RATE)


# ---- parsing and choosing (pure) -------------------------------------------------------------


def test_voice_entries_parse_into_name_language_and_backend(tmp_path):
    onnx = tmp_path / "de_DE-test-low.onnx"
    onnx.write_bytes(b"")
    (tmp_path / "de_DE-test-low.onnx.json").write_text(json.dumps({"language": {"code": "de_DE"}}))
    assert parse_voice("joe") == VoiceSpec("joe", "en", "piper", "joe")
    assert parse_voice("en=joe") == VoiceSpec("joe", "en", "piper", "joe")
    assert parse_voice("de=espeak:de") == VoiceSpec("espeak-de", "de", "espeak", "de")
    assert parse_voice("espeak:fr") == VoiceSpec("espeak-fr", "fr", "espeak", "fr")
    assert parse_voice("DE_at=espeak:de") == VoiceSpec("espeak-de", "de", "espeak", "de")
    assert parse_voice(str(onnx)) == VoiceSpec("de_DE-test-low", "de", "piper", str(onnx))  # from its .json
    assert parse_voice(f"fr={onnx}").language == "fr"
    assert parse_voices([]) == [parse_voice("joe")]
    assert [s.name for s in parse_voices(["en=joe", f"de={tmp_path}"])] == ["joe", "de_DE-test-low"]  # a folder
    for bad, says in (("de=", "expected"), ("german=joe", "ISO 639-1"), ("espeak:", "espeak-ng voice code"),
                      ("espeak:de;rm", "espeak-ng voice code")):
        with pytest.raises(ValueError, match=says):
            parse_voice(bad)
    with pytest.raises(ValueError, match="two voices named 'joe'"):
        parse_voices(["joe", "de=joe"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no Piper voice"):
        parse_voices([str(empty)])


def test_the_catalogue_picks_the_session_voice_else_the_turn_language_else_the_default():
    joe = VoiceInfo("joe", "en", "piper", 22050)
    de = VoiceInfo("espeak-de", "de", "espeak", 22050)
    voices = VoiceCatalogue([joe, de])
    assert voices.choose(None, "de") is de and voices.choose(None, "de-AT") is de
    assert voices.choose(None, "en") is joe and voices.choose(None, None) is joe
    assert voices.choose(None, "fr") is joe  # no French voice: the default
    assert voices.choose("espeak-de", "en") is de and voices.choose("joe", "de") is joe
    with pytest.raises(UnknownVoice) as err:
        voices.get("alloy")
    assert str(err.value) == "unknown voice 'alloy'; available: joe (en), espeak-de (de)"
    assert voices.as_json() == {"object": "list", "default": "joe", "data": [
        {"name": "joe", "language": "en", "backend": "piper", "sample_rate": 22050},
        {"name": "espeak-de", "language": "de", "backend": "espeak", "sample_rate": 22050}]}
    assert VoiceCatalogue().choose("joe", "de") is None  # a stage that does not say: its own voice


@needs_espeak
def test_a_non_english_voice_makes_multilingual_whisper_the_default():
    cfg = VoxpipeConfig()
    cfg.tts = resolve_tts(TtsConfig(voices=VOICES))
    assert multilingual_asr(cfg, asr_model_given=False).asr.model == "base"
    assert multilingual_asr(cfg, asr_model_given=True).asr.model == AsrConfig().model  # --asr-model wins
    english = VoxpipeConfig()
    english.tts = resolve_tts(TtsConfig(voices=("en=joe", "espeak:en-us")))
    assert multilingual_asr(english, asr_model_given=False).asr.model == AsrConfig().model


def test_a_non_english_voice_beside_an_english_only_asr_is_warned_about(caplog):
    cfg = VoxpipeConfig()
    cfg.tts = resolve_tts(TtsConfig(voices=VOICES))
    with caplog.at_level("WARNING", logger="pipeline.tts.choice"):
        multilingual_asr(cfg, asr_model_given=False)  # base replaces tiny.en: nothing to warn of
        assert not caplog.records
        multilingual_asr(cfg, asr_model_given=True)  # --asr-model tiny.en
    assert len(caplog.records) == 1 and "English-only" in caplog.records[0].getMessage()


@needs_espeak
def test_serve_flags_repeat_voice_and_an_explicit_asr_model_wins():
    from cli.main import build_parser
    from cli.serve import serve_config

    def serve(*argv: str) -> VoxpipeConfig:
        return serve_config(build_parser().parse_args(["serve", *argv]))

    cfg = serve("--voice", "en=joe", "--voice", "de=espeak:de")
    assert cfg.tts.voices == VOICES and cfg.tts.voice == "joe" and cfg.asr.model == "base"
    assert serve("--voice", "de=espeak:de", "--asr-model", "tiny.en").asr.model == "tiny.en"
    assert serve().tts.voices == () and serve().asr.model == AsrConfig().model
    with pytest.raises(ValueError, match="LANG must be"):
        serve("--voice", "german=espeak:de")


# ---- the TTS stage with real voices ------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/setup.sh installs it)")
    cfg = TtsConfig(voices=VOICES)
    return TtsEngine(load_voices(cfg), cfg)


def espeak(text: str, code: str = "de") -> np.ndarray:
    """What ``espeak-ng -v CODE`` says for ``text`` (float32 at its 22050 Hz)."""
    return EspeakSynth(code, name="x", language=code).speak(text)


def test_each_job_is_spoken_by_its_voice_with_numbers_in_its_language(engine):
    assert engine.catalogue.names() == "joe (en), espeak-de (de)" and engine.sample_rate == 22050
    german = engine.speak(Phrase("Das kostet 19,99 €, bei 98,6 °F.", "espeak-de"))
    assert german.voice == "espeak-de" and german.sample_rate == 22050
    said = "Das kostet neunzehn Euro neunundneunzig, bei achtundneunzig Komma sechs Grad Fahrenheit."
    assert np.array_equal(german.audio, espeak(said))  # espeak-ng is deterministic
    english = engine.speak(Phrase("It is 3.14 at 9 a.m."))  # no voice named: the default, joe
    assert english.voice == "joe" and len(english.audio) > 22050 and np.abs(english.audio).max() > 0.05
    with pytest.raises(UnknownVoice, match=r"available: joe \(en\), espeak-de \(de\)"):
        engine.speak(Phrase("Hallo.", "thorsten"))
    out = engine.process_batch([Phrase("Hallo.", "thorsten"), "Okay."])  # one bad job fails alone
    assert isinstance(out[0], UnknownVoice) and out[1].voice == "joe"


def test_a_folder_of_piper_voices_loads_each_once(tmp_path):
    onnx, conf = model_files.piper_joe_files()
    for path in (onnx, conf):
        os.symlink(path, tmp_path / path.name)
    cfg = TtsConfig(voices=(str(tmp_path),))
    (synth,) = load_voices(cfg)
    assert synth.info == VoiceInfo(onnx.name.removesuffix(".onnx"), "en", "piper", 22050)
    assert len(TtsEngine([synth], cfg).speak(Phrase("Hello.")).audio) > 0


# ---- a real server with two voices -------------------------------------------------------------


@pytest.fixture(scope="module")
def voices_server(tmp_path_factory):
    """``voxpipe serve --voice en=joe --voice de=espeak:de`` (no ``--asr-model``: Whisper base)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/setup.sh installs it)")
    log = tmp_path_factory.mktemp("voices") / "serve.log"
    args = [a for v in VOICES for a in ("--voice", v)]
    with running_server(log, *args) as (port, _):
        yield {"url": f"ws://127.0.0.1:{port}/ws", "port": port, "log": log}


def expected_samples(engine: TtsEngine, voice: str, deltas: list[str]) -> int:
    """Samples the reply's phrases make at OUT_RATE when ``voice`` speaks them: the deltas
    re-chunked as the server chunks them, each phrase synthesized and resampled as the
    session does (espeak-ng's lengths depend on the text only)."""
    chunker = SentenceChunker()
    total = 0
    for phrase in [p for d in deltas for p in chunker.push(d)] + chunker.flush():
        if speakable(phrase):
            speech = engine.speak(Phrase(phrase, voice))
            total += len(resample(speech.audio, speech.sample_rate, OUT_RATE)) if len(speech.audio) else 0
    return total


async def spoken_turn(url: str, audio: np.ndarray, **start) -> tuple[Client, dict, dict]:
    """One spoken turn (VAD off, ``input.end``): the client, its final transcript and the
    reply's ``response.done``."""
    async with Client(url) as c:
        await c.start(sample_rate=RATE, output_sample_rate=OUT_RATE, vad=False, **start)
        done = await c.turn(pcm16(audio))
    finals = c.conv.of("transcript.final")
    assert done["type"] == "response.done" and finals, c.conv.events
    return c, finals[-1], done


@pytest.mark.slow
async def test_a_german_question_gets_the_german_voice_while_an_english_session_keeps_english(
        voices_server, engine, audio_dir, manifest):
    german, english = await asyncio.gather(
        spoken_turn(voices_server["url"], clip16k(audio_dir, GERMAN),
                    system_prompt="Antworte immer auf Deutsch, in einem kurzen Satz."),
        spoken_turn(voices_server["url"], clip16k(audio_dir, ENGLISH)))
    (de_client, de_final, de_done), (en_client, en_final, en_done) = german, english
    assert de_final["language"] == "de" and en_final["language"] == "en"
    assert de_client.conv.of("response.started")[-1]["voice"] == de_done["voice"] == "espeak-de"
    assert en_client.conv.of("response.started")[-1]["voice"] == en_done["voice"] == "joe"
    rid = de_done["response_id"]
    deltas = [e["delta"] for e in de_client.conv.of("response.text.delta") if e["response_id"] == rid]
    audio = de_client.conv.reply_audio(rid)
    want = await asyncio.to_thread(expected_samples, engine, "espeak-de", deltas)
    assert want > OUT_RATE // 2 and abs(len(audio) - want) <= 4 * max(1, len(deltas)), (len(audio), want)
    en_audio = en_client.conv.reply_audio(en_done["response_id"])
    assert len(en_audio) > OUT_RATE // 2 and float(np.abs(en_audio).max()) > 0.05
    log = voices_server["log"].read_text()
    assert "multilingual Whisper 'base'" in log and "voices: joe (en), espeak-de (de)" in log


@pytest.mark.slow
async def test_a_language_switch_mid_conversation_switches_the_voice(voices_server, audio_dir):
    async with Client(voices_server["url"]) as c:
        await c.start(sample_rate=RATE, output_sample_rate=OUT_RATE, vad=False)
        dones = [await c.turn(pcm16(clip16k(audio_dir, name))) for name in (GERMAN, ENGLISH)]
    finals = c.conv.of("transcript.final")
    assert [f["language"] for f in finals] == ["de", "en"], finals
    assert [d.get("voice") for d in dones] == ["espeak-de", "joe"], dones


@pytest.mark.slow
async def test_a_session_chooses_its_voice_and_an_unknown_one_is_a_clear_error(voices_server):
    async with Client(voices_server["url"]) as c:
        await c.send_json({"type": "session.start", "voice": "alloy"})
        err = await c.wait_for("error", CONTROL_DEADLINE_S)
        assert err["code"] == "bad_event" and not err["fatal"]
        assert "unknown voice 'alloy'; available: joe (en), espeak-de (de)" in err["message"]
        started = await c.start(output_sample_rate=OUT_RATE, voice="espeak-de")
        assert started["voice"] == "espeak-de"
        await c.send_json({"type": "text.input", "text": "Say hello."})
        done = await c.wait_for("response.done", MODEL_DEADLINE_S)
        assert c.conv.of("response.started")[-1]["voice"] == done["voice"] == "espeak-de"
        assert len(c.conv.reply_audio(done["response_id"])) > 0


@pytest.mark.slow
def test_get_v1_voices_lists_the_voices_default_first(voices_server):
    with urllib.request.urlopen(f"http://127.0.0.1:{voices_server['port']}/v1/voices", timeout=10) as r:
        body = json.load(r)
    assert body == {"object": "list", "default": "joe", "data": [
        {"name": "joe", "language": "en", "backend": "piper", "sample_rate": 22050},
        {"name": "espeak-de", "language": "de", "backend": "espeak", "sample_rate": 22050}]}


@pytest.mark.slow
async def test_realtime_session_update_voice_picks_the_voice(voices_server, engine):
    port = voices_server["port"]
    api = AsyncOpenAI(api_key="any", base_url=f"http://127.0.0.1:{port}/v1",
                      websocket_base_url=f"ws://127.0.0.1:{port}/v1")
    async with api.realtime.connect(model="voxpipe") as conn:
        events = []

        async def until(pred) -> object:
            async with asyncio.timeout(MODEL_DEADLINE_S):
                async for e in conn:
                    events.append(e)
                    if pred(e):
                        return e
            raise AssertionError([e.type for e in events])

        await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "alloy"}}})
        err = await until(lambda e: e.type == "error")
        assert err.error.code == "invalid_value" and err.error.param == "session.audio.output.voice"
        assert "available: joe (en), espeak-de (de)" in err.error.message
        await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "espeak-de"}},
                                           "instructions": "Answer in one short sentence."})
        updated = await until(lambda e: e.type == "session.updated")
        assert updated.session.audio.output.voice == "espeak-de"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Say hello."}]})
        await conn.response.create()
        done = await until(lambda e: e.type == "response.done")
    assert done.response.status in ("completed", "incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_audio_transcript.delta"]
    raw = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    want = await asyncio.to_thread(expected_samples, engine, "espeak-de", deltas)
    assert want > 0 and abs(len(raw) // 2 - want) <= 4 * max(1, len(deltas)), (len(raw) // 2, want)


def test_espeak_is_installed_by_the_ci_setup():
    setup = (Path(__file__).resolve().parent.parent / ".ci" / "setup.sh").read_text()
    assert "espeak-ng" in setup
    if shutil.which("espeak-ng"):
        assert subprocess.run(["espeak-ng", "--version"], capture_output=True, check=False).returncode == 0


# ---- the orchestration over fakes: which voice each reply's phrases name -----------------------


class _MultilingualAsr(FakeAsr):
    multilingual = True
    languages = ["en", "de"]


def _engines(tts: FakeTts):
    from pipeline.tts.catalogue import VoiceCatalogue

    engines = fake_engines(asr=_MultilingualAsr(), tts=tts)
    engines.voices = VoiceCatalogue([VoiceInfo("joe", "en", "piper", 22050),
                                     VoiceInfo("espeak-de", "de", "espeak", 22050)])
    return engines


async def test_the_session_language_and_voice_name_the_voice_of_every_phrase():
    tts = FakeTts()
    async with fake_server(engines=_engines(tts)) as srv, Client(f"ws://127.0.0.1:{srv.port}/ws") as c:
        await c.start(language="de")  # no voice: the session's language picks espeak-de
        await c.send_json({"type": "text.input", "text": "Hallo"})
        first = await c.wait_for("response.done", CONTROL_DEADLINE_S)
        await c.start(voice="joe", language="de")  # the session's voice wins over its language
        await c.send_json({"type": "text.input", "text": "Hallo"})
        second = await c.wait_for(lambda e: e["type"] == "response.done" and e is not first, CONTROL_DEADLINE_S)
    assert first["voice"] == "espeak-de" and second["voice"] == "joe"
    assert set(tts.voices) == {"espeak-de", "joe"}


async def test_realtime_beta_voice_is_checked_and_reported():
    tts = FakeTts()
    async with fake_server(engines=_engines(tts)) as srv:
        api = AsyncOpenAI(api_key="any", base_url=f"http://127.0.0.1:{srv.port}/v1",
                          websocket_base_url=f"ws://127.0.0.1:{srv.port}/v1")
        async with api.beta.realtime.connect(model="voxpipe") as conn:
            await conn.session.update(session={"voice": "alloy"})
            async with asyncio.timeout(CONTROL_DEADLINE_S):
                err = await anext(e async for e in conn if e.type == "error")
            assert err.error.code == "invalid_value" and err.error.param == "session.voice"
            assert "available: joe (en), espeak-de (de)" in err.error.message
            await conn.session.update(session={"voice": "espeak-de"})
            async with asyncio.timeout(CONTROL_DEADLINE_S):
                updated = await anext(e async for e in conn if e.type == "session.updated")
            assert updated.session.voice == "espeak-de"
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            async with asyncio.timeout(CONTROL_DEADLINE_S):
                await anext(e async for e in conn if e.type == "response.done")
    assert tts.voices and set(tts.voices) == {"espeak-de"}


@pytest.mark.slow
def test_a_voice_that_does_not_load_stops_serve_before_the_asr_and_llm_load(tmp_path):
    from tests.test_cli import voxpipe

    r = voxpipe("serve", "--llm", "smollm2", "--port", "0", "--voice", f"de={tmp_path / 'missing.onnx'}")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "missing.onnx" in r.stderr
    assert "ASR loaded" not in r.stderr and "LLM loaded" not in r.stderr, r.stderr[-2000:]
