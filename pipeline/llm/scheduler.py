"""Iteration-level (continuous) batching scheduler: pure bookkeeping, no tensors.

Modelled on vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py): ``add`` and
``abort`` change request states, ``schedule()`` returns a :class:`StepPlan` saying which
requests join (prefill), keep decoding, or leave the batch at this token step, and
``update(plan, outputs)`` records the sampled tokens and finishes requests. The model
runner executes plans; one small engine loop glues the two (see ``pipeline.llm.engine``).

Prefill is chunked (vLLM's chunked prefill): each step prefills at most
``max_prefill_tokens`` prompt tokens over all joining requests, so a huge prompt is
spread over several steps while the running requests keep decoding one token per step.
A request whose prompt is only partly prefilled holds a batch slot but does not decode.
The prefill budget goes to the shortest remaining prompts first (SRPT, which minimises
mean time to first token), so a voice turn's short prompt is not stuck behind long ones;
and while others decode, a long prompt advances only a few tokens per step (fairness:
one session's appetite must not stall everyone's replies).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pipeline.config import SchedulerConfig
from pipeline.llm.types import FinishReason, SchedRequest, State, StepPlan


class Scheduler:
    """Decides, at every token step, who runs (see module docstring).

    ``running`` are the decoding requests, in the model runner's row order;
    ``prefilling`` hold a slot while their prompt is prefilled chunk by chunk.
    ``on_admit(req)`` runs when a request joins the batch, before its first chunk is
    planned: the runner's prefix cache may set ``req.num_computed`` (the prompt tokens it
    already holds), so only the rest is prefilled.
    """

    def __init__(self, cfg: SchedulerConfig, on_admit: Callable[[SchedRequest], object] | None = None) -> None:
        self.cfg = cfg
        self.on_admit = on_admit  # told when a request joins the batch (the prefix cache lookup)
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
        return self.finish(rid, FinishReason.ABORT)

    def finish(self, rid: int, reason: FinishReason) -> SchedRequest | None:
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

    def preempt_all(self) -> int:
        """Move every request in the batch back to the head of the queue, oldest first,
        with nothing computed (:meth:`SchedRequest.preempt`: recomputed when it runs again);
        rows to evict are forgotten (the runner was reset). Returns how many were moved."""
        batch = sorted(self.running + self.prefilling, key=lambda r: (r.arrival, r.rid))
        self.running, self.prefilling, self._leaving = [], [], []
        for req in reversed(batch):
            req.preempt()
            self.waiting.appendleft(req)
        return len(batch)

    def has_work(self) -> bool:
        """Whether any request waits, runs, or still has a row to free."""
        return bool(self.waiting or self.running or self.prefilling or self._leaving)

    def schedule(self, now: float | None = None) -> StepPlan:
        """Plan the next step (see :class:`StepPlan`).

        Waiting requests take free batch slots by priority, then in arrival order (within
        the KV budget; one that waited ``priority_age_ms`` counts as priority 0);
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
        if self.running and c.max_prefill_tokens_decoding:
            budget = min(budget, c.max_prefill_tokens_decoding)  # decoders wait for every step
        for req in sorted(self.prefilling, key=lambda r: (len(r.prompt_ids) - r.num_computed, r.arrival)):
            if budget <= 0:
                break
            cap = budget
            if len(req.prompt_ids) - req.num_computed > c.long_prompt_tokens:
                others = bool(self.running) or len(self.prefilling) > 1
                # others stream or wait for a first token: a long prompt trickles; alone, it
                # goes in chunks short enough that a newcomer waits little for the step
                cap = min(cap, c.long_prefill_tokens_decoding if others else c.long_prefill_tokens)
            budget -= self._chunk(plan, req, cap)
        return plan

    def _admit(self, plan: StepPlan, now: float) -> None:
        """Move waiting requests into free slots (state RUNNING, in ``prefilling``)."""
        c = self.cfg
        if not self.running and not self.prefilling and len(self.waiting) < c.max_batch_size:
            waited = now - self.waiting[0].arrival
            if waited * 1000 < c.max_wait_ms:  # hold a lone request briefly for company
                plan.wait_s = c.max_wait_ms / 1000 - waited
                return
        kv = self.kv_reserved
        while self.waiting and len(self.running) + len(self.prefilling) < c.max_batch_size:
            req = self._next_waiting(now)
            if (self.running or self.prefilling) and kv + req.kv_tokens > c.max_kv_tokens:
                break  # it joins when memory frees up (a lone request always runs)
            self.waiting.remove(req)
            req.state = State.RUNNING
            self.prefilling.append(req)
            kv += req.kv_tokens
            if self.on_admit is not None:  # before its chunk is planned: a cache hit starts it later
                self.on_admit(req)

    def _next_waiting(self, now: float) -> SchedRequest:
        """The waiting request that joins next: lowest priority, then queue order (arrival;
        preempted requests at the head); one that has waited ``priority_age_ms`` or more
        competes as priority 0 (aging)."""
        aged = now - self.cfg.priority_age_ms / 1000
        return min(enumerate(self.waiting), key=lambda e: (0 if e[1].arrival <= aged else e[1].priority, e[0]))[1]

    @property
    def kv_reserved(self) -> int:
        """KV-cache tokens the batch's requests may hold (prompt + max new tokens each)."""
        return sum(r.kv_tokens for r in self.running) + sum(r.kv_tokens for r in self.prefilling)

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
                self.finish(req.rid, FinishReason.STOP)
                out.append((req, None))
                continue
            req.output_ids.append(tok)
            out.append((req, tok))
            if len(req.output_ids) >= req.max_new_tokens:
                self.finish(req.rid, FinishReason.LENGTH)
        return out
