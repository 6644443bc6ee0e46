"""Chunker, speakable text, incremental detokenization, stop strings, history."""

import pytest

from pipeline.chunker import SentenceChunker, speakable
from pipeline.history import ChatHistory
from pipeline.llm import apply_stop


@pytest.mark.parametrize(
    "raw, spoken",
    [
        ("", ""), (" ", ""), (".", ""), ("…", ""), ("?!", ""), ("\n", ""), ("🙂", ""), ("—", ""),
        ("**bold** text", "bold text"), ("***x***", "x"), ("# Heading", "Heading"), ("- bullet", "bullet"),
        ("`code`", "code"), ("[link](http://example.com)", "link"), ("Nice 🙂 day", "Nice day"),
        ("| a | b |", "a, b"),
    ],
)
def test_speakable(raw, spoken):
    assert speakable(raw) == spoken


def chunks(text: str, step: int) -> list[str]:
    c = SentenceChunker()
    out = []
    for i in range(0, len(text), step):
        out += c.push(text[i : i + step])
    return out + c.flush()


TEXT = "Dr. Smith paid $19.99 at 9 a.m. today, e.g. for v1.2.3 of it. Pi is 3.14! Really? Yes, it is."


def test_sentences_split_not_inside_numbers_or_abbreviations():
    assert chunks(TEXT, len(TEXT)) == [
        "Dr. Smith paid $19.99 at 9 a.m. today, e.g. for v1.2.3 of it.",
        "Pi is 3.14! Really?",
        "Yes, it is.",
    ]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streaming_gives_the_same_phrases(step):
    assert chunks(TEXT, step) == chunks(TEXT, len(TEXT))


def test_apply_stop_across_deltas():
    text, delta, stopped = apply_stop("Hello <", "|end|> more", ["<|end|>"])
    assert stopped and text == "Hello " and delta == ""
    text, delta, stopped = apply_stop("Hi", " there", ["STOP"])
    assert not stopped and delta == " there"


def test_history_drops_oldest_turns_keeps_system():
    h = ChatHistory("sys")
    for i in range(10):
        h.add_turn(f"user {i} " + "w " * 20, f"assistant {i}")
    count = lambda msgs: sum(len(m["content"].split()) for m in msgs)  # noqa: E731
    msgs = h.prompt("new question", count, budget=80)
    assert msgs[0] == {"role": "system", "content": "sys"}
    assert msgs[-1]["content"] == "new question"
    assert count(msgs) <= 80
    assert "user 9" in msgs[-3]["content"]
