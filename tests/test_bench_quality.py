"""`voxpipe bench quality` (issue 33, item 1): the item set, the fact matcher, the rules, the
judge's digit parser and agreement statistics; and one slow run of the real pipeline (default
model, ``qwen1.5b`` as the judge) on a small fixed subset with floors on fact accuracy and the
judge's mean score."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest

from bench.quality_score import (
    agreement,
    count_sentences,
    failed_rules,
    is_truncated,
    judge_messages,
    load_labels,
    parse_score,
    pearson,
    question_only,
    ranks,
    spearman,
)
from bench.quality_set import CLASSES, fact_ok, load_items, pick

SLOW_JUDGE = "qwen1.5b"
"""The slow test's judge: ``qwen`` (0.5B) as a judge scores nearly every reply 4 (Spearman ≈ 0 with the
hand labels), so a floor on it would catch nothing."""
FACT_FLOOR = 0.83
"""The slow test's floor on fact accuracy (12 fact items, the default model): 10 of 12. The 0.5B
``qwen`` scored 11/12 here and 79 % on the whole set, the default ``qwen1.5b`` 98 % on the whole
set (int4, 2 cores, server framing)."""
JUDGE_FLOOR = 3.4
"""The slow test's floor on the judge's mean score (6 judged items, :data:`SLOW_JUDGE`): measured 4.0,
less ~15 % of the 1-5 scale (0.6)."""
SLOW_SUBSET = {"fact": 12, "request": 2, "talk": 2, "clip": 2}
"""The slow test's items: the first of each class."""


def test_the_set_loads_with_every_class():
    items = load_items()
    counts = Counter(it.cls for it in items)
    assert len(items) >= 120
    assert counts["fact"] >= 40 and counts["request"] >= 25 and counts["talk"] >= 25
    assert counts["followup"] >= 15 and counts["clip"] == 8
    assert all(it.answers for it in items if it.cls == "fact")
    assert all(it.history for it in items if it.cls == "followup")
    assert any(it.answers for it in items if it.cls == "followup") and any(
        not it.answers for it in items if it.cls == "followup")
    assert any("ask not what your country can do for you" in it.text for it in items if it.cls == "clip")
    assert len({(it.text, it.history) for it in items}) == len(items)
    assert [it.cls for it in load_items(limit=2)] == [c for c in CLASSES for _ in range(2)]
    assert [it.cls for it in pick(items, SLOW_SUBSET)] == ["fact"] * 12 + ["request"] * 2 + ["talk"] * 2 + ["clip"] * 2


def test_a_bad_row_is_refused(tmp_path):
    bad = tmp_path / "set.tsv"
    bad.write_text("class\ttext\tanswers\thistory\nfollowup\twhat is my name\tanna\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs history"):
        load_items(bad)
    bad.write_text("fact\tx\t(unclosed\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad answer pattern"):
        load_items(bad)


@pytest.mark.parametrize(("answers", "reply", "ok"), [
    (("paris",), "The capital of France is Paris.", True),
    (("56|fifty six",), "Seven times eight is fifty-six.", True),
    (("56|fifty six",), "It is 56!", True),
    (("56|fifty six",), "It is 566.", False),
    (("1969|nineteen sixty nine",), "In July 1969, Apollo 11 landed.", True),
    (("1000|one thousand|a thousand",), "There are 1,000 grams in a kilogram.", True),
    (("h2o|h 2 o",), "Water is H₂O.", True),
    (("mars",), "I love marshmallows.", False),
    (("peanuts?",), "You are allergic to peanuts.", True),
    (("366|three hundred (and )?sixty six",), "A leap year has three hundred and sixty-six days.", True),
    ((), "anything", False),
])
def test_fact_matcher(answers, reply, ok):
    assert fact_ok(answers, reply) is ok


@pytest.mark.parametrize(("text", "n"), [
    ("Yes.", 1), ("Sure! Boil it for seven minutes.", 2), ("One. Two. Three.", 3),
    ("Dr. Smith said pi is 3.14 today.", 1), ("No end mark", 1), ("Hm... okay!", 2), ("", 0),
])
def test_sentences(text, n):
    assert count_sentences(text) == n


