"""Iteration-level (continuous) batching scheduler: pure bookkeeping, no tensors.

Modelled on vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py): ``add`` and
``abort`` change request states, ``schedule()`` returns a :class:`StepPlan` saying which
requests join (prefill), keep decoding, or leave the batch at this token step, and
``update(plan, outputs)`` records the sampled tokens and finishes requests. The model
runner executes plans; one small engine loop glues the two (see ``pipeline.llm``).

Prefill is chunked (vLLM's chunked prefill): each step prefills at most
``max_prefill_tokens`` prompt tokens over all joining requests, so a huge prompt is
spread over several steps while the running requests keep decoding one token per step.
A request whose prompt is only partly prefilled holds a batch slot but does not decode.
The prefill budget goes to the shortest remaining prompts first (SRPT, which minimises
mean time to first token), so a voice turn's short prompt is not stuck behind long ones.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from dataclasses import dataclass, field


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    """Batching knobs.

    Attributes:
        max_batch_size: most requests decoding together (8).
        max_wait_ms: how long a lone request waits for company before the batch starts
            (20 ms); requests arriving while a batch runs join at the next step anyway.
        max_prefill_tokens: prompt tokens prefilled in one step over all joining
            requests (512); longer prompts are prefilled in chunks over several steps,
            so a long or bursty prefill delays the running requests' next token by at
            most about one such chunk.
        max_prefill_attention: a chunk's tokens × the prompt tokens they attend to
            (512 × 1536): late chunks of a long prompt attend to everything before them,
            so they are cut shorter (at 6000 tokens in: ~120 tokens). A 512-token chunk
            6000 tokens into a prompt took 1.3-1.7 s with SmolLM2 on this CPU, stalling
            every running request for that long.
        max_kv_tokens: KV-cache budget in tokens over the batch, each request counted as
            prompt + max_new_tokens (16384); a request that would exceed it waits.
        static: static batching for comparison — start only with a full batch (or
            after ``max_wait_ms``) and admit nobody until the batch has drained.
    """

    max_batch_size: int = 8
    max_wait_ms: float = 20.0
    max_prefill_tokens: int = 512
    max_prefill_attention: int = 512 * 1536
    max_kv_tokens: int = 16384
    static: bool = False


@dataclass(slots=True, eq=False)
class SchedRequest:
    """One generation request as the scheduler sees it.

    Attributes:
        rid: unique id.
        prompt_ids: prompt token ids.
        max_new_tokens: most tokens to generate.
        eos_ids: token ids that end the request (not part of the output).
        arrival: ``time.monotonic()`` when added.
        prefix_len: length of a prompt prefix shared with other requests (the system
            prompt); the runner may take its KV from a prefix cache instead of computing it.
        output_ids: generated tokens so far.
        num_computed: prompt tokens already prefilled (chunked prefill).
    """

    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    prefix_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    state: State = State.WAITING
    finish_reason: str | None = None
    num_computed: int = 0

    @property
    def kv_tokens(self) -> int:
        """Worst-case KV-cache tokens this request can hold."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(slots=True)
class StepPlan:
    """What the model runner does in one step.

    Attributes:
        prefill: requests prefilling a chunk of their prompt (``spans``); those whose
            chunk ends the prompt sample a first token and join the decoding batch.
        spans: ``rid -> (start, end)`` prompt tokens each prefill request computes now.
        decode: running requests that decode one token.
        evict: ids of requests whose rows leave the batch before this step.
        wait_s: when nothing is planned, how long the engine may sleep before asking again.
    """

    prefill: list[SchedRequest] = field(default_factory=list)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    decode: list[SchedRequest] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)
    wait_s: float | None = None

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.evict)


