"""Hypothesis strategies for tests/test_fuzz_server.py: random client frames for a real
voxpipe server.

A generated sequence is a list of *actions*, small frozen dataclasses whose ``repr`` is a
compact, exact recipe for the frame (a 100,000-character frame is shown as its kind and
size, an audio frame as its kind, length and seed), so a failing example prints a
reproduction that fits on a screen. Each action turns into WebSocket frames only when it
is sent (:meth:`Action.payload`).

What the sequences hold (docs/PROTOCOL.md is the reference):

- every client event type, valid and invalid: ``session.start`` with random, valid and
  invalid formats (re-declared mid-stream), ``input.end``, ``text.input`` (rare and short:
  the real LLM answers it), ``response.cancel``, ``session.end``;
- random JSON of any shape: non-object JSON, unknown or missing ``type``, wrong field
  types, ``NaN``/``Infinity`` literals, lone surrogates, ints of more than 4,300 digits,
  huge strings, nesting 100,000 deep;
- binary frames of 0–70,000 bytes: random bytes, PCM16 silence and noise, f32 noise with
  NaN and inf, and slices of a real speech clip encoded in the format the session declared
  last; whole utterances (speech then silence, so turns end and replies start);
- text frames that are not valid UTF-8 (sent as raw bytes in a text frame: the server
  must close with 1007), text messages split into fragments (inside a UTF-8 sequence
  too), and — rarely — a text frame over the 4 MiB message limit (close 1009);
- bursts of messages sent back to back, past the client's budget (the server throttles
  them and says ``rate_limited``);
- short pauses, so that audio, turns and replies interleave with the frames.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from pipeline.config import ServerConfig

MAX_AUDIO_FRAME = 70_000
"""Largest binary frame the fuzzer sends (bytes)."""

MAX_MESSAGE_BYTES = ServerConfig().max_message_bytes
"""The server's WebSocket message limit (4 MiB by default): a larger message closes with 1009."""

CLIENT_TYPES = ("session.start", "input.end", "text.input", "response.cancel", "session.end")


# ---- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """One text frame, as given."""

    text: str

    def payload(self, ctx: AudioContext) -> str:
        return self.text

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 300 else self.text[:300] + f"...<{len(self.text)} chars>"
        return f"Text({shown!r})"


BIG_KINDS = (
    "huge_int_sample_rate",  # {"type":"session.start","sample_rate":999...}
    "huge_neg_int",  # -999... (bare JSON)
    "huge_int_in_list",  # {"type":"input.end","x":[1,999...]}
    "huge_float",  # 1e999-ish: a float with n digits (inf)
    "huge_text_input",  # text.input with n characters (8000 is the limit)
    "huge_system_prompt",  # session.start with a system prompt of n characters
    "huge_type",  # {"type":"xxxx..."}
    "huge_garbage",  # n characters that are not JSON
    "huge_unicode",  # a text.input of n multi-byte characters
    "deep_list_open",  # [[[[ ... (n, unclosed)
    "deep_list",  # [[[ ... ]]] (n deep)
    "deep_object",  # {"a":{"a": ... }} (n deep)
    "deep_type",  # {"type":[[[...]]]} (n deep)
    "deep_field",  # {"type":"session.start","system_prompt":[[[...]]]} (n deep)
)


