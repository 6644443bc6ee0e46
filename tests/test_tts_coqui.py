"""The Coqui TTS backend (``--tts coqui:PATH``): a random tiny VITS built from Coqui's own
config classes, loaded through the real flag, speaking real turns through a real server."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from audio.pcm import resample
from audio.wav import read_mono
from pipeline.config import TtsConfig
from pipeline.tts.choice import resolve_tts
from pipeline.tts.chunker import SentenceChunker, speakable
from pipeline.tts.coqui import MAX_PIECE_CHARS, CoquiTtsEngine, pieces
from pipeline.tts.coqui_folder import check_model_folder
from tests.conftest import ROOT, running_server
from tests.wsclient import Client

CLIP = "en_librispeech_3752-4944-0000.wav"  # a short question-like sentence
BARGE_CLIP = "en_librispeech_1988-24833-0003.wav"
LONG = "Tell me a long story about a dragon who learns to bake bread."
OUT_RATE = 16000  # the session's output rate: not the model's 22050 Hz


@pytest.fixture(scope="session")
def vits_dir(tmp_path_factory):
    """A random tiny VITS model folder (config.json + model.pth), written once."""
    from bench.make_random_vits import write_random_vits

    return write_random_vits(tmp_path_factory.mktemp("vits"))


def _write_config(folder, config: dict, checkpoint: str | None = "model.pth"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if checkpoint:
        (folder / checkpoint).write_bytes(b"")
    return folder


def _bad_json(d):
    (d / "bad").mkdir()
    (d / "bad" / "config.json").write_text("{")
    return d / "bad"


def _empty(d):
    (d / "empty").mkdir()
    return d / "empty"


def _vits(args: dict, **config) -> dict:
    return {"model": "vits", "model_args": args, **config}


BAD_FOLDERS = {
    "missing": (lambda d: d / "missing", "not found"),
    "no config": (_empty, "no config.json"),
    "bad json": (_bad_json, "not a readable JSON config"),
    "xtts": (lambda d: _write_config(d / "xtts", {"model": "xtts"}), "'xtts' is not supported; supported: vits"),
    "tacotron2": (lambda d: _write_config(d / "t2", {"model": "tacotron2"}), "'tacotron2' is not supported"),
    "yourtts": (lambda d: _write_config(d / "yourtts", {"model": "vits", "model_args": {
        "use_d_vector_file": True, "use_language_embedding": True}}), "vits with d-vectors or a speaker encoder"),
    "speakers, no names": (lambda d: _write_config(d / "sp", _vits({"use_speaker_embedding": True,
                                                                     "num_speakers": 4})),
                           "use_speaker_embedding is set but the config names no speakers"),
    "speakers file missing": (lambda d: _write_config(d / "spf", _vits({"use_speaker_embedding": True,
                                                                        "speakers_file": "/train/speakers.json"})),
                              "speakers_file '/train/speakers.json': not a readable JSON file"),
    "speakers file not ids": (lambda d: _named(_write_config(d / "spn", _vits({
        "use_speaker_embedding": True, "speakers_file": "speakers.json"})), "speakers.json", ["a", "b"]),
        "expected a JSON object {name: id} of speakers"),
    "languages file missing": (lambda d: _write_config(d / "lf", _vits({"use_language_embedding": True,
                                                                        "language_ids_file": "langs.json"})),
                               "language_ids_file 'langs.json': not a readable JSON file"),
    "phonemes, no phonemizer": (lambda d: _write_config(d / "ph", {"model": "vits", "use_phonemes": True}),
                                "no phonemizer is configured"),
    "no checkpoint": (lambda d: _write_config(d / "nockpt", {"model": "vits"}, checkpoint=None), "has no checkpoint"),
    "truncated checkpoint": (lambda d: _truncated(_write_config(d / "cut", {"model": "vits"})),
                             "truncated or corrupt PyTorch checkpoint"),  # was a torch traceback at load, exit 1
}


def _named(folder, name: str, ids):
    (folder / name).write_text(json.dumps(ids))
    return folder


def _truncated(folder):
    """A ``torch.save`` zip cut short, as an interrupted copy leaves it."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 5000)
    (folder / "model.pth").write_bytes(buf.getvalue()[:3000])
    return folder


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_bad_model_folders_give_one_clear_error(tmp_path, case):
    make, says = BAD_FOLDERS[case]
    with pytest.raises(ValueError) as err:
        check_model_folder(make(tmp_path))
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_checkpoint_choice_follows_coqui_names(tmp_path):
    folder = _write_config(tmp_path / "m", {"model": "vits"}, checkpoint="checkpoint_900.pth")
    (folder / "checkpoint_10000.pth").write_bytes(b"")
    assert check_model_folder(folder).checkpoint.name == "checkpoint_10000.pth"  # the newest step
    (folder / "best_model.pth").write_bytes(b"")
    assert check_model_folder(folder).checkpoint.name == "best_model.pth"
    (folder / "model.pth").write_bytes(b"")
    assert check_model_folder(folder).checkpoint.name == "model.pth"