class Scheduler:
    """Decides, at every token step, who runs (see module docstring).

    ``running`` are the decoding requests, in the model runner's row order;
    ``prefilling`` hold a slot while their prompt is prefilled chunk by chunk.
    """

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.waiting: deque[SchedRequest] = deque()
        self.running: list[SchedRequest] = []
        self.prefilling: list[SchedRequest] = []
        self._leaving: list[int] = []  # rows to evict at the next step
        self.requests: dict[int, SchedRequest] = {}

    def add(self, req: SchedRequest) -> None:
        """Queue a new request."""
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: int) -> SchedRequest | None:
        """Abort a request; a running one leaves the batch at the next step."""
        return self.finish(rid, "abort")

    def finish(self, rid: int, reason: str) -> SchedRequest | None:
        """Finish a request from outside (abort, stop string); idempotent."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req.state is State.WAITING:
            self.waiting.remove(req)
        elif req.state is State.RUNNING:
            (self.running if req in self.running else self.prefilling).remove(req)
            self._leaving.append(rid)
        req.state, req.finish_reason = State.FINISHED, reason
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self._leaving)

    def schedule(self, now: float | None = None) -> StepPlan:
        """Plan the next step (see :class:`StepPlan`).

        Waiting requests take free batch slots in arrival order (within the KV budget);
        then the step's prefill budget goes to the prompts with the fewest tokens left
        first (shortest remaining prefill first, ties by arrival), so a short request
        that arrives while long prompts are being prefilled is not queued behind them:
        it gets its whole prompt in the next step, and the long prompts the rest.
        """
        now = time.monotonic() if now is None else now
        c = self.cfg
        plan = StepPlan(decode=list(self.running), evict=self._leaving)
        self._leaving = []
        if self.waiting and not (c.static and (self.running or self.prefilling)):
            self._admit(plan, now)
        budget = c.max_prefill_tokens
        for req in sorted(self.prefilling, key=lambda r: (len(r.prompt_ids) - r.num_computed, r.arrival)):
            if budget <= 0:
                break
            budget -= self._chunk(plan, req, budget)
        return plan

    def _admit(self, plan: StepPlan, now: float) -> None:
        """Move waiting requests into free slots (state RUNNING, in ``prefilling``)."""
        c = self.cfg
        if not self.running and not self.prefilling and len(self.waiting) < c.max_batch_size:
            waited = now - self.waiting[0].arrival
            if waited * 1000 < c.max_wait_ms:  # hold a lone request briefly for company
                plan.wait_s = c.max_wait_ms / 1000 - waited
                return
        kv = sum(r.kv_tokens for r in self.running) + sum(r.kv_tokens for r in self.prefilling)
        while self.waiting and len(self.running) + len(self.prefilling) < c.max_batch_size:
            req = self.waiting[0]
            if (self.running or self.prefilling) and kv + req.kv_tokens > c.max_kv_tokens:
                break  # it joins when memory frees up (a lone request always runs)
            self.waiting.popleft()
            req.state = State.RUNNING
            self.prefilling.append(req)
            kv += req.kv_tokens

    def _chunk(self, plan: StepPlan, req: SchedRequest, budget: int) -> int:
        n = min(budget, len(req.prompt_ids) - req.num_computed, self._attention_cap(req.num_computed))
        if n > 0:
            plan.prefill.append(req)
            plan.spans[req.rid] = (req.num_computed, req.num_computed + n)
        return max(n, 0)

    def _attention_cap(self, past: int) -> int:
        """Most tokens a chunk after ``past`` prompt tokens may have: n × (past + n) within
        ``max_prefill_attention``, at least 16 (so a prompt always progresses)."""
        a = self.cfg.max_prefill_attention
        return max(16, int((math.sqrt(past * past + 4 * a) - past) / 2))

    def update(self, plan: StepPlan, outputs: dict[int, int]) -> list[tuple[SchedRequest, int | None]]:
        """Record the prefilled chunks and the sampled tokens (``rid -> token id``).

        Returns ``(request, token)`` pairs in plan order; ``token`` is None when the
        token was an end-of-sequence id. A request whose prompt is now fully prefilled
        joins ``running`` (in plan order, as the runner appends its row). Requests that
        hit EOS or ``max_new_tokens`` are finished and leave the batch at the next step.
        """
        for req in plan.prefill:
            if req.state is State.RUNNING:
                req.num_computed = plan.spans[req.rid][1]
                if req.num_computed >= len(req.prompt_ids):
                    self.prefilling.remove(req)
                    self.running.append(req)
        out: list[tuple[SchedRequest, int | None]] = []
        for req in plan.decode + plan.prefill:
            if req.state is not State.RUNNING or req.rid not in outputs:
                continue  # finished from outside during this step, or a partial prefill
            tok = outputs[req.rid]
            if tok in req.eos_ids:
                self.finish(req.rid, "stop")
                out.append((req, None))
                continue
            req.output_ids.append(tok)
            out.append((req, tok))
            if len(req.output_ids) >= req.max_new_tokens:
                self.finish(req.rid, "length")
        return out
