"""Replies that answer instead of parroting (issue 16, item 3): the parrot metric, the prompt
set, the few-shot framing in the session's messages, and the default model under the server's
real framing."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.parrot import HEAD_WORDS, lcs_len, overlap, parrot_rate, parrots, words
from bench.prompts import KINDS, load_prompts
from pipeline.config import LlmConfig
from pipeline.session.history import ChatHistory

WORD = st.text(alphabet="abcxyz", min_size=1, max_size=3)


@pytest.mark.parametrize(("user", "reply", "want"), [
    ("We adopted a puppy last weekend.", "We adopted a puppy last weekend.", True),
    ("My grandmother turns ninety on Sunday.", "She turns ninety on Sunday.", True),  # 4 of 5
    ("Captain Freer says that the scenery is delightful.", 'Captain Freer says, "The scenery is delightful."', True),
    ("Go forward 10 meters.", "Okay, let's go forward 10 meters!", True),  # 4 of 6 = 0.67
    ("I finally finished painting the kitchen.", "I'm glad you finished painting the kitchen.", False),  # 4 of 7
    ("I just got back from a trip to Lisbon.", "That's great! Did you have a good time?", False),
    ("What is the capital of France?", "Paris.", False),
    ("Anything at all", "", False),  # empty: counted apart, not a parrot
    ("THE SUNSET WAS BEAUTIFUL", "the sunset — was... beautiful?!", True),  # case and punctuation ignored
])
def test_parrots_table(user, reply, want):
    assert parrots(user, reply) is want


def test_only_the_first_twelve_words_count():
    user = "one two three four five six seven eight nine ten eleven twelve"
    assert overlap(user, "zz " * 5 + user) == 7 / HEAD_WORDS  # the echo starts late: 7 of the first 12
    assert not parrots(user, "zz " * 5 + user)
    assert parrots(user, user + " and then something else entirely new here")


def test_words_normalise_case_punctuation_apostrophes_and_width():
    assert words("I'm HERE — don\u2019t 'quote' me, ok? Été ＡＢ") == [
        "i'm", "here", "don't", "quote", "me", "ok", "été", "ab"]


@given(st.lists(WORD, max_size=20), st.lists(WORD, max_size=20))
def test_overlap_is_a_fraction_and_lcs_is_symmetric(a, b):
    assert 0.0 <= overlap(" ".join(a), " ".join(b)) <= 1.0
    assert lcs_len(a, b) == lcs_len(b, a) <= min(len(a), len(b))


@given(st.lists(WORD, min_size=1, max_size=30))
def test_a_verbatim_echo_always_parrots_and_a_disjoint_reply_never(user):
    text = " ".join(user)
    assert overlap(text, text) == 1.0
    assert overlap(text, " ".join(w.upper() + "q" for w in user)) == 0.0  # no shared word


@given(st.lists(WORD, min_size=1, max_size=12), st.lists(WORD, min_size=1, max_size=12))
def test_lcs_of_a_subsequence_is_its_length(a, extra):
    merged = [w for pair in zip(a, extra) for w in pair] + a[len(extra):] + extra[len(a):]  # a interleaved
    assert lcs_len(a, merged) == len(a)


def test_parrot_rate():
    assert parrot_rate([]) == 0.0
    assert parrot_rate([("a b c", "a b c"), ("a b c", "x y z")]) == 0.5


def test_the_prompt_set_has_forty_prompts_of_each_kind_and_the_clips():
    prompts = load_prompts()
    assert len(prompts) >= 40 and {p.kind for p in prompts} == set(KINDS)
    assert len(load_prompts(kinds=("clip",))) == 8
    assert any("ask not what your country" in p.text for p in prompts)


def test_a_bad_prompt_line_names_its_line(tmp_path):
    f = tmp_path / "p.tsv"
    f.write_text("kind\ttext\nstatement\tfine\nremark\toops\n")
    with pytest.raises(ValueError, match=r"p\.tsv:3"):
        load_prompts(f)


def test_the_examples_follow_the_system_prompt_and_stay_when_turns_slide():
    cfg = LlmConfig()
    h = ChatHistory("sys", examples=cfg.examples)
    count = lambda msgs: sum(len(m["content"]) for m in msgs)  # noqa: E731 - characters as "tokens"
    shots = [m["content"] for m in h.messages("hi")[1:-1]]
    assert shots == [x for pair in cfg.examples for x in pair]
    for i in range(30):
        h.add_turn(f"question {i} " * 5, f"answer {i} " * 5)
    msgs = h.prompt("last", count, budget=count(h.messages("last", [])) + 200)
    assert [m["content"] for m in msgs[1:1 + len(shots)]] == shots and len(h.turns) < 30
    # the system prompt and the user text alone are over the budget: the examples go first
    msgs = h.prompt("x" * 400, count, budget=300)
    assert count(msgs) <= 300 and len(msgs) == 2


def _ask_all(engine, texts: list[str]) -> list[str]:
    """Greedy replies through the real engine, with the messages a new session builds."""
    from pipeline.llm.types import GenRequest

    cfg = LlmConfig()

    async def one(text: str) -> str:
        history = ChatHistory(cfg.system_prompt, examples=cfg.examples)
        msgs = history.prompt(text, engine.count_tokens, cfg.max_context_tokens - cfg.max_new_tokens)
        stream = engine.submit(GenRequest(messages=msgs, max_new_tokens=cfg.max_new_tokens))
        return "".join([d async for d in stream])

    async def run() -> list[str]:
        return list(await asyncio.gather(*(one(t) for t in texts)))

    return asyncio.run(run())


# statements Qwen 0.5B echoed verbatim with the system prompt alone (bench replies, framing "before")
ECHOED = ["We adopted a puppy last weekend.", "I started learning the piano last month.",
          "The train was forty minutes late today.", "The coffee machine at work is broken again."]


@pytest.mark.slow
def test_the_default_model_answers_statements_and_clips_without_parroting():
    """12 clip-style turns (the 8 clip transcripts + 4 statements): the full set measured 2 of
    46 parroting with the server's framing (1 of its 32 statements and clips), 23 of 46 with the
    system prompt alone; at most 2 of these 12 may parrot. A direct question is still answered."""
    from pipeline.llm.engine import LlmEngine
    from pipeline.llm.loader import load_llm

    cfg = LlmConfig()
    engine = LlmEngine(load_llm(cfg.model, device=cfg.device), LlmConfig())  # what the server runs
    engine.start()
    try:
        texts = [p.text for p in load_prompts(kinds=("clip",))] + ECHOED + ["What is the capital of France?"]
        replies = _ask_all(engine, texts)
    finally:
        engine.stop()
    pairs = list(zip(texts[:-1], replies[:-1]))
    parroted = [(u, r) for u, r in pairs if parrots(u, r)]
    assert len(parroted) <= 2, parroted
    assert all(words(r) for r in replies), replies
    assert "paris" in replies[-1].lower(), replies[-1]
