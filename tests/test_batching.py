"""Continuous batching: scheduler bookkeeping (no model) and token identity (tiny model)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import SchedulerConfig
from pipeline.llm.runner.runner import ModelRunner
from pipeline.llm.scheduler import Scheduler
from pipeline.llm.types import FinishReason, SamplingParams, SchedRequest, State


def req(rid, n_prompt=4, max_new=3, arrival=0.0, eos=()):
    return SchedRequest(rid=rid, prompt_ids=list(range(1, n_prompt + 1)), max_new_tokens=max_new,
                        eos_ids=frozenset(eos), arrival=arrival)


# ---- scheduler with hand-made outputs -------------------------------------------------


def test_lone_request_waits_for_company_then_runs():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_wait_ms=50))
    s.add(req(1, arrival=0.0))
    plan = s.schedule(now=0.01)
    assert plan.empty and plan.wait_s == pytest.approx(0.04)
    s.add(req(2, arrival=0.02))
    plan = s.schedule(now=0.06)
    assert [r.rid for r in plan.prefill] == [1, 2] and plan.decode == []


def test_join_at_next_step_and_leave_on_finish():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_wait_ms=0))
    s.add(req(1, max_new=2))
    p1 = s.schedule(now=1)
    assert [r.rid for r in p1.prefill] == [1]
    s.update(p1, {1: 10})
    s.add(req(2, max_new=5, arrival=1))
    p2 = s.schedule(now=2)  # 2 joins while 1 decodes
    assert [r.rid for r in p2.decode] == [1] and [r.rid for r in p2.prefill] == [2]
    s.update(p2, {1: 11, 2: 20})
    assert s.requests.get(1) is None  # finished by length
    p3 = s.schedule(now=3)
    assert p3.evict == [1] and [r.rid for r in p3.decode] == [2]


def test_eos_finishes_without_output_token():
    s = Scheduler(SchedulerConfig(max_wait_ms=0))
    r = req(1, max_new=10, eos={0})
    s.add(r)
    p = s.schedule(now=1)
    out = s.update(p, {1: 0})
    assert out == [(r, None)] and r.state is State.FINISHED and r.output_ids == []
    assert r.finish_reason is FinishReason.STOP


def test_abort_running_frees_row_next_step_and_waiting_immediately():
    s = Scheduler(SchedulerConfig(max_batch_size=1, max_wait_ms=0))
    s.add(req(1, max_new=100))
    s.add(req(2, max_new=100))
    p = s.schedule(now=1)
    s.update(p, {1: 5})
    s.abort(2)  # waiting: gone at once
    assert not s.waiting
    s.abort(1)
    p = s.schedule(now=2)
    assert p.evict == [1] and p.decode == [] and not s.running
    assert s.abort(1) is None  # idempotent


def test_voice_turns_take_free_slots_before_text_requests_that_came_first():
    s = Scheduler(SchedulerConfig(max_batch_size=1, max_wait_ms=0))
    s.add(req(1, max_new=1, arrival=0.0))
    s.update(s.schedule(now=0.0), {1: 5})  # 1 finished by length: its slot frees at the next step
    text, voice = req(2, arrival=0.1), req(3, arrival=0.2)
    text.priority = 1
    s.add(text)
    s.add(voice)
    assert [r.rid for r in s.schedule(now=0.3).prefill] == [3]  # the later voice turn first
    assert [r.rid for r in s.waiting] == [2]


def test_a_text_request_that_waited_its_age_competes_as_a_voice_turn():
    s = Scheduler(SchedulerConfig(max_batch_size=1, max_wait_ms=0, priority_age_ms=1000))
    text, voice = req(2, arrival=0.0), req(3, arrival=0.5)
    text.priority = 1
    s.add(text)
    s.add(voice)
    assert [r.rid for r in s.schedule(now=0.9).prefill] == [3]  # younger than its age: yields
    s2 = Scheduler(SchedulerConfig(max_batch_size=1, max_wait_ms=0, priority_age_ms=1000))
    text2, voice2 = req(2, arrival=0.0), req(3, arrival=0.5)
    text2.priority = 1
    s2.add(text2)
    s2.add(voice2)
    assert [r.rid for r in s2.schedule(now=1.0).prefill] == [2]  # waited 1 s: first in line again


def test_equal_priorities_keep_queue_order_with_preempted_requests_first():
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_wait_ms=0))
    for i, t in ((1, 0.0), (2, 0.1)):
        s.add(req(i, max_new=50, arrival=t))
    s.update(s.schedule(now=1.0), {1: 7, 2: 8})
    s.add(req(3, arrival=0.9))
    assert s.preempt_all() == 2
    assert [r.rid for r in s.schedule(now=1.1).prefill] == [1, 2]  # not 3, which came later


def test_max_batch_size_and_chunked_prefill_budget():
    s = Scheduler(SchedulerConfig(max_batch_size=3, max_wait_ms=0, max_prefill_tokens=10))
    for i in range(5):
        s.add(req(i, n_prompt=4))
    p = s.schedule(now=1)
    assert p.spans == {0: (0, 4), 1: (0, 4), 2: (0, 2)}  # the third prompt gets what is left
    s.update(p, {0: 1, 1: 1})  # 2 is not fully prefilled: no token yet
    assert [r.rid for r in s.running] == [0, 1] and [r.rid for r in s.prefilling] == [2]
    p = s.schedule(now=2)
    assert [r.rid for r in p.decode] == [0, 1] and p.spans == {2: (2, 4)}  # batch full at 3
    s.update(p, {0: 2, 1: 2, 2: 7})
    assert [r.rid for r in s.running] == [0, 1, 2] and s.requests[2].output_ids == [7]


def test_long_prompt_is_prefilled_in_budget_sized_chunks_while_others_decode():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_wait_ms=0, max_prefill_tokens=16))
    s.add(req(1, n_prompt=4, max_new=100))
    s.update(s.schedule(now=1), {1: 5})
    s.add(req(2, n_prompt=50, max_new=5))
    spans = []
    for step in range(4):
        p = s.schedule(now=2 + step)
        assert [r.rid for r in p.decode] == [1]  # the running request decodes every step
        assert sum(b - a for a, b in p.spans.values()) <= 16
        spans.append(p.spans[2])
        s.update(p, {1: 5} | ({2: 9} if p.spans[2][1] == 50 else {}))
    assert spans == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert [r.rid for r in s.running] == [1, 2] and s.requests[2].output_ids == [9]


def test_a_long_prompt_trickles_while_others_decode_or_wait_and_takes_short_chunks_alone():
    cfg = SchedulerConfig(max_batch_size=4, max_wait_ms=0, max_prefill_tokens=512, max_prefill_tokens_decoding=256,
                          long_prompt_tokens=256, long_prefill_tokens=128, long_prefill_tokens_decoding=32)
    s = Scheduler(cfg)
    s.add(req(1, n_prompt=4, max_new=3))
    s.update(s.schedule(now=1), {1: 5})
    s.add(req(2, n_prompt=1000, max_new=5))  # one session's huge prompt
    s.add(req(3, n_prompt=100, max_new=5))  # another session's short turn
    p = s.schedule(now=2)
    assert p.spans[3] == (0, 100)  # the short prompt whole (SRPT, not throttled)
    assert p.spans[2] == (0, 32)  # the long one trickles while 1 decodes
    s.update(p, {1: 5, 3: 7})
    p = s.schedule(now=3)
    assert p.spans[2] == (32, 64)
    s.update(p, {1: 5, 3: 7})  # 1 is done (3 tokens)
    s.finish(3, FinishReason.ABORT)
    p = s.schedule(now=4)
    p = s.schedule(now=5) if not p.spans else p
    assert p.decode == [] and p.spans[2][1] - p.spans[2][0] == 128  # alone: short steps, not trickles
    s.update(p, {})
    s.add(req(4, n_prompt=600, max_new=5))  # a second long prompt waits: neither holds the step long
    p = s.schedule(now=6)
    assert p.spans[2][1] - p.spans[2][0] == 32 and p.spans[4] == (0, 32)


def test_abort_while_prefilling_frees_the_slot():
    s = Scheduler(SchedulerConfig(max_batch_size=1, max_wait_ms=0, max_prefill_tokens=8))
    s.add(req(1, n_prompt=20))
    s.add(req(2, n_prompt=4))
    p = s.schedule(now=1)
    s.update(p, {})
    s.abort(1)
    p = s.schedule(now=2)
    assert p.evict == [1] and [r.rid for r in p.prefill] == [2] and not s.prefilling[1:]


def test_kv_budget_holds_requests_back():
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_wait_ms=0, max_kv_tokens=20))
    s.add(req(1, n_prompt=4, max_new=8))
    s.add(req(2, n_prompt=4, max_new=8))
    p = s.schedule(now=1)
    assert len(p.prefill) == 1 and len(s.waiting) == 1


def test_static_batching_admits_nobody_while_running():
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_wait_ms=1000, static=True))
    s.add(req(1, max_new=3, arrival=0))
    s.add(req(2, max_new=3, arrival=0))
    p = s.schedule(now=0.001)
    assert len(p.prefill) == 2
    s.update(p, {1: 1, 2: 1})
    s.add(req(3, arrival=0.002))
    p = s.schedule(now=0.003)
    assert p.prefill == [] and len(p.decode) == 2


# ---- token identity with a tiny random Llama in fp32 -----------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval().float()


def run(model, specs, max_batch=8, prefill_budget=2048, runner=None, plans=None, sampling=None, cache=False):
    """specs: list of (arrival_step, prompt_ids, max_new); sampling: rid -> SamplingParams
    (default greedy); cache: a runner with the prefix cache (a given ``runner`` keeps its
    own). Returns rid -> output ids."""
    runner = runner or ModelRunner(model, torch.device("cpu"), pad_id=0, prefix_cache=cache)
    sched = Scheduler(SchedulerConfig(max_batch_size=max_batch, max_wait_ms=0, max_prefill_tokens=prefill_budget),
                      on_admit=runner.lookup)
    pending = sorted(enumerate(specs), key=lambda x: x[1][0])
    reqs, step = {}, 0
    while pending or sched.has_work():
        while pending and pending[0][1][0] <= step:
            rid, (_, prompt, n) = pending.pop(0)
            reqs[rid] = SchedRequest(rid=rid, prompt_ids=prompt, max_new_tokens=n, arrival=0,
                                     sampling=(sampling or {}).get(rid, SamplingParams()))
            sched.add(reqs[rid])
        plan = sched.schedule(now=1e9)
        if not plan.empty:
            if plans is not None:
                plans.append(([r.rid for r in plan.decode], dict(plan.spans)))
            sched.update(plan, runner.execute(plan))
        step += 1
    return {rid: r.output_ids for rid, r in reqs.items()}


def test_continuous_batching_is_token_identical_to_alone(tiny_model):
    g = torch.Generator().manual_seed(1)
    specs = []
    for i in range(7):
        n_prompt = int(torch.randint(3, 40, (1,), generator=g))
        prompt = torch.randint(1, 256, (n_prompt,), generator=g).tolist()
        specs.append((i * 3, prompt, int(torch.randint(5, 30, (1,), generator=g))))
    together = run(tiny_model, specs, max_batch=4)
    for rid, spec in enumerate(specs):
        alone = run(tiny_model, [(0, spec[1], spec[2])])[0]
        assert together[rid] == alone, f"request {rid} differs"
    # and against transformers' own greedy generate
    prompt, n = specs[0][1], specs[0][2]
    ref = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert together[0] == ref[0, len(prompt):].tolist()


def test_sampling_travels_on_the_request_and_is_seeded_per_row(tiny_model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    specs = [(i, p, 20) for i, p in enumerate(prompts)]
    sampling = {0: SamplingParams(1.0, 1.0, seed=7), 1: SamplingParams(0.8, 0.9, seed=7), 3: SamplingParams(1.0)}
    together = run(tiny_model, specs, max_batch=4, sampling=sampling)  # rid 2 stays greedy
    for rid, spec in enumerate(specs):
        alone = run(tiny_model, [(0, spec[1], spec[2])], sampling={0: sampling[rid]} if rid in sampling else None)
        assert together[rid] == alone[0], f"request {rid} differs"
    greedy = run(tiny_model, [(0, prompts[0], 20)])[0]
    assert together[0] != greedy  # it did sample
    other_seed = run(tiny_model, [(0, prompts[0], 20)], sampling={0: SamplingParams(1.0, 1.0, seed=8)})[0]
    assert other_seed != together[0]


def test_runner_frees_rows_and_trims_padding(tiny_model):
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_wait_ms=0))
    runner = ModelRunner(tiny_model, torch.device("cpu"), pad_id=0)
    sched.add(SchedRequest(rid=1, prompt_ids=list(range(1, 60)), max_new_tokens=50))
    sched.add(SchedRequest(rid=2, prompt_ids=[5, 6, 7], max_new_tokens=50))
    plan = sched.schedule(now=1e9)
    sched.update(plan, runner.execute(plan))
    assert runner.batch_size == 2 and runner.kv_columns == 59
    sched.abort(1)
    plan = sched.schedule(now=1e9)
    sched.update(plan, runner.execute(plan))
    assert runner.batch_size == 1 and runner.kv_columns == 3 + 1  # long row gone, padding trimmed
    sched.abort(2)
    runner.execute(sched.schedule(now=1e9))
    assert runner.batch_size == 0 and runner.cache is None


@pytest.mark.parametrize("mixed", [True, False])
def test_chunked_prefill_and_shared_prefix_are_token_identical(tiny_model, mixed):
    g = torch.Generator().manual_seed(2)
    system = torch.randint(1, 256, (12,), generator=g).tolist()  # shared by every request
    specs = []
    for i in range(6):
        own = torch.randint(1, 256, (int(torch.randint(2, 70, (1,), generator=g)),), generator=g).tolist()
        specs.append((i * 2, system + own, int(torch.randint(4, 20, (1,), generator=g))))
    runner = ModelRunner(tiny_model, torch.device("cpu"), pad_id=0, mixed=mixed, block_size=4)
    mixed_steps = []
    runner._mixed = lambda *a, f=runner._mixed: mixed_steps.append(1) or f(*a)  # count mixed forwards
    plans: list = []
    together = run(tiny_model, specs, max_batch=4, prefill_budget=24, runner=runner, plans=plans)
    assert runner.blocks is not None and runner.blocks.stats.hit_tokens >= 4 * len(system)  # the system prompt
    assert not runner._held
    assert all(sum(b - a for a, b in spans.values()) <= 24 for _, spans in plans)
    assert any(decode and spans for decode, spans in plans)  # prefill chunks ran beside decoding rows
    assert not runner._partial and runner.batch_size == 0
    assert bool(mixed_steps) == mixed
    for rid, spec in enumerate(specs):
        assert together[rid] == run(tiny_model, [(0, spec[1], spec[2])])[0], f"request {rid} differs"


def test_while_others_decode_a_step_prefills_at_most_the_decoding_budget():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_wait_ms=0, max_prefill_tokens=64,
                                  max_prefill_tokens_decoding=16))
    s.add(req(1, n_prompt=100, max_new=5))
    p = s.schedule(now=1)
    assert p.spans == {1: (0, 64)}  # nobody decodes yet: the whole budget
    s.update(p, {})
    s.add(req(2, n_prompt=4, max_new=50))
    p = s.schedule(now=2)
    assert p.spans == {2: (0, 4), 1: (64, 100)}  # still nobody decoding
    s.update(p, {1: 7, 2: 7})
    s.add(req(3, n_prompt=40, max_new=5))
    p = s.schedule(now=3)
    assert {r.rid for r in p.decode} == {1, 2} and p.spans == {3: (0, 16)}  # decoders running: 16 at most
    s.cfg.max_prefill_tokens_decoding = 0  # 0: the one budget for every step
    s.update(p, {1: 7, 2: 7})
    assert s.schedule(now=4).spans == {3: (16, 40)}


def test_prefill_budget_goes_to_the_shortest_remaining_prompt_first():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_wait_ms=0, max_prefill_tokens=10))
    s.add(req(1, n_prompt=30, arrival=0))
    s.add(req(2, n_prompt=30, arrival=0))
    p = s.schedule(now=1)
    assert p.spans == {1: (0, 10)}  # oldest first among equals; 2 holds a slot, no budget left
    s.update(p, {})
    s.add(req(3, n_prompt=4, arrival=1))
    p = s.schedule(now=2)
    assert p.spans == {3: (0, 4), 1: (10, 16)}  # the short newcomer first, the rest to the least left
    s.update(p, {3: 9})
    assert [r.rid for r in s.running] == [3] and s.requests[3].output_ids == [9]


def test_late_chunks_of_a_long_prompt_are_cut_by_attention_cost():
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_wait_ms=0, max_prefill_tokens=512, long_prompt_tokens=10**6))
    s.add(req(1, n_prompt=7000))
    sizes = []
    while s.requests[1].num_computed < 7000:
        p = s.schedule(now=1)
        a, b = p.spans[1]
        sizes.append(b - a)
        s.update(p, {})
    assert sizes[:3] == [512, 512, 512]  # a chunk of 512 while it attends to ≤ 1536 tokens
    assert sizes[-1] <= 128 and all(b * (a + b) <= 512 * 1536 for a, b in zip(
        [sum(sizes[:i]) for i in range(len(sizes))], sizes))


@pytest.mark.parametrize("mixed", [True, False])
def test_multi_turn_conversations_with_the_prefix_cache_are_token_identical(tiny_model, mixed):
    """A conversation's next turn starts from its earlier turns' cached KV (prompt and the
    reply as generated) and prefills only the new tokens; greedy output equals a run with no
    cache (fp32): after a full reply, after a reply cut by barge-in (only what was spoken
    goes on), with the oldest turn slid out of the window, and with a changed system prompt;
    two conversations at once in one batch too."""
    g = torch.Generator().manual_seed(5)

    def rand(n: int) -> list[int]:
        return torch.randint(1, 256, (n,), generator=g).tolist()

    runner = ModelRunner(tiny_model, torch.device("cpu"), pad_id=0, mixed=mixed, block_size=4)
    assert runner.blocks is not None
    system, end = rand(10), [255]
    convs = [system[:], system[:]]
    turns: list[list[list[int]]] = [[], []]
    for turn in range(4):
        prompts = [convs[c] + rand(5 + 3 * turn) for c in (0, 1)]
        specs = [(0, prompts[0], 10), (1, prompts[1], 10)]
        hits = runner.blocks.stats.hit_tokens
        cached = run(tiny_model, specs, max_batch=4, prefill_budget=16, runner=runner)
        for c in (0, 1):
            assert cached[c] == run(tiny_model, [(0, prompts[c], 10)])[0], f"turn {turn}, conversation {c}"
        if turn:
            assert runner.blocks.stats.hit_tokens - hits >= 2 * len(system)  # at least the system prompt, twice
        for c in (0, 1):
            spoken = cached[c][: len(cached[c]) // 2] if turn == 1 else cached[c]  # turn 1: barge-in
            turns[c].append(prompts[c][len(convs[c]):] + spoken + end)
            convs[c] = prompts[c] + spoken + end
    assert runner.blocks.stats.hit_tokens > 4 * len(system)  # conversations hit beyond the system prompt
    slid = system + [t for turn_ in turns[0][1:] for t in turn_] + rand(6)  # the oldest turn slid out
    other = rand(10) + convs[0][10:] + rand(6)  # a changed system prompt: nothing after it hits
    for prompt in (slid, other):
        assert run(tiny_model, [(0, prompt, 10)], runner=runner)[0] == run(tiny_model, [(0, prompt, 10)])[0]
    assert not runner._held and all(b.refs == 0 for b in runner.blocks.blocks.values())


def test_the_block_cache_stays_within_its_limit_and_evicts_least_recent_first(tiny_model):
    runner = ModelRunner(tiny_model, torch.device("cpu"), pad_id=0, block_size=4)
    assert runner.blocks is not None
    runner.cache_limit = 40
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 256, (30,), generator=g).tolist() for _ in range(4)]
    for p in prompts:
        run(tiny_model, [(0, p, 6)], runner=runner)
        assert runner.blocks.tokens <= 40
    assert runner.blocks.stats.evictions > 0
    hits = runner.blocks.stats.hit_tokens
    run(tiny_model, [(0, prompts[-1] + [7], 4)], runner=runner)  # the most recent is still there
    assert runner.blocks.stats.hit_tokens - hits >= 28
    hits = runner.blocks.stats.hit_tokens
    run(tiny_model, [(0, prompts[0] + [7], 4)], runner=runner)  # the oldest was evicted
    assert runner.blocks.stats.hit_tokens == hits


def test_prompts_arriving_at_an_empty_batch_prefill_as_one_flat_sequence(tiny_model):
    g = torch.Generator().manual_seed(5)
    specs = [(0, torch.randint(1, 256, (n,), generator=g).tolist(), 12) for n in (3, 37, 9, 20)]
    flat = ModelRunner(tiny_model, torch.device("cpu"), pad_id=0)
    calls: dict[str, list] = {"mixed": [], "prefill": []}
    for name in calls:
        real = getattr(flat, f"_{name}")
        setattr(flat, f"_{name}", lambda reqs, spans, real=real, name=name:
                calls[name].append(len(reqs)) or real(reqs, spans))
    together = run(tiny_model, specs, max_batch=4, runner=flat)
    assert calls["prefill"] == [] and calls["mixed"][0] == 4  # the four prompts, unpadded, in one forward
    padded = run(tiny_model, specs, max_batch=4,
                 runner=ModelRunner(tiny_model, torch.device("cpu"), pad_id=0, prefix_cache=False, mixed=False))
    assert together == padded
