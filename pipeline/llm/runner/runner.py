"""Model runner: executes scheduler plans over one left-padded, batched KV cache.

The decoding batch is a :class:`~pipeline.llm.runner.batch_kv.BatchKV`: per-layer key/value buffers
in slots (one request per slot, left-padded to a common T, written in place), an attention
mask (slots, T) that is 0 on padding, and per slot the next position id and the last
sampled token. Each row keeps its own position ids, so a request's tokens are the same as
when it runs alone (tested token-for-token with a tiny fp32 model).

Prefill is chunked and batched: every prompt chunk planned for a step (several joining
requests, each resuming where its previous chunk stopped) runs in one padded forward
over the rows' own past KV. A row whose prompt is not finished keeps its KV aside
(``_partial``); a finished one samples its first token and is appended to the batch.
Automatic prefix caching (:mod:`pipeline.llm.runner.block_cache`, vLLM's APC): every
prefilled prompt and every request leaving the batch (prompt + the tokens it generated) is
cached by token blocks; a request joining the batch (:meth:`ModelRunner.lookup`) starts
from the longest cached chain of its prompt's blocks — the system prompt, a conversation's
earlier turns and the last reply as spoken — and prefills only the rest. After a padded prefill a row's KV is
compacted (real columns to the right, in order: RoPE is already applied, so a column may
move) before it takes a slot; a leaving request frees its slot.

A step with both decoding rows and prompt chunks runs as ONE forward (:meth:`ModelRunner._mixed`,
vLLM-style mixed batch): every new token in one flat sequence for the linear layers,
attention per segment (:mod:`pipeline.llm.runner.mixed_attention`). On a CPU a small batch's forward
costs about one pass over the weights whatever the batch, so a separate prefill forward would
cost every running request a whole extra step per join.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.llm.runner import decode_step, greedy, quant_linear
from pipeline.llm.runner.batch_kv import BatchKV
from pipeline.llm.runner.block_cache import BLOCK_SIZE, Block, BlockCache
from pipeline.llm.runner.kv_rows import RowsKV
from pipeline.llm.runner.mixed_attention import MixedCache, use_mixed_attention
from pipeline.llm.types import SamplingParams, SchedRequest, StepPlan


@dataclass(slots=True)
class _Row:
    """A decoding slot's request: its id, sampling settings (``SchedRequest.sampling``),
    once it samples its own seeded generator, and the request (its tokens, for the cache)."""

    rid: int
    sampling: SamplingParams
    gen: torch.Generator | None = field(default=None)
    req: SchedRequest | None = None


class ModelRunner:
    """Runs :class:`StepPlan` s on a causal LM; returns one sampled token per row.

    Args:
        model: a transformers causal LM (eval mode).
        device: its ``torch.device``.
        pad_id: token id used for padding (its embeddings are masked out).
        prefix_cache: cache KV by token blocks and reuse it (:mod:`~pipeline.llm.runner.block_cache`).
        block_size: tokens per cached block.
        mixed: run the prefill chunks in the same forward as the decoding rows
            (:meth:`_mixed`); False runs them as a second, padded forward.
        lean_decode: run decode and mixed steps through :mod:`~pipeline.llm.runner.decode_step`
            (bit-identical, less Python) where the model supports it (with ``mixed``: it
            needs voxpipe's attention).
    """

    BUCKET = 8
    """Prefill and mixed steps run a token count rounded up to a multiple of this (padding,
    masked or discarded): oneDNN compiles a kernel per linear-layer shape and token count and
    caches a bounded number (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), so fewer distinct counts
    mean cache hits instead of recompiling, and bounded memory. Not where every linear layer
    runs voxpipe's int4 kernel (:func:`~pipeline.llm.runner.quant_linear.any_width`): there
    padding is only work (``bucket`` is 1)."""

    def __init__(self, model, device, pad_id: int, *, prefix_cache: bool = True, block_size: int = BLOCK_SIZE,
                 mixed: bool = True, lean_decode: bool = True) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.slots: list[_Row | None] = []  # per batch slot: its request, None = free
        self.batch: BatchKV | None = None
        self.pos: torch.Tensor | None = None  # (slots,) long: next position id
        self.last: torch.Tensor | None = None  # (slots,) long: last sampled token
        self.blocks: BlockCache | None = BlockCache(block_size) if prefix_cache else None
        self.cache_limit: int | None = None  # most tokens the block cache may keep (None: no limit)
        self._held: dict[int, list[Block]] = {}  # rid -> cached blocks its prompt started from
        self._partial: dict[int, RowsKV] = {}  # rid -> KV of a prompt prefilled so far
        self.bucket = 1 if quant_linear.any_width(model) else self.BUCKET  # tokens per step rounded up to this
        self.mixed = mixed and use_mixed_attention(model)
        self.lean_decode = self.mixed and lean_decode and decode_step.supports(model)

    def set_threads(self, n: int) -> None:
        """Run the next steps with ``n`` torch intra-op threads (CPU only; call on the
        engine thread: OpenMP keeps the count per calling thread)."""
        if self.device.type == "cpu":
            torch.set_num_threads(n)

    @property
    def batch_size(self) -> int:
        """Requests decoding in the batch (live slots)."""
        return sum(r is not None for r in self.slots)

    @property
    def kv_columns(self) -> int:
        """Padded KV length T of the batch (tokens)."""
        return 0 if self.batch is None else self.batch.columns

    @property
    def cache(self):
        """The batch's transformers cache (None when no request is decoding)."""
        return None if self.batch is None else self.batch.cache

    # ---- memory facts (pipeline.llm.memory does the arithmetic) -------------------------

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes per element of the KV cache and activations: the input embeddings' dtype
        (bf16: 2, fp32: 4; an int8-weight model keeps fp32 embeddings and activations)."""
        emb = self.model.get_input_embeddings()
        return int(emb.weight.element_size())

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take: parameters and buffers (the int4/int8 weights,
        scales and biases of ``QuantLinear``), oneDNN-packed bf16 linears
        (``PackedLinear.packed``, also a ``QuantLinear``'s bf16 copy) and int8 dynamic linears'
        packed weights."""
        total = 0
        seen: dict[int, torch.Tensor] = {}  # holds each tensor: a freed temporary's id could come back

        def add(t) -> None:
            nonlocal total
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen[id(t)] = t
                total += t.numel() * t.element_size()

        for m in self.model.modules():
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                add(t)
            add(getattr(m, "packed", None))
            packed = getattr(m, "_packed_params", None)
            if packed is not None and hasattr(packed, "_weight_bias"):
                for t in packed._weight_bias():
                    add(t)
        return total

    def device_free_bytes(self) -> int | None:
        """Free memory of the model's CUDA device (``torch.cuda.mem_get_info``), None on CPU."""
        dev = torch.device(self.device)
        if dev.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(dev)[0])

    @property
    def kv_buffer_bytes(self) -> int:
        """Bytes of the decoding batch's preallocated KV buffers (every layer's K and V,
        slot capacity × column capacity; 0 when no request is decoding)."""
        return 0 if self.batch is None else self.batch.nbytes

    def kv_bytes(self, per_token: int) -> tuple[int, int]:
        """(bytes of KV holding tokens, bytes of KV allocated) in host or device memory: the
        decoding batch's rows (each live row's prompt and output tokens × ``per_token``, within
        a token; at most its buffers) and the prompts prefilled so far (their tensors); the
        allocated bytes add the batch buffers' free slots, padding and spare columns. Read
        from any thread (``/metrics``): racy, at most a step off."""
        batch, slots, partial = self.batch, list(self.slots), list(self._partial.values())
        held = sum(len(r.req.prompt_ids) + len(r.req.output_ids) for r in slots if r is not None and r.req is not None)
        buffers = 0 if batch is None else batch.nbytes
        rows = sum(t.numel() * t.element_size() for kv in partial for t in (*kv.keys, *kv.values))
        return min(buffers, held * per_token) + rows, buffers + rows

    def reset(self) -> None:
        """Drop every row and the KV cache (after a failed step); cached blocks stay, none
        referenced any more."""
        self.reset_batch()
        self._partial.clear()
        if self.blocks is not None:
            for blocks in self._held.values():
                self.blocks.release(blocks)
        self._held.clear()

    def lookup(self, req: SchedRequest) -> int:
        """A request joins the batch: start it from the longest cached chain of its prompt's
        blocks (at least its last token is computed, for its first logits). Sets
        ``req.num_computed``; returns the cached tokens (0: none)."""
        if self.blocks is None or req.num_computed:
            return 0
        blocks = self.blocks.match(req.prompt_ids, len(req.prompt_ids) - 1)
        if not blocks:
            return 0
        self._held[req.rid] = blocks
        self._partial[req.rid] = BlockCache.gather(blocks)
        req.num_computed = len(blocks) * self.blocks.block_size
        return req.num_computed

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Evict, decode the running rows one token, prefill the planned prompt chunks.

        Returns ``rid -> sampled token id`` for every decoded request and every request
        whose prompt is now fully prefilled, each sampled as its ``SchedRequest.sampling`` says.

        Raises:
            RuntimeError: the batch's rows do not match ``plan.decode``.
        """
        out: dict[int, int] = {}
        with torch.inference_mode():
            if plan.evict:
                self._evict(set(plan.evict))
            live = sorted(r.rid for r in self.slots if r is not None)
            if live != sorted(r.rid for r in plan.decode):
                raise RuntimeError(f"runner rows {live} do not match the plan {[r.rid for r in plan.decode]}")
            if plan.prefill and self.mixed and (plan.decode or self._flat_prefill()):
                out.update(self._mixed(plan.prefill, plan.spans))
            else:
                if plan.decode:
                    out.update(self._sample_slots(self._decode()))
                if plan.prefill:
                    out.update(self._prefill(plan.prefill, plan.spans))
            if self.slots:
                self.last = torch.tensor([self.pad_id if r is None else out[r.rid] for r in self.slots],
                                         device=self.device)
        return out

    # ---- steps -----------------------------------------------------------------------

    def _decoding(self) -> tuple[BatchKV, torch.Tensor, torch.Tensor]:
        """The decoding batch, its next position ids and last tokens (slots,), both long.

        Raises:
            RuntimeError: no request is decoding.
        """
        if self.batch is None or self.pos is None or self.last is None:
            raise RuntimeError("no request is decoding")
        return self.batch, self.pos, self.last

    def _decode(self) -> torch.Tensor:
        """One token for every slot; returns logits (slots, vocab)."""
        batch, pos, last = self._decoding()
        attn = batch.open_column()
        if self.lean_decode:
            logits = decode_step.decode(self.model, last[:, None], attn, pos[:, None], batch.cache)
        else:
            logits = self.model(input_ids=last[:, None], attention_mask=attn, position_ids=pos[:, None],
                                cache=batch.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        batch.close_column()
        self.pos = pos + 1
        return logits

    def _sample_slots(self, logits: torch.Tensor) -> dict[int, int]:
        """Sample the live slots' next tokens from their logits (slots, vocab)."""
        live = [i for i, r in enumerate(self.slots) if r is not None]
        rows = [r for r in self.slots if r is not None]
        return dict(zip([r.rid for r in rows], self._sample(logits if len(live) == len(self.slots) else logits[live],
                                                            rows)))

    def _chunks(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]):
        """Per planned chunk: its past KV (the prompt so far, cached blocks included), the
        first and end token to compute, and whether it starts the prompt."""
        pasts, starts, ends, fresh = [], [], [], []
        for r in reqs:
            start, end = spans[r.rid]
            past = self._partial.pop(r.rid, None) or RowsKV.empty()
            fresh.append(start == 0)
            pasts.append(past)
            starts.append(start)
            ends.append(end)
        return pasts, starts, ends, fresh

    def _finish_chunks(self, reqs, ends, fresh, kv: RowsKV, logits: torch.Tensor) -> dict[int, int]:
        """Keep unfinished prompts aside, remember new prefixes, sample and merge the rows
        whose prompt is done. ``kv`` holds every chunk's row (compacted); ``logits`` their
        last position."""
        done = [i for i, (r, e) in enumerate(zip(reqs, ends)) if e >= len(r.prompt_ids)]
        for i, r in enumerate(reqs):
            row = kv.select([i]).trim()
            if i not in done:
                self._partial[r.rid] = row
            elif self.blocks is not None:  # the whole prompt's KV: cache its blocks
                self.blocks.insert(r.prompt_ids, row, owner=r.owner)
        self._fit_cache()
        if not done:
            return {}
        rows = [_Row(reqs[i].rid, reqs[i].sampling, req=reqs[i]) for i in done]
        toks = self._sample(logits[done], rows)
        self._merge(rows, kv.select(done).trim(), torch.tensor([len(reqs[i].prompt_ids) for i in done],
                                                               device=self.device))
        return {row.rid: t for row, t in zip(rows, toks)}

    def _flat_prefill(self) -> bool:
        """Whether a step of prompt chunks alone runs as one flat sequence (:meth:`_mixed` with
        no decoding row) instead of the padded batch of :meth:`_prefill`: on the CPU, where
        padding is only work (each chunk padded to the longest and to the bucket: eight short
        prompts arriving together cost several times their tokens' worth)."""
        return self.batch is None and self.device.type == "cpu"

    def _mixed(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]) -> dict[int, int]:
        """Decode the running rows (if any) and prefill the planned chunks in ONE forward.

        On a CPU a decode step costs about one pass over the weights whatever the batch,
        so a separate prefill forward would cost the running rows a whole step. Here all
        new tokens (one per running row, then each chunk) form one flat sequence of batch 1
        for the linear layers; attention runs per segment (:mod:`pipeline.llm.runner.mixed_attention`):
        each row over its own past, each chunk over its past and itself.
        """
        decoding = self.batch is not None
        pasts, starts, ends, fresh = self._chunks(reqs, spans)
        b = len(self.slots) if decoding else 0
        lens = [e - s for s, e in zip(starts, ends)]
        dev = self.device
        ids = torch.tensor([x for r, s, e in zip(reqs, starts, ends) for x in r.prompt_ids[s:e]], device=dev)
        pos = torch.cat([torch.arange(s, e, device=dev) for s, e in zip(starts, ends)])
        if decoding:
            batch, last_pos, last_tok = self._decoding()
            ids, pos = torch.cat([last_tok, ids]), torch.cat([last_pos, pos])
        pad = -len(ids) % self.bucket  # a dummy segment rounds the step's length up (outputs unused)
        ids = torch.cat([ids, torch.full((pad,), self.pad_id, device=dev)])
        pos = torch.cat([pos, torch.arange(pad, device=dev)])
        cache = MixedCache(batch.cache if decoding else None,
                           batch.open_column() if decoding else torch.ones((0, 1), dtype=torch.bool, device=dev),
                           pasts + [RowsKV.empty()] * bool(pad), lens + [pad] * bool(pad))
        last = torch.tensor([b - 1 + sum(lens[: j + 1]) for j in range(len(reqs))], device=dev)
        keep = torch.cat([torch.arange(b, device=dev), last])
        if self.lean_decode:
            logits = decode_step.mixed(self.model, ids[None], pos[None], cache, keep)
        else:
            logits = self.model(input_ids=ids[None], attention_mask=_NO_MASK, position_ids=pos[None], cache=cache,
                                use_cache=True, logits_to_keep=keep, voxpipe_mixed=cache).logits[0]
        out = {}
        if decoding:
            batch.close_column()
            self.pos = last_pos + 1
            out = self._sample_slots(logits[:b])
        offs = [sum(lens[:j]) for j in range(len(reqs))]
        rows = [RowsKV([torch.cat([p.keys[i], k[:, :, o : o + n]], dim=2) if p.keys else k[:, :, o : o + n]
                     for i, k in enumerate(cache.new_keys)],
                    [torch.cat([p.values[i], v[:, :, o : o + n]], dim=2) if p.values else v[:, :, o : o + n]
                     for i, v in enumerate(cache.new_values)],
                    torch.ones((1, p.columns + n), dtype=torch.long, device=dev))
                for p, o, n in zip(pasts, offs, lens)]
        out.update(self._finish_chunks(reqs, ends, fresh, RowsKV.cat(rows), logits[b:]))
        return out

    def _prefill(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One padded forward over every planned chunk. Row i's columns are
        [padding][its past KV][padding][its chunk]: each row sees only its own tokens."""
        from transformers import DynamicCache

        pasts, starts, ends, fresh = self._chunks(reqs, spans)
        past = RowsKV.cat(pasts)
        n, tp = len(reqs), past.columns
        c = max(e - s for s, e in zip(starts, ends))
        c += -c % self.bucket  # left padding up to the bucket: fewer distinct shapes
        ids = torch.full((n, c), self.pad_id, dtype=torch.long)
        chunk = torch.zeros((n, c), dtype=torch.long)
        pos = torch.zeros((n, c), dtype=torch.long)
        for i, (r, s, e) in enumerate(zip(reqs, starts, ends)):
            ids[i, c - (e - s) :] = torch.tensor(r.prompt_ids[s:e])
            pos[i, c - (e - s) :] = torch.arange(s, e)
            chunk[i, c - (e - s) :] = 1
        ids, pos = ids.to(self.device), pos.to(self.device)
        attn = torch.cat([past.attn, chunk.to(self.device)], dim=1)
        cache = DynamicCache(ddp_cache_data=list(zip(past.keys, past.values)) if tp else None,
                             config=self.model.config)
        res = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        kv = RowsKV(*_layer_kv(cache), attn)
        return self._finish_chunks(reqs, ends, fresh, kv.zero_padding().compact(), res.logits[:, -1])

    # ---- prefix cache ------------------------------------------------------------------

    def _fit_cache(self) -> None:
        """Keep the block cache within :attr:`cache_limit` (least recently used first)."""
        if self.blocks is not None and self.cache_limit is not None:
            self.blocks.fit(self.cache_limit)

    def _cache_leaving(self, slot: int, row: _Row) -> None:
        """A request leaves the batch: cache its KV (prompt + the tokens it generated and fed
        back: the reply so far) and give back the blocks it started from."""
        req, blocks = row.req, self.blocks
        if blocks is None:
            return
        held = self._held.pop(row.rid, None)
        if held:
            blocks.release(held)
        if req is None or self.batch is None:
            return
        tokens = req.prompt_ids[: req.prompt_len or len(req.prompt_ids)] + req.output_ids
        kv = self.batch.row(slot)
        blocks.insert(tokens[: kv.columns], kv, owner=req.owner)

    # ---- batch bookkeeping -------------------------------------------------------------

    def _merge(self, rows: list[_Row], new: RowsKV, pos: torch.Tensor) -> None:
        """Put the rows of ``new`` (prompts just prefilled) into free or new slots."""
        if self.batch is None or self.pos is None:
            self.batch, self.slots, self.pos = BatchKV(new, self.model.config), list(rows), pos
            return
        free = [i for i, r in enumerate(self.slots) if r is None]
        taken = []
        for row in rows:
            i = free.pop(0) if free else len(self.slots)
            if i == len(self.slots):
                self.slots.append(None)
            self.slots[i] = row
            taken.append(i)
        self.batch.put(taken, new)
        grown = torch.zeros(len(self.slots), dtype=self.pos.dtype, device=self.device)
        grown[: len(self.pos)] = self.pos
        grown[taken] = pos
        self.pos = grown

    def _evict(self, rids: set[int]) -> None:
        decoding = {r.rid for r in self.slots if r is not None}
        for rid in rids:
            self._partial.pop(rid, None)
            held = None if rid in decoding else self._held.pop(rid, None)
            if held and self.blocks is not None:  # it left while its prompt was being prefilled
                self.blocks.release(held)
        gone = [i for i, r in enumerate(self.slots) if r is not None and r.rid in rids]
        if not gone:
            return
        for i in gone:
            row = self.slots[i]
            assert row is not None
            self._cache_leaving(i, row)
            self.slots[i] = None
        self._fit_cache()
        live = [i for i, r in enumerate(self.slots) if r is not None]
        if not live:
            self.reset_batch()
            return
        batch, pos, last = self._decoding()
        if 2 * len(live) <= len(self.slots):  # mostly free slots: stop decoding them
            order = batch.compact(live)
            self.slots = [self.slots[i] for i in order]
            self.pos, self.last = pos[order], last[order]
            live = list(range(len(order)))
        batch.trim(live)

    def reset_batch(self) -> None:
        """Drop the decoding batch (every slot free)."""
        self.slots, self.batch, self.pos, self.last = [], None, None, None

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Next token per row from logits (rows, vocab) in the model's dtype: greedy argmax
        (:func:`~pipeline.llm.runner.greedy.argmax`), else sampled in fp32."""
        toks = greedy.argmax(logits)
        for i, row in enumerate(rows):
            p = row.sampling
            if p.temperature > 0:
                if row.gen is None:
                    row.gen = torch.Generator(device="cpu").manual_seed(p.seed)
                toks[i] = _sample_row(logits[i].float().cpu(), p, row.gen)
        return toks


def _layer_kv(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values of a filled transformers ``DynamicCache``.

    Raises:
        RuntimeError: a layer holds no keys/values (it was never updated).
    """
    keys, values = [], []
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or getattr(layer, "values", None) is None:
            raise RuntimeError(f"cache layer {type(layer).__name__} holds no keys/values")
        keys.append(layer.keys)
        values.append(layer.values)
    return keys, values


_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)
"""A mixed forward's attention masks are built per segment (:class:`MixedCache`); the model
is handed this ready-made 4-D mask so that it builds none of its own."""


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sorted_p, 0) - sorted_p) < p.top_p
        keep[0] = True  # the most likely token always stays (top_p → 0 is greedy, never 0/0)
        sorted_p = sorted_p * keep
        return int(idx[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))