@pytest.mark.parametrize(("text", "reason", "cut"), [
    ("All done.", "stop", False), ("Great job! 😊", "stop", False), ('He said "hi."', "stop", False),
    ("Boil the water and then", "stop", True), ("All done.", "length", True), ("", "stop", False),
])
def test_truncation(text, reason, cut):
    assert is_truncated(text, reason) is cut


@pytest.mark.parametrize(("cls", "user", "reply", "failed"), [
    ("request", "tell me a joke", "Why did the chicken cross the road? To get to the other side!", []),
    ("request", "tell me a joke", "", ["empty"]),
    ("request", "tell me a joke", "What kind of joke would you like?", ["question_only"]),
    ("request", "how do i boil an egg", "Put the egg in boiling water and", ["truncated"]),
    ("request", "how do i boil an egg", "One. Two. Three.", ["sentences"]),
    ("request", "give me a tip", "word " * 41 + "end.", ["words"]),
    ("request", "give me a tip", "As an AI, I don't sleep.", ["refusal"]),
    ("request", "give me a tip", "I'm sorry, but I can't help with that.", ["refusal"]),
    ("request", "give me a tip for sleeping better", "Give me a tip for sleeping better.", ["parrot"]),
    ("talk", "i just got back from a run", "Nice! How far did you go?", []),
    ("talk", "i just got back from a run", "You just got back from a run.", ["parrot"]),
    ("talk", "my dog is sick today", "Oh no. I'm sorry. Is it serious? Call the vet.", ["sentences"]),
    ("talk", "my dog is sick today", "Oh no, what happened to", []),  # truncation is not a talk rule
])
def test_rules(cls, user, reply, failed):
    assert failed_rules(cls, user, reply, "stop") == failed


def test_question_only():
    assert question_only("What kind? Any preference?") and not question_only("Sure. Which one?")
    assert not question_only("")


@pytest.mark.parametrize(("out", "score"), [
    ("5", 5), ("Score: 4", 4), ("3/5", 3), (" 2.", 2), ("0 then 1", 1), ("none", None), ("", None), ("9", None),
])
def test_the_judge_digit_parser(out, score):
    assert parse_score(out) == score


def test_judge_messages_show_the_history():
    msgs = judge_messages("and tuesday", "Rain.", [("monday?", "Sunny.")])
    assert msgs[0]["role"] == "system" and "1 to 5" in msgs[0]["content"]
    assert "User: monday?\nAssistant: Sunny." in msgs[1]["content"] and '"Rain."' in msgs[1]["content"]
    assert "Earlier" not in judge_messages("hi", "Hello!")[1]["content"]


def test_agreement_stats():
    assert ranks([10, 20, 20, 30]) == [1, 2.5, 2.5, 4]
    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    a = agreement([5, 4, 3, 1, 2], [5, 3, 3, None, 5])
    assert (a.n, a.unparsed) == (4, 1)
    assert a.exact == pytest.approx(0.5) and a.within1 == pytest.approx(0.75)
    assert a.spearman == pytest.approx(round(spearman([5, 4, 3, 2], [5, 3, 3, 5]), 3))
    assert a.pearson == pytest.approx(round(pearson([5, 4, 3, 2], [5, 3, 3, 5]), 3))


def test_the_hand_labels_are_thirty_and_mixed():
    labels = load_labels()
    assert len(labels) == 30 and all(x.reason for x in labels)
    assert {x.label for x in labels} >= {1, 2, 3, 4, 5}


@pytest.mark.slow
def test_the_default_model_answers_facts_and_pleases_the_judge():
    from bench.quality import run_quality
    from pipeline.config import LlmConfig

    args = SimpleNamespace(device="auto", threads=2, concurrency=8, max_new_tokens=96, judge=SLOW_JUDGE)
    rows, judge, _ = run_quality([LlmConfig().model], ["server"], pick(load_items(), SLOW_SUBSET), args,
                                 with_agreement=False)
    (row,) = rows
    assert judge == SLOW_JUDGE and row.n == sum(SLOW_SUBSET.values()) and row.judged == 6
    assert row.fact[1] == 12 and row.fact[0] / row.fact[1] >= FACT_FLOOR
    assert row.judge_mean is not None and row.judge_mean >= JUDGE_FLOOR