def test_a_long_phrase_is_spoken_in_pieces():
    """A run-on reply is one phrase; one VITS call on 3000 characters took 3.4 GB and 19 s
    (not cancellable): the engine speaks it in pieces cut at spaces, the audio joined."""
    class Model:
        def __init__(self):
            self.calls: list[str] = []

        def synthesize(self, text):
            self.calls.append(text)
            return {"wav": np.full(len(text), 0.1, np.float32)}

    model = Model()
    engine = CoquiTtsEngine(model, 22050, TtsConfig(backend="coqui", voices=("x",)))
    text = "hello there friend " * 160  # 3040 characters, no punctuation
    speech = engine.synthesize(text)
    assert len(model.calls) > 1 and all(0 < len(c) <= MAX_PIECE_CHARS for c in model.calls)
    assert " ".join(model.calls) == text.strip() and len(speech.audio) == sum(map(len, model.calls))
    assert pieces("x" * 600) == ["x" * 250, "x" * 250, "x" * 100]  # a word longer than a piece
    assert pieces("") == [] and pieces("word " + " " * 300 + "—") == ["word"]
    model.calls.clear()
    assert len(engine.synthesize("Hi there.").audio) > 0 and model.calls == ["Hi there."]


def tts_config(flag: str, *, voice: str | None = None, threads: int = 1) -> TtsConfig:
    """What ``--tts FLAG [--voice VOICE] --tts-threads THREADS`` configure."""
    return resolve_tts(TtsConfig(backend=flag, voices=(voice,) if voice else (), threads=threads))


def test_tts_flag_parsing(tmp_path):
    folder = _write_config(tmp_path / "m", {"model": "vits"})
    assert tts_config("piper") == TtsConfig()  # the default: Piper's joe
    assert tts_config("piper", voice="/v/x.onnx").voice == "/v/x.onnx"
    assert tts_config("piper:/v/y.onnx", threads=2) == TtsConfig(voices=("/v/y.onnx",), threads=2)
    assert tts_config(f"coqui:{folder}") == TtsConfig(backend="coqui", voices=(str(folder),))
    bad = (("coqui", "joe", "needs the model folder"), (f"coqui:{folder}", "/v/x.onnx", "--voice"),
           ("piper:/a.onnx", "/b.onnx", "give the Piper voice once"), ("espeak", "joe", "use piper"))
    for flag, voice, says in bad:
        with pytest.raises(ValueError) as err:
            tts_config(flag, voice=voice)
        assert says in str(err.value), str(err.value)