@dataclass(frozen=True)
class Big:
    """A large text frame built at send time: ``kind`` (:data:`BIG_KINDS`) of size ``n``."""

    kind: str
    n: int

    def payload(self, ctx: AudioContext) -> str:
        n, k = self.n, self.kind
        if k == "huge_int_sample_rate":
            return '{"type": "session.start", "sample_rate": ' + "9" * n + "}"
        if k == "huge_neg_int":
            return "-" + "1" * n
        if k == "huge_int_in_list":
            return '{"type": "input.end", "x": [1, ' + "7" * n + "]}"
        if k == "huge_float":
            return '{"type": "session.start", "sample_rate": ' + "3" * n + ".5e3}"
        if k == "huge_text_input":
            return json.dumps({"type": "text.input", "text": "word " * (n // 5) + "x" * (n % 5)})
        if k == "huge_system_prompt":
            return json.dumps({"type": "session.start", "system_prompt": "p" * n})
        if k == "huge_type":
            return json.dumps({"type": "t" * n})
        if k == "huge_garbage":
            return ("garbage{" * (n // 8 + 1))[:n]
        if k == "huge_unicode":
            return json.dumps({"type": "text.input", "text": "é€😀" * (n // 3 + 1)}, ensure_ascii=False)
        if k == "deep_list_open":
            return "[" * n
        if k == "deep_list":
            return "[" * n + "]" * n
        if k == "deep_object":
            return '{"a":' * n + "1" + "}" * n
        if k == "deep_type":
            return '{"type": ' + "[" * n + "]" * n + "}"
        if k == "deep_field":
            return '{"type": "session.start", "system_prompt": ' + "[" * n + "]" * n + "}"
        raise ValueError(k)


@dataclass(frozen=True)
class Oversize:
    """A text frame ``extra`` bytes over the server's message limit: close 1009."""

    extra: int

    def payload(self, ctx: AudioContext) -> str:
        return "x" * (MAX_MESSAGE_BYTES + self.extra)


@dataclass(frozen=True)
class RawText:
    """Bytes sent as a text frame (``ws.send(data, text=True)``); when not valid UTF-8 the
    server must fail the connection with 1007 (RFC 6455 §8.1)."""

    data: bytes

    def payload(self, ctx: AudioContext) -> bytes:
        return self.data


@dataclass(frozen=True)
class Fragmented:
    """One text message sent in fragments, cut at these byte offsets of its UTF-8 (a cut
    may fall inside a multi-byte character: only the whole message must be valid)."""

    text: str
    cuts: tuple[int, ...]

    def fragments(self) -> list[bytes]:
        return split_at(self.text.encode("utf-8", "surrogatepass"), self.cuts)


def split_at(data: bytes, cuts: tuple[int, ...]) -> list[bytes]:
    """``data`` cut at these offsets (clamped; empty pieces dropped, at least one piece)."""
    points = sorted({min(max(c, 0), len(data)) for c in cuts} | {0, len(data)})
    parts = [data[a:b] for a, b in zip(points, points[1:])]
    return [p for p in parts if p] or [b""]


@dataclass(frozen=True)
class FragmentedAudio:
    """One binary message (an :class:`Audio` frame) sent in fragments cut at these offsets."""

    audio: Audio
    cuts: tuple[int, ...]


AUDIO_KINDS = ("random", "silence", "noise", "speech", "ones", "f32_noise", "f32_wild")


@dataclass(frozen=True)
class Audio:
    """A binary frame: ``kind`` (:data:`AUDIO_KINDS`), about ``n`` bytes, ``seed`` (the
    random bytes', the noise's, or the speech clip's start offset in samples)."""

    kind: str
    n: int
    seed: int

    def payload(self, ctx: AudioContext) -> bytes:
        n, rng = self.n, random.Random(self.seed)
        if self.kind == "random":
            return rng.randbytes(n)
        if self.kind == "silence":
            return bytes(n)
        if self.kind == "ones":
            return b"\xff" * n
        if self.kind == "noise":  # PCM16 white noise, any amplitude
            amp = rng.choice([30, 1000, 8000, 32767])
            x = np.random.default_rng(self.seed).integers(-amp, amp + 1, n // 2, dtype=np.int64)
            return x.astype("<i2").tobytes() + rng.randbytes(n % 2)
        if self.kind == "f32_noise":  # f32 in [-1, 1]
            x = np.random.default_rng(self.seed).uniform(-1, 1, n // 4).astype("<f4")
            return x.tobytes() + rng.randbytes(n % 4)
        if self.kind == "f32_wild":  # f32 with NaN, inf and huge values
            x = np.random.default_rng(self.seed).uniform(-1, 1, n // 4).astype("<f4")
            if len(x):
                x[:: max(1, len(x) // 7)] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -3.5])
            return x.tobytes()
        if self.kind == "speech":
            return ctx.speech(self.seed, n)
        raise ValueError(self.kind)


@dataclass(frozen=True)
class Utterance:
    """A spoken turn as a client sends it: ``ms`` of the speech clip from ``offset`` (16 kHz
    samples) then ``silence_ms`` of silence, in the declared format, in frames of at most
    ``frame`` bytes, as fast as the socket takes them; then nothing for ``then_ms`` (the
    turn ends, its transcript and reply come)."""

    offset: int
    ms: int
    silence_ms: int
    frame: int
    then_ms: int

    def frames(self, ctx: AudioContext) -> list[bytes]:
        x = ctx.clip16k(self.offset, self.ms * 16)
        data = ctx.encode(np.concatenate([x, np.zeros(self.silence_ms * 16, np.float32)]))
        step = max(1, min(self.frame, MAX_AUDIO_FRAME))
        return [data[i : i + step] for i in range(0, len(data), step)]


BURST_TEXTS = ('{"type": "response.cancel"}', '{"type": "input.end"}', "{bad", '{"type": "nope"}',
               '{"type": "text.input", "text": " "}', "[]")
"""What a text :class:`Burst` cycles through: cheap frames that start no reply."""


@dataclass(frozen=True)
class Burst:
    """``count`` messages back to back, as fast as the socket takes them: text frames
    cycling through :data:`BURST_TEXTS`, or audio frames of ``frame`` bytes (silence or
    noise in the declared format). Past the client's budget (100 text frames, 60 s of
    audio) the server reads them at its rate (``rate_limited``)."""

    kind: str  # "text" | "silence" | "noise"
    count: int
    frame: int

    def frames(self) -> list[str | bytes]:
        if self.kind == "text":
            return [BURST_TEXTS[i % len(BURST_TEXTS)] for i in range(self.count)]
        if self.kind == "silence":
            return [bytes(self.frame)] * self.count
        noise = np.random.default_rng(self.count).integers(-3000, 3000, self.frame // 2 + 1).astype("<i2").tobytes()
        return [noise[: self.frame]] * self.count


@dataclass(frozen=True)
class Pause:
    """Send nothing for ``ms`` milliseconds (audio keeps flowing through the pipeline)."""

    ms: int


Action = Text | Big | Oversize | RawText | Fragmented | Audio | FragmentedAudio | Utterance | Burst | Pause


@dataclass
class AudioContext:
    """What :class:`Audio` ``speech`` frames need: the clip (16 kHz mono float32) and the
    format the session declared last (the runner updates ``fmt``)."""

    clip: np.ndarray
    fmt: tuple[int, str, int] = (16000, "pcm16", 1)  # sample_rate, format, channels

    def clip16k(self, offset: int, n: int) -> np.ndarray:
        """``n`` samples of the clip from ``offset`` (wrapping around its end)."""
        start = offset % max(1, len(self.clip))
        x = np.concatenate([self.clip[start:], self.clip[:start]])
        return np.tile(x, n // max(1, len(x)) + 1)[:n]

    def encode(self, x: np.ndarray, max_bytes: int | None = None) -> bytes:
        """16 kHz mono ``x`` resampled and encoded as declared (cut to ``max_bytes``)."""
        from audio.pcm import resample

        rate, fmt, channels = self.fmt
        if rate != 16000 and len(x):
            x = resample(x, 16000, rate)
        if max_bytes is not None:
            x = x[: max_bytes // ((2 if fmt == "pcm16" else 4) * channels)]
        if channels == 2:
            x = np.stack([x, x * 0.8], axis=1).reshape(-1)
        if fmt == "pcm16":
            return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
        return x.astype("<f4").tobytes()

    def speech(self, offset: int, n: int) -> bytes:
        """About ``n`` bytes (never more than :data:`MAX_AUDIO_FRAME`) of the clip from
        ``offset`` (16 kHz samples), resampled and encoded as declared."""
        rate, fmt, channels = self.fmt
        n = min(n, MAX_AUDIO_FRAME)
        samples = n // ((2 if fmt == "pcm16" else 4) * channels)
        return self.encode(self.clip16k(offset, int(np.ceil(samples * 16000 / rate)) + 1), n)


# ---- strategies ---------------------------------------------------------------------------


def weighted(*options: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of ``options``, picked with the given integer weights (the first shrinks best)."""
    table = [s for w, s in options for _ in range(w)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["", "\ud800", "\x00", "16000", "pcm16", "session.start"]),
    st.integers(min_value=-(10**40), max_value=10**40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def dumps(obj) -> str:
    """JSON with NaN/Infinity literals kept (Python's json writes them; the server's
    ``json.loads`` accepts them) and non-ASCII escaped or not at random upstream."""
    return json.dumps(obj, allow_nan=True)


RATES_VALID = st.one_of(st.sampled_from([8000, 11025, 16000, 22050, 24000, 44100, 48000]), st.integers(8000, 48000))
RATES_INVALID = st.one_of(
    st.sampled_from([0, -16000, 7999, 48001, 96000, 2**31, 2**63, 10**30]),
    st.sampled_from(["16000", 16000.0, 16000.5, True, None, [16000], {"hz": 16000}, float("nan"), float("inf")]),
)


def session_start(valid: bool | None = None) -> st.SearchStrategy[dict]:
    """``session.start`` with random fields: ``valid=True`` only valid values, ``False``
    mostly invalid ones, None a mix."""
    rate_ok = RATES_VALID
    fmt_ok = st.sampled_from(["pcm16", "f32"])
    ch_ok = st.sampled_from([1, 2])
    bad = {
        "sample_rate": RATES_INVALID,
        "format": st.sampled_from(["mp3", "PCM16", "", "pcm32", 16, None, ["pcm16"]]),
        "channels": st.sampled_from([0, 3, -1, "1", 1.0, True, None, 2**70]),
        "output_sample_rate": RATES_INVALID,
        "system_prompt": st.sampled_from([5, ["x"], {"a": 1}, True]),
        "language": st.sampled_from(["", "e", "english-us-x", 5, ["en"]]),
        "vad": st.sampled_from(["yes", 1, 0, None, "false"]),
    }
    good = {
        "sample_rate": rate_ok,
        "format": fmt_ok,
        "channels": ch_ok,
        "output_sample_rate": RATES_VALID,
        "system_prompt": st.one_of(st.none(), st.sampled_from(["Be brief.", "Answer in one word.", "\u00e9t\u00e9"])),
        "language": st.one_of(st.none(), st.sampled_from(["en", "de", "xx", "zh-Hans"])),
        "vad": st.booleans(),
    }
    optional = {"system_prompt", "language", "vad", "output_sample_rate"}

    @st.composite
    def build(draw) -> dict:
        out: dict = {"type": "session.start"}
        for name in good:
            if name in optional and not draw(st.booleans()):
                continue
            if valid is True:
                use_bad = False
            elif valid is False:
                use_bad = draw(st.integers(0, 2)) == 0
            else:
                use_bad = draw(st.integers(0, 5)) == 0
            if name not in optional or draw(st.booleans()) or use_bad:
                out[name] = draw(bad[name] if use_bad else good[name])
        if draw(st.integers(0, 4)) == 0:  # unknown extra fields are ignored
            out[draw(st.sampled_from(["model", "x", "Type", "sampleRate"]))] = draw(json_values)
        return out

    return build()


SHORT_TEXTS = st.one_of(
    st.sampled_from(["hi", "Say ok.", "Yes or no?", "ok", "Name a color.", " ", "", "\t\n", "\u3000"]),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12),
)


def valid_events() -> st.SearchStrategy[Text]:
    """Events of every client type (text.input rare; each possibly with extra fields)."""
    extra = st.one_of(st.just({}), st.dictionaries(st.sampled_from(["x", "id", "text", "response_id"]),
                                                   json_values, max_size=2))
    simple = st.builds(lambda t, x: {**x, "type": t},
                       st.sampled_from(["input.end", "response.cancel", "input.end", "session.end"]), extra)
    text_input = st.builds(lambda t: {"type": "text.input", "text": t}, SHORT_TEXTS)
    return weighted(
        (8, session_start(valid=True)),
        (4, session_start(valid=None)),
        (3, session_start(valid=False)),
        (8, simple.filter(lambda e: e["type"] != "session.end")),
        (1, simple),  # session.end (and friends)
        (1, text_input),
    ).map(lambda e: Text(dumps(e)))


def wrong_events() -> st.SearchStrategy[Text]:
    """Random JSON: non-objects, unknown/missing ``type``, client types with wrong fields,
    NaN/Infinity literals, lone surrogates, odd spellings."""
    fixed = st.sampled_from([
        "", " ", "hello", "{bad", "{", "}", "[]", "[", "123", "-0", "1e999", "null", "true", '"session.start"',
        "NaN", "Infinity", "-Infinity", '{"type": NaN}', '{"type": Infinity}',
        '{"type": "session.start", "sample_rate": NaN}', '{"type": "session.start", "sample_rate": Infinity}',
        '{"type": "session.start", "sample_rate": -Infinity}', '{"type": "session.start", "channels": 1e999}',
        '{"type": "session.start", "sample_rate": 16000.0}', '{"type": "session.start", "sample_rate": 1.6e4}',
        '{"type": null}', '{"type": 1}', '{"type": ["input.end"]}', '{"type": {"a": 1}}', '{"TYPE": "input.end"}',
        '{"type": "input.end "}', '{"type": "Input.End"}', '{"type": "input.end\\u0000"}',
        '{"type": "text.input"}', '{"type": "text.input", "text": 5}', '{"type": "text.input", "text": null}',
        '{"type": "text.input", "text": "\\ud800"}', '{"type": "text.input", "text": "\\udfff\\ud800 hi"}',
        '{"type": "text.input", "text": ["hi"]}', '{"type": "text.input", "text": "hi", "text": ""}',
        '{"type": "session.start", "language": "\\ud83d"}', '{"type": "session.start", "system_prompt": "\\ud800"}',
        '{"type": "input.end", "type": "no.such"}', '{"type": "no.such.event"}', '{"type": "error"}',
        '{"type": "session.started"}', '{"type": "response.done"}', '{"type": ""}',
        '\ufeff{"type": "input.end"}', '{"type": "input.end"} trailing', '{"type": "input.end"}{"type": "input.end"}',
        '\x00', '{"type": "session.start", "sample_rate": 16000', '{"type": "session.start",}',
        "{'type': 'input.end'}", '{"type": "response.cancel", "response_id": -1}',
    ])
    typed = st.builds(lambda t, k, v: {"type": t, k: v}, st.sampled_from(CLIENT_TYPES),
                      st.sampled_from(["sample_rate", "format", "channels", "text", "vad", "language", "x"]),
                      json_values)
    any_type = st.builds(lambda t, rest: {**rest, "type": t}, json_values,
                         st.dictionaries(st.text(max_size=6), json_values, max_size=3))
    return weighted(
        (4, fixed.map(Text)),
        (3, typed.map(lambda e: Text(dumps(e)))),
        (2, any_type.map(lambda e: Text(dumps(e)))),
        (2, json_values.map(lambda v: Text(dumps(v)))),
        (1, st.text(max_size=40).map(Text)),
    )


def big_frames() -> st.SearchStrategy[Big]:
    sizes = st.one_of(
        # 4300: Python's int digit limit; 8000: the text limit; ~980: where json.loads runs
        # out of stack inside the server
        st.sampled_from([4299, 4300, 4301, 5000, 7999, 8000, 8001, 960, 975, 978, 980, 990, 1000, 1200, 100_000]),
        st.integers(1, 200_000),
    )
    return st.builds(Big, st.sampled_from(BIG_KINDS), sizes)


INVALID_UTF8 = st.one_of(
    st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b'{"type": "input.end"}\xc3',
                     b'{"type": "text.input", "text": "\xe9"}', b"\x80\x80\x80", b"\xf0\x9f\x98"]),
    st.binary(min_size=1, max_size=64),
).filter(lambda b: not _is_utf8(b))


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def fragmented() -> st.SearchStrategy[Fragmented]:
    multibyte = json.dumps({"type": "text.input", "text": "h\u00e9\u20ac\U0001f600"}, ensure_ascii=False)
    texts = st.one_of(valid_events().map(lambda t: t.text), st.just(multibyte),
                      st.just('{"type": "session.start", "system_prompt": "\u00e9\u00e9\u00e9"}'))
    return st.builds(Fragmented, texts, st.lists(st.integers(0, 80), min_size=1, max_size=5).map(tuple))


def audio_frames() -> st.SearchStrategy[Audio]:
    lengths = st.one_of(
        st.sampled_from([0, 1, 2, 3, 4, 5, 7, 255, 256, 320, 321, 1024, 3200, 4095, 32000, 64000, MAX_AUDIO_FRAME]),
        st.integers(0, MAX_AUDIO_FRAME),
        st.integers(0, 4000),
    )
    return weighted(
        (3, st.builds(Audio, st.just("speech"), lengths, st.integers(0, 400_000))),
        (2, st.builds(Audio, st.just("random"), lengths, st.integers(0, 2**32))),
        (2, st.builds(Audio, st.just("silence"), lengths, st.just(0))),
        (2, st.builds(Audio, st.just("noise"), lengths, st.integers(0, 2**32))),
        (1, st.builds(Audio, st.sampled_from(["ones", "f32_noise", "f32_wild"]), lengths, st.integers(0, 2**32))),
    )


def bursts(flood: bool) -> st.SearchStrategy[Burst]:
    """Bursts of messages; ``flood``: up to 1,500 text frames or ~5 minutes of 16 kHz PCM16
    (far past the budget: the server reads them for a minute or more), else up to 160 text
    frames or 66 s of 8 kHz PCM16 (a few seconds of throttling at most)."""
    text_max, audio_bytes = (1500, 300 * 32000) if flood else (160, 66 * 16000)
    text = st.builds(Burst, st.just("text"), st.integers(1, text_max), st.just(0))
    audio = st.sampled_from([3200, 32000, MAX_AUDIO_FRAME]).flatmap(
        lambda frame: st.builds(Burst, st.sampled_from(["silence", "noise"]),
                                st.integers(1, max(1, audio_bytes // frame)), st.just(frame)))
    return st.one_of(text, audio)


def actions(flood: bool = False) -> st.SearchStrategy[Action]:
    """One action; invalid UTF-8 and oversize frames (which end the connection) are rare."""
    utterance = st.builds(Utterance, st.integers(0, 200_000), st.integers(300, 3000), st.integers(0, 1200),
                          st.sampled_from([3200, 6400, 32000, MAX_AUDIO_FRAME]), st.integers(0, 3000))
    return weighted(
        (10, audio_frames()),
        (3, utterance),
        (6, valid_events()),
        (5, wrong_events()),
        (2, big_frames()),
        (1, fragmented()),
        (1, st.builds(FragmentedAudio, audio_frames(), st.lists(st.integers(0, 8000), min_size=1, max_size=4)
                      .map(tuple))),
        (2, st.builds(Pause, st.integers(0, 2000))),  # lets turns end, transcripts and replies come
        (1, bursts(flood)),
        (1, st.one_of(st.builds(RawText, INVALID_UTF8), st.builds(Oversize, st.integers(1, 4096)),
                      st.builds(Pause, st.integers(0, 50)))),
    )


def sequences(max_size: int, flood: bool = False) -> st.SearchStrategy[list[Action]]:
    """A random sequence, often opened by a valid ``session.start`` (so that most audio
    reaches the pipeline instead of being answered ``no_session``); ``flood``: see
    :func:`bursts`."""
    opener = session_start(valid=True).map(lambda e: [Text(dumps(e))])
    body = st.lists(actions(flood), min_size=min(3, max_size), max_size=max_size)
    return st.tuples(weighted((1, st.just([])), (3, opener)), body).map(lambda t: t[0] + t[1])
