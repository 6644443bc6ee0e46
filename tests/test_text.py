"""Chunker, speakable text, incremental detokenization, stop strings, history."""

import pytest

from pipeline.llm.detok import StopStrings
from pipeline.session.history import ChatHistory
from pipeline.tts.chunker import SentenceChunker, speakable


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


CHUNK_TABLE = [
    # sentence ends; abbreviations, numbers, times and versions are not ends
    ("Dr. Smith paid $19.99 at 9 a.m. today. It was v1.2.3 of the app. Pi is 3.14! Really? Yes.",
     ["Dr. Smith paid $19.99 at 9 a.m. today.", "It was v1.2.3 of the app.", "Pi is 3.14! Really?", "Yes."]),
    ("My temperature is 98.6°F today. That is normal, e.g. for adults.",
     ["My temperature is 98.6°F today.", "That is normal, e.g. for adults."]),
    # first-phrase rule: an early clause boundary; later clauses need more length
    ("Sure, happy to help you with that, and here is the answer you wanted, in detail: it is 42.",
     ["Sure, happy to help you with that,", "and here is the answer you wanted, in detail: it is 42."]),
    # thousands separators and clock times are not clause boundaries
    ("It costs 1,000 dollars at 9:30 in the morning. Fine.",
     ["It costs 1,000 dollars at 9:30 in the morning.", "Fine."]),
    # URLs and e-mail addresses stay whole
    ("See https://example.com/a.b?x=1 for details. Or write to bob.smith@example.com today.",
     ["See https://example.com/a.b?x=1 for details.", "Or write to bob.smith@example.com today."]),
    # first-phrase word rule: no punctuation yet → cut after 5 words, at a plain word
    # (not after "the"/"of", a number or an abbreviation); later phrases wait for punctuation
    ("This is a classic idiom that means you should serve your country well.",
     ["This is a classic idiom", "that means you should serve your country well."]),
    ("It was one of the best days of the year for us.",
     ["It was one of the best", "days of the year for us."]),
    ("We met at 10 or 11 in Dr. Smith's office on Main Street today.",
     ["We met at 10 or 11 in Dr. Smith's", "office on Main Street today."]),
    # markdown lines and code fences
    ("Steps:\n- open the box\n- take it out\n```python\nprint(1)\nx = 2\n```\nDone now.",
     ["Steps:\n- open the box", "- take it out", "```python\nprint(1)\nx = 2\n```", "Done now."]),
]


@pytest.mark.parametrize("text, phrases", CHUNK_TABLE)
def test_chunker_table(text, phrases):
    assert chunks(text, len(text)) == phrases


@pytest.mark.parametrize("step", [1, 2, 3, 7])
@pytest.mark.parametrize("text", [t for t, _ in CHUNK_TABLE])
def test_streaming_gives_the_same_phrases(text, step):
    assert chunks(text, step) == chunks(text, len(text))


def test_code_fence_is_not_spoken():
    assert speakable("```python\nprint(1)\nx = 2\n```") == ""


def test_stop_string_across_deltas_is_never_emitted_in_part():
    s = StopStrings(["<|end|>"])
    assert s.feed("Hello <") == "Hello "  # "<" may begin the stop string: held back
    assert s.feed("|en") == "" and not s.stopped
    assert s.feed("d|> more") == "" and s.stopped and s.text == "Hello "
    assert s.flush() == ""


def test_held_back_tail_is_released_when_it_does_not_become_a_stop_string():
    s = StopStrings(["4. 4\n5", ""])
    out = s.feed("3\n4") + s.feed(". 4") + s.feed("\n")
    assert out == "3\n" and not s.stopped
    assert s.feed("6") == "4. 4\n6"  # not "4. 4\n5": the tail is released
    assert s.feed(" 4. 4\n5, 6") == " " and s.stopped and s.text == "3\n4. 4\n6 "
    t = StopStrings(["STOP"])
    assert t.feed("Hi ST") == "Hi " and t.flush() == "ST"  # generation ended: the tail was text


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


def test_history_slides_a_quarter_of_the_budget_at_once_so_the_next_turns_share_a_prefix():
    h = ChatHistory("sys")
    count = lambda msgs: sum(len(m["content"].split()) for m in msgs)  # noqa: E731
    prompts = []
    for i in range(12):
        prompts.append(h.prompt(f"question {i}", count, budget=100))
        assert count(prompts[-1]) <= 100
        h.add_turn(f"question {i} " + "w " * 8, f"answer {i}")
    cuts = [i for i in range(1, 12) if prompts[i][1] != prompts[i - 1][1]]  # the oldest kept turn changed
    assert cuts and len(cuts) <= 4  # not on every turn once the budget is reached
    after = cuts[0]
    assert count(prompts[after]) <= 75 + 10  # slid to 3/4 of the budget (+ the new question)
    # between cuts, each prompt extends the previous one: the prefix cache hits all of it
    for i in range(after + 1, cuts[1] if len(cuts) > 1 else 12):
        assert prompts[i][:-1] == prompts[i - 1][:-1] + prompts[i][len(prompts[i - 1]) - 1 : -1]