def test_serve_with_a_bad_coqui_folder_exits_2_with_one_line(tmp_path):
    """The real command line: no traceback, one line, exit status 2, before any model loads."""
    _write_config(tmp_path / "xtts", {"model": "xtts"})
    for arg in (f"coqui:{tmp_path / 'nothing'}", f"coqui:{tmp_path / 'xtts'}"):
        r = subprocess.run([sys.executable, "-m", "cli", "serve", "--tts", arg], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("voxpipe: bad configuration:") and "Traceback" not in r.stderr


@pytest.mark.slow  # loads the Piper voice and the random VITS
def test_default_config_loads_piper_and_the_flag_loads_coqui(vits_dir):
    from cli.main import build_parser
    from cli.serve import serve_config
    from pipeline.engines import load_stage
    from pipeline.tts.coqui import CoquiTtsEngine
    from pipeline.tts.engine import TtsEngine

    default = load_stage(serve_config(build_parser().parse_args(["serve"])), "tts")
    assert type(default) is TtsEngine
    args = build_parser().parse_args(["serve", "--tts", f"coqui:{vits_dir}", "--tts-threads", "1"])
    coqui = load_stage(serve_config(args), "tts")
    assert isinstance(coqui, CoquiTtsEngine) and coqui.sample_rate == 22050
    speech = coqui.synthesize("Hello there, how are you today?")
    assert speech.audio.dtype == np.float32 and speech.audio.ndim == 1 and speech.sample_rate == 22050
    assert 0.5 < len(speech.audio) / 22050 < 10 and np.abs(speech.audio).max() <= 1.0
    assert len(coqui.synthesize("🙂").audio) == 0  # nothing speakable: no samples


@pytest.fixture(scope="module")
def coqui_server(vits_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("coqui-server") / "serve.log"
    with running_server(log, "--tts", f"coqui:{vits_dir}", "--slo-ms", "60000") as (port, proc):
        yield {"url": f"ws://127.0.0.1:{port}/ws", "log": log}


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def clip16k(audio_dir, name) -> np.ndarray:
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, 16000)


def expected_samples(vits_dir, deltas: list[str], voice: str | None = None) -> int:
    """Samples the reply's phrases make at OUT_RATE: the deltas re-chunked as the server
    chunks them, each phrase synthesized by the same model with ``voice`` (None: the default;
    the random VITS's lengths depend on the text and speaker only) and resampled like the
    session does."""
    from pipeline.tts.coqui import load_coqui_engine

    engine = load_coqui_engine(TtsConfig(backend="coqui", voices=(str(vits_dir),)))
    chunker = SentenceChunker()
    phrases = [p for d in deltas for p in chunker.push(d)] + chunker.flush()
    total = 0
    for phrase in phrases:
        if speakable(phrase):
            speech = engine.synthesize(phrase, voice)
            total += len(resample(speech.audio, speech.sample_rate, OUT_RATE)) if len(speech.audio) else 0
    return total


@pytest.mark.slow
async def test_spoken_turn_is_answered_in_the_coqui_voice_at_the_session_rate(coqui_server, audio_dir, vits_dir):
    async with Client(coqui_server["url"]) as c:
        started = await c.start(sample_rate=16000, output_sample_rate=OUT_RATE)
        assert started["output"]["sample_rate"] == OUT_RATE
        done = await c.turn(pcm16(clip16k(audio_dir, CLIP)))
    assert done["type"] == "response.done", c.conv.events
    assert not done["text_only"] and done["text"].strip(), done
    rid = done["response_id"]
    audio = c.conv.reply_audio(rid)
    deltas = [e["delta"] for e in c.conv.of("response.text.delta") if e["response_id"] == rid]
    want = await asyncio.to_thread(expected_samples, vits_dir, deltas)
    # at the session's rate: the model's 22050 Hz resampled, sample for sample
    assert want > OUT_RATE // 2 and abs(len(audio) - want) <= 4, (len(audio), want)
    assert abs(done["audio_s"] - len(audio) / OUT_RATE) < 0.01
    assert float(np.sqrt(np.mean(audio**2))) > 0.001, "reply audio is silent"
    assert 0 < done["timings_ms"]["tts_rtf"] and done["timings_ms"]["first_audio"] >= 0
    assert "Coqui vits loaded" in coqui_server["log"].read_text()


@pytest.mark.slow
async def test_barge_in_cancels_a_coqui_reply(coqui_server, audio_dir):
    speech = clip16k(audio_dir, BARGE_CLIP)
    async with Client(coqui_server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=OUT_RATE)
        await c.ws.send(pcm16(np.zeros(16000, np.float32)))
        await c.send_json({"type": "text.input", "text": LONG})
        rid = (await c.wait_for("response.started"))["response_id"]
        await c.wait_until(lambda: c.conv.audio.get(rid), what="the reply's first audio")
        for x in (speech, np.zeros(16000, np.float32)):  # the user talks over the reply, in real time
            for i in range(0, len(x), 1600):
                await c.ws.send(pcm16(x[i : i + 1600]))
                await asyncio.sleep(0.1)
        end = await c.wait_for(lambda e: e["type"] in ("response.cancelled", "response.done")
                               and e["response_id"] == rid)
        assert end["type"] == "response.cancelled" and end["reason"] == "barge_in", end
        nxt = await c.wait_for(lambda e: e["type"] == "response.started" and e["response_id"] > rid)
        await c.wait_for(lambda e: e["type"] == "response.done" and e["response_id"] == nxt["response_id"])
        assert c.conv.audio_after_event(rid, end) == 0, "audio of the cancelled reply after response.cancelled"
        assert len(c.conv.reply_audio(nxt["response_id"])) > 0


# --- multi-speaker and multilingual models: each speaker (in each language) is a voice ---

SPEAKERS = ["alice", "bob"]
SAME_TEXT = "Hello there, how are you today?"


def test_a_folder_names_its_speakers_and_languages_without_loading(tmp_path):
    """Names in id order from a ``{name: id}`` file — relative to the folder, or a trainer's
    path elsewhere found by its file name, as Coqui's model manager does — or from the
    config's own lists; one speaker or one language is no choice."""
    rel = _named(_write_config(tmp_path / "rel", _vits({"use_speaker_embedding": True,
                                                        "speakers_file": "speakers.json"})),
                 "speakers.json", {"bob": 1, "alice": 0, "carol": 2})
    assert check_model_folder(rel).speakers == ("alice", "bob", "carol") and check_model_folder(rel).languages == ()
    moved = _named(_named(_write_config(tmp_path / "moved", _vits({
        "use_speaker_embedding": True, "speakers_file": "/home/trainer/run/speaker_ids.json",
        "use_language_embedding": True, "language_ids_file": "/home/trainer/run/language_ids.json"})),
        "speaker_ids.json", {"p225": 0, "p226": 1}), "language_ids.json", {"en": 0, "fr-fr": 1, "pt-br": 2})
    found = check_model_folder(moved)
    assert found.speakers == ("p225", "p226") and found.languages == ("en", "fr-fr", "pt-br")
    listed = _write_config(tmp_path / "listed", _vits({"use_speaker_embedding": True}, speakers=["x", "y"]))
    assert check_model_folder(listed).speakers == ("x", "y")
    one = _named(_write_config(tmp_path / "one", _vits({"use_speaker_embedding": True,
                                                        "speakers_file": "speakers.json"})), "speakers.json", {"x": 0})
    assert check_model_folder(one).speakers == ()
    cfg = tts_config(f"coqui:{moved}")
    assert cfg.voices == (str(moved),)
    from pipeline.tts.choice import voice_languages

    assert voice_languages(cfg) == ["en", "fr", "pt"]  # a multilingual model makes ASR multilingual
    assert voice_languages(tts_config(f"coqui:{rel}")) == ["en"]


def seeded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` after ``torch.manual_seed(0)``: VITS samples its latent with
    noise, so two calls compare sample for sample only from the same seed (in this thread)."""
    import torch

    torch.manual_seed(0)
    return fn(*args, **kwargs)


@pytest.fixture(scope="session")
def speakers_dir(tmp_path_factory):
    """A random tiny multi-speaker VITS (alice, bob: speakers.json + use_speaker_embedding)."""
    from bench.make_random_vits import write_random_vits

    return write_random_vits(tmp_path_factory.mktemp("multi") / "duo", speakers=SPEAKERS)


@pytest.mark.slow  # builds and loads a random multi-speaker VITS
def test_each_speaker_is_a_voice_and_the_choice_reaches_the_model(speakers_dir):
    from pipeline.tts.catalogue import UnknownVoice
    from pipeline.tts.coqui import load_coqui_engine

    engine = load_coqui_engine(tts_config(f"coqui:{speakers_dir}"))
    assert engine.catalogue.as_json() == {"object": "list", "default": "duo/alice", "data": [
        {"name": "duo/alice", "language": "en", "backend": "coqui", "sample_rate": 22050},
        {"name": "duo/bob", "language": "en", "backend": "coqui", "sample_rate": 22050}]}
    alice, bob = (seeded(engine.synthesize, SAME_TEXT, f"duo/{s}") for s in SPEAKERS)
    assert (alice.voice, bob.voice) == ("duo/alice", "duo/bob")
    assert engine.synthesize(SAME_TEXT).voice == "duo/alice"  # the first speaker is the default
    for speech in (alice, bob):
        assert speech.audio.dtype == np.float32 and speech.audio.ndim == 1 and len(speech.audio) > 22050 // 2
    # the same noise, another speaker: other samples (and another length: durations are per speaker)
    n = min(len(alice.audio), len(bob.audio))
    assert len(alice.audio) != len(bob.audio) and np.abs(alice.audio[:n] - bob.audio[:n]).max() > 0.01
    # sample for sample what the model says for that speaker name, given the same noise
    direct = seeded(engine.model.synthesize, SAME_TEXT, speaker="bob")["wav"]
    np.testing.assert_array_equal(bob.audio, np.clip(np.asarray(direct, np.float32).reshape(-1), -1, 1))
    np.testing.assert_array_equal(seeded(engine.synthesize, SAME_TEXT, "duo/bob").audio, bob.audio)
    with pytest.raises(UnknownVoice) as err:
        engine.synthesize(SAME_TEXT, "duo/carol")
    assert str(err.value) == "unknown voice 'duo/carol'; available: duo/alice (en), duo/bob (en)"


@pytest.mark.slow  # builds and loads a random multi-speaker, multilingual VITS
def test_a_multilingual_model_gives_a_voice_per_speaker_and_language(tmp_path):
    from bench.make_random_vits import write_random_vits
    from pipeline.tts.coqui import load_coqui_engine

    folder = write_random_vits(tmp_path / "poly", speakers=SPEAKERS, languages=["en", "de-de"])
    engine = load_coqui_engine(tts_config(f"coqui:{folder}"))
    assert engine.catalogue.names() == ("poly/alice/en (en), poly/alice/de-de (de), "
                                        "poly/bob/en (en), poly/bob/de-de (de)")
    german = engine.catalogue.for_language("de")  # a German turn picks the first German voice
    assert german is not None and german.name == "poly/alice/de-de"
    assert engine.catalogue.choose("poly/bob/en", "de").name == "poly/bob/en"  # a chosen voice stays
    from pipeline.tts.normalize import verbalize

    words = speakable(verbalize("Es kostet 3 Euro.", "de"))
    assert "drei" in words, words  # normalised in the voice's language
    en, de = (seeded(engine.synthesize, "Es kostet 3 Euro.", v).audio for v in ("poly/alice/en", "poly/alice/de-de"))
    direct = seeded(engine.model.synthesize, words, speaker="alice", language="de-de")["wav"]
    np.testing.assert_array_equal(de, np.clip(np.asarray(direct, np.float32).reshape(-1), -1, 1))  # German words
    n = min(len(en), len(de))
    assert len(en) != len(de) or np.abs(en[:n] - de[:n]).max() > 0.01


@pytest.fixture(scope="module")
def speakers_server(speakers_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("coqui-speakers") / "serve.log"
    with running_server(log, "--tts", f"coqui:{speakers_dir}", "--slo-ms", "60000") as (port, proc):
        yield {"url": f"ws://127.0.0.1:{port}/ws", "port": port, "log": log}


@pytest.mark.slow
def test_get_v1_voices_lists_the_coqui_speakers(speakers_server):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{speakers_server['port']}/v1/voices", timeout=10) as r:
        body = json.load(r)
    assert body["default"] == "duo/alice" and [(v["name"], v["backend"]) for v in body["data"]] == [
        ("duo/alice", "coqui"), ("duo/bob", "coqui")]


@pytest.mark.slow
async def test_a_session_picks_a_coqui_speaker_and_the_model_speaks_with_it(speakers_server, speakers_dir):
    from tests.wsclient import CONTROL_DEADLINE_S, MODEL_DEADLINE_S

    async with Client(speakers_server["url"]) as c:
        await c.send_json({"type": "session.start", "voice": "duo/carol"})
        err = await c.wait_for("error", CONTROL_DEADLINE_S)
        assert err["code"] == "bad_event" and not err["fatal"]
        assert "unknown voice 'duo/carol'; available: duo/alice (en), duo/bob (en)" in err["message"]
        started = await c.start(output_sample_rate=OUT_RATE, voice="duo/bob")
        assert started["voice"] == "duo/bob"
        await c.send_json({"type": "text.input", "text": "Say hello."})
        done = await c.wait_for("response.done", MODEL_DEADLINE_S)
    rid = done["response_id"]
    assert c.conv.of("response.started")[-1]["voice"] == done["voice"] == "duo/bob"
    audio = c.conv.reply_audio(rid)
    deltas = [e["delta"] for e in c.conv.of("response.text.delta") if e["response_id"] == rid]
    bob = await asyncio.to_thread(expected_samples, speakers_dir, deltas, "duo/bob")
    alice = await asyncio.to_thread(expected_samples, speakers_dir, deltas, "duo/alice")
    # bob's phrases, sample for sample (at the session's rate); alice's differ in length
    assert bob > OUT_RATE // 2 and abs(len(audio) - bob) <= 4, (len(audio), bob, alice)
    assert abs(alice - bob) > 4, (alice, bob)
