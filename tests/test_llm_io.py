"""The LLM engine's input and output processors on their own (pipeline.llm.input,
pipeline.llm.output), with the one-character-per-token tokenizer, and its step statistics
(pipeline.llm.stats): no model, no thread."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pipeline.llm.input import InputProcessor, chat_prompt_ids, check_sampling, eos_token_ids
from pipeline.llm.output import OutputProcessor
from pipeline.llm.stats import StepStats
from pipeline.llm.stream import TokenStream
from pipeline.llm.types import PRIORITY_TEXT, FinishReason, GenRequest, SamplingParams, SchedRequest, State
from tests.fakes import CharTokenizer

TOK = CharTokenizer()
EOS = frozenset({1})


def ask(text: str, n: int = 8, **kw) -> GenRequest:
    return GenRequest(messages=[{"role": "user", "content": text}], max_new_tokens=n, **kw)


def prompt_len(text: str) -> int:
    return len(TOK.apply_chat_template([{"role": "user", "content": text}]))


# ---- input --------------------------------------------------------------------------------


def test_chat_prompt_ids_are_the_template_with_the_generation_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt_ids(TOK, messages) == [ord(c) for c in "<system>Be brief.\n<user>Hi\n<assistant>"]

    class Encoding(dict):  # a template that returns a BatchEncoding: its input_ids
        pass

    boxed = SimpleNamespace(apply_chat_template=lambda *a, **k: Encoding(input_ids=(5, 6, 7)))
    assert chat_prompt_ids(boxed, messages) == [5, 6, 7]


def test_eos_ids_join_the_generation_config_and_the_tokenizer():
    assert eos_token_ids(TOK, SimpleNamespace(eos_token_id=[2, 3])) == {1, 2, 3}
    assert eos_token_ids(TOK, SimpleNamespace(eos_token_id=7)) == {1, 7}
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=None)) == frozenset()


@pytest.mark.parametrize("bad, match", [(dict(max_new_tokens=0), "max_new_tokens"),
                                        (dict(max_new_tokens=2.5), "max_new_tokens"),
                                        (dict(temperature=float("nan")), "temperature"),
                                        (dict(temperature=-0.1), "temperature"),
                                        (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_check_sampling_refuses_settings_that_cannot_run(bad, match):
    req = ask("Hi")
    for name, value in bad.items():
        setattr(req, name, value)
    with pytest.raises(ValueError, match=match):
        check_sampling(req)


def test_process_builds_the_schedulers_request_numbering_only_accepted_ones():
    inp = InputProcessor(TOK, EOS, kv_budget=1000, context=None)
    first = inp.process(ask("Hi", 5, temperature=0.7, top_p=0.9, seed=3, session="s1", priority=PRIORITY_TEXT))
    assert isinstance(first, SchedRequest) and first.rid == 1
    assert first.prompt_ids == chat_prompt_ids(TOK, [{"role": "user", "content": "Hi"}])
    assert (first.max_new_tokens, first.eos_ids, first.owner, first.priority) == (5, EOS, "s1", PRIORITY_TEXT)
    assert first.sampling == SamplingParams.of(ask("Hi", 5, temperature=0.7, top_p=0.9, seed=3))
    assert first.state is State.WAITING and first.output_ids == []
    with pytest.raises(ValueError):
        inp.process(ask("Hi", 0))  # refused: no id used
    assert inp.process(ask("Yo")).rid == 2
    assert inp.count_tokens([{"role": "user", "content": "Hi"}]) == prompt_len("Hi")


def test_process_refuses_what_could_never_run():
    n = prompt_len("Hi")
    assert InputProcessor(TOK, EOS, kv_budget=n + 8, context=n + 8).process(ask("Hi", 8)).rid == 1  # exactly fits
    with pytest.raises(ValueError, match=f"exceeds the KV budget of {n + 7} tokens"):
        InputProcessor(TOK, EOS, kv_budget=n + 7, context=None).process(ask("Hi", 8))
    with pytest.raises(ValueError, match=f"exceeds the model's context of {n + 7} tokens"):
        InputProcessor(TOK, EOS, kv_budget=10_000, context=n + 7).process(ask("Hi", 8))
    InputProcessor(TOK, EOS, kv_budget=10_000, context=0).check_fits(5000, 5000)  # 0: no context limit


# ---- output -------------------------------------------------------------------------------


def followed(text: str = "Hi", n: int = 8, stop: list[str] | None = None, rid: int = 1):
    """An output processor following one request: (processor, its SchedRequest, its stream)."""
    out = OutputProcessor(TOK)
    req = SchedRequest(rid=rid, prompt_ids=chat_prompt_ids(TOK, ask(text).messages), max_new_tokens=n, eos_ids=EOS)
    req.state = State.RUNNING
    stream = TokenStream()
    out.add(req, stream, stop or [])
    return out, req, stream


def sample(req: SchedRequest, text: str) -> list[tuple[SchedRequest, int | None]]:
    """One step's output for ``req``: the token of ``text`` (one character), appended as the
    scheduler does."""
    tok = ord(text)
    req.output_ids.append(tok)
    return [(req, tok)]


def drain(stream: TokenStream) -> tuple[list[str], BaseException | None]:
    """Every delta pending on an ended stream, and the error it raised (if any)."""

    async def run() -> tuple[list[str], BaseException | None]:
        got: list[str] = []
        try:
            async for delta in stream:
                got.append(delta)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return got, exc
        return got, None

    return asyncio.run(run())


def test_tokens_become_text_and_a_length_finish_closes_with_stats():
    out, req, stream = followed("Hi", n=3)
    assert stream.stats.prompt_tokens == len(req.prompt_ids) and out.stream_of(1) is stream
    assert out.process_outputs(sample(req, "a")) == []
    ttft = stream.stats.ttft_ms
    assert ttft > 0 and stream.stats.output_tokens == 1
    out.process_outputs(sample(req, "b"))
    assert stream.stats.ttft_ms == ttft  # set once, at the first token
    req.state, req.finish_reason = State.FINISHED, FinishReason.LENGTH  # as the scheduler finishes it
    assert out.process_outputs(sample(req, "c")) == []
    assert out.stream_of(1) is None and stream.ended
    assert stream.stats.finish_reason is FinishReason.LENGTH and stream.stats.output_tokens == 3
    assert stream.stats.tpot_ms > 0
    assert "".join(drain(stream)[0]) == "abc"


def test_an_end_of_sequence_counts_as_a_token_and_ends_with_stop():
    out, req, stream = followed()
    out.process_outputs(sample(req, "a"))
    req.state, req.finish_reason = State.FINISHED, FinishReason.STOP
    out.process_outputs([(req, None)])  # EOS: no text
    assert stream.stats.output_tokens == 2 and stream.stats.finish_reason is FinishReason.STOP
    assert drain(stream) == (["a"], None)


def test_a_stop_string_is_handed_back_and_never_sent_in_part():
    out, req, stream = followed(stop=["END"])
    for ch in "ok E":
        assert out.process_outputs(sample(req, ch)) == []
    assert not stream.ended  # "E" is held back: it may begin "END"
    out.process_outputs(sample(req, "N"))
    assert out.process_outputs(sample(req, "D")) == [1]  # the engine finishes it in the scheduler
    assert not stream.ended and out.stream_of(1) is stream
    out.close(1, FinishReason.STOP, flush=False)
    assert stream.stats.finish_reason is FinishReason.STOP
    assert "".join(drain(stream)[0]) == "ok "


def test_a_held_back_tail_is_flushed_at_the_end_unless_aborted():
    out, req, stream = followed(stop=["END"])
    out.process_outputs(sample(req, "x"))
    out.process_outputs(sample(req, "E"))
    out.close(1, FinishReason.LENGTH)
    assert "".join(drain(stream)[0]) == "xE"  # it never became a stop string
    out, req, stream = followed(stop=["END"], rid=7)
    out.process_outputs(sample(req, "x"))
    out.process_outputs(sample(req, "E"))
    stream.abort()
    assert out.aborted() == [7]
    out.close(7, FinishReason.ABORT)
    assert out.aborted() == [] and stream.stats.finish_reason is FinishReason.ABORT
    assert "".join(drain(stream)[0]) == "x"


def test_fail_ends_the_stream_with_the_error_after_its_text():
    out, req, stream = followed()
    out.process_outputs(sample(req, "a"))
    boom = RuntimeError("step failed")
    out.fail(1, boom)
    out.fail(1, boom)  # unknown by now: ignored
    out.close(1, FinishReason.STOP)  # likewise
    assert stream.stats.finish_reason is FinishReason.ERROR
    assert drain(stream) == (["a"], boom)


def test_outputs_of_requests_not_followed_are_ignored():
    out, req, stream = followed()
    other = SchedRequest(rid=99, prompt_ids=[5], max_new_tokens=4)
    assert out.process_outputs(sample(other, "z")) == []
    assert out.stream_of(99) is None and not stream.ended


# ---- step statistics ----------------------------------------------------------------------


def test_step_stats_average_the_step_time_and_log_computing_steps():
    st = StepStats()
    st.timed(20.0)
    assert st.step_ms == 20.0  # the first step sets it
    st.timed(30.0)
    assert st.step_ms == pytest.approx(21.0)  # then a moving average, weight 0.1
    st.record(0, 0)  # a step that only freed rows: counted, not logged
    st.record(3, 2)
    assert st.steps == 2 and st.batch_sizes == [3] and [k for _, k in st.token_log] == [2]
