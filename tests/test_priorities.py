"""Latency-critical work first: the stage queues' priorities, partial transcripts held
while other users wait for their reply, and admission's count of those users.
Orchestration only: scripted workers and the fake ASR (no models)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from pipeline.asr.engine import AsrEngine
from pipeline.asr.turn import AsrTurn
from pipeline.asr.types import AsrRequest, DecodeRequest
from pipeline.config import AdmissionConfig, AsrConfig
from pipeline.errors import Busy
from pipeline.serving.admission import Admission, Load
from pipeline.serving.types import StageLoad
from pipeline.worker import BatchWorker
from tests.fakes import FakeAsr, tone


class Recorder(BatchWorker[str, str]):
    """Records each batch; the first batch blocks until ``gate`` is set, so that the
    test can queue work behind it."""

    def __init__(self, *, max_batch_size: int = 8, queue_size: int = 64) -> None:
        super().__init__("rec", queue_size=queue_size, max_batch_size=max_batch_size, max_wait_ms=0)
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.busy = threading.Event()  # a batch is being processed

    def priority(self, item: str) -> int:
        return 0 if item.startswith("urgent") else 1

    def process_batch(self, items: list[str]) -> list[str | BaseException]:
        self.busy.set()
        self.gate.wait(timeout=30)
        self.batches.append(list(items))
        return [i.upper() for i in items]


async def _queued_behind_a_running_batch(worker: Recorder, items: list[str], **kw) -> list[str]:
    worker.start()
    try:
        first = worker.submit("blocker")
        await asyncio.to_thread(worker.busy.wait, 30)  # the worker holds the blocker: the rest queues
        futs = [worker.submit(i, **kw) for i in items]
        worker.gate.set()
        return [*await asyncio.gather(first, *futs)][1:]
    finally:
        await asyncio.to_thread(worker.stop)


def test_urgent_items_are_served_first_and_batch_only_with_urgent_ones():
    w = Recorder()
    items = ["partial-a", "urgent-1", "partial-b", "urgent-2", "partial-c"]
    results = asyncio.run(_queued_behind_a_running_batch(w, items))
    assert results == [i.upper() for i in items]  # every caller gets its own result
    assert w.batches[0] == ["blocker"]
    assert w.batches[1] == ["urgent-1", "urgent-2"]  # urgent first, in arrival order, alone
    assert w.batches[2] == ["partial-a", "partial-b", "partial-c"]


def test_an_explicit_priority_overrides_the_items_own():
    w = Recorder(max_batch_size=1)

    async def main() -> None:
        w.start()
        try:
            first = w.submit("blocker")
            await asyncio.to_thread(w.busy.wait, 30)
            later = w.submit("x-later", priority=1)
            now = w.submit("x-now", priority=0)
            w.gate.set()
            await asyncio.gather(first, later, now)
        finally:
            await asyncio.to_thread(w.stop)

    asyncio.run(main())
    assert [b[0] for b in w.batches] == ["blocker", "x-now", "x-later"]


def test_the_queue_bound_still_refuses_with_busy():
    w = Recorder(queue_size=2)

    async def main() -> None:
        w.submit("a")
        w.submit("b")
        try:
            w.submit("urgent-c")
        except Busy:
            return
        raise AssertionError("a full queue must refuse")

    asyncio.run(main())


def test_stop_waits_for_queued_work_even_when_it_is_less_urgent():
    w = Recorder()

    async def main() -> list[str]:
        w.start()
        futs = [w.submit("partial-x"), w.submit("urgent-y")]
        w.gate.set()
        out = await asyncio.gather(*futs)
        await asyncio.to_thread(w.stop)
        return out

    assert asyncio.run(main()) == ["PARTIAL-X", "URGENT-Y"]
    assert not w._threads


def test_asr_priorities_put_finals_catch_ups_and_utterances_before_partials():
    asr = AsrEngine.__new__(AsrEngine)  # priority() reads the item only: no model needed
    audio = np.zeros(1600, np.float32)
    assert asr.priority(DecodeRequest(audio=audio)) == 1
    assert asr.priority(DecodeRequest(audio=audio, final=True)) == 0
    assert asr.priority(DecodeRequest(audio=audio, urgent=True)) == 0
    assert asr.priority(AsrRequest(audio=audio)) == 0


async def _stream(turn: AsrTurn, seconds: float) -> None:
    for _ in range(int(seconds * 10)):  # 100 ms frames, as fast as the loop allows
        turn.feed(tone(100))
        await asyncio.sleep(0.01)


def test_partials_are_held_while_others_wait_but_not_longer_than_the_cap():
    cfg = AsrConfig(min_chunk_ms=200)
    held = {"on": True}

    async def main() -> tuple[FakeAsr, AsrTurn]:
        asr = FakeAsr()
        parts: list[str] = []

        async def on_partial(p) -> None:
            parts.append(p.text)

        turn = AsrTurn(asr, cfg, language=None, on_partial=on_partial, spawn=asyncio.create_task,
                       hold=lambda: 600_000.0 if held["on"] else 0.0)
        await _stream(turn, 2.0)
        assert asr.requests == [] and turn.held > 0  # held: no partial decode was spent
        held["on"] = False
        await _stream(turn, 0.5)
        for _ in range(200):
            if asr.requests:
                break
            await asyncio.sleep(0.01)
        assert asr.requests, "partials resume once nobody waits"
        turn.end_input()
        held["on"] = True
        final = await turn.finish()  # the final decode is never held
        assert final.text
        assert any(isinstance(r, DecodeRequest) and r.final for r in asr.requests)
        return asr, turn

    asyncio.run(main())


def test_a_held_stream_still_updates_after_the_cap():
    cfg = AsrConfig(min_chunk_ms=200)

    async def main() -> FakeAsr:
        asr = FakeAsr()

        async def on_partial(p) -> None:
            pass

        turn = AsrTurn(asr, cfg, language=None, on_partial=on_partial, spawn=asyncio.create_task,
                       hold=lambda: 300.0)
        deadline = asyncio.get_running_loop().time() + 30
        while not asr.requests and asyncio.get_running_loop().time() < deadline:
            await _stream(turn, 0.5)
        turn.close()
        return asr

    asr = asyncio.run(main())
    assert asr.requests and not asr.requests[0].final  # a partial got through the hold


def test_admission_counts_users_waiting_for_their_first_audio():
    adm = Admission(AdmissionConfig(slo_ms=2000))
    a, b, c = object(), object(), object()
    for key in (a, b, c):
        assert adm.decide(Load(), spoken=True, end_silence_ms=500, kv_tokens=10, now=0.0, key=key) is None
    assert adm.critical(0.0) == 3
    adm.release(a)  # its LLM request was queued: still waiting for audio
    assert adm.critical(0.1) == 3
    adm.observe(a, 900.0)  # first audio
    adm.forget(b)  # ended without a reply
    assert adm.critical(0.2) == 1
    assert adm.critical(2 * 2.0 + 0.01) == 0  # an entry whose end was missed expires
    adm.decide(Load(), spoken=True, end_silence_ms=500, kv_tokens=10, now=10.0, count=False)
    assert adm.critical(10.0) == 0  # a look-ahead without a key holds no place
    spec = object()
    admitted = adm.admitted
    adm.decide(Load(), spoken=True, end_silence_ms=500, kv_tokens=10, now=10.0, count=False, key=spec)
    assert adm.critical(10.0) == 1 and adm.admitted == admitted  # a speculation holds one, uncounted
    adm.forget(spec)  # dropped (the user went on speaking)
    assert adm.critical(10.0) == 0 and adm.pending(10.0) == 0


def test_only_urgent_work_counts_as_what_an_urgent_item_waits_behind():
    w = Recorder()

    async def main() -> tuple[int, int]:
        w.submit("partial-a")
        w.submit("partial-b")
        w.submit("urgent-c")
        return w.depth, w.urgent_depth

    assert asyncio.run(main()) == (3, 1)


def test_a_workers_load_snapshot_holds_its_depths_and_zeros_elsewhere():
    w = Recorder()

    async def main() -> StageLoad:
        w.submit("partial-a")
        w.submit("urgent-c")
        return w.load()

    assert asyncio.run(main()) == StageLoad(depth=2, urgent_depth=1)


def test_urgent_work_whose_caller_stopped_waiting_is_not_counted():
    # a turn that went on cancels its final decode: the worker skips it, so admission
    # must not count it as work that the next turn waits behind
    w = Recorder()

    async def main() -> tuple[int, int, int]:
        dropped = w.submit("urgent-a")
        w.submit("urgent-b")
        before = w.urgent_depth
        dropped.cancel()
        return before, w.urgent_depth, w.depth

    assert asyncio.run(main()) == (2, 1, 2)


def test_the_silence_already_gone_is_not_scaled_by_the_correction():
    a = Admission(AdmissionConfig(slo_ms=2000))
    for i in range(20):  # every turn's service took twice its prediction
        k = f"k{i}"
        a.decide(Load(), spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0, key=k)
        service = a.predict_ms(Load(), spoken=True, end_silence_ms=500) - 500
        a.release(k)
        a.observe(k, 500 + 2 * service, now=0.0)
    raw = a.predict_ms(Load(), spoken=True, end_silence_ms=500)
    assert abs(a.correction.value - 2.0) < 1e-9
    assert abs(a.corrected_ms(Load(), spoken=True, end_silence_ms=500) - (500 + 2 * (raw - 500))) < 1e-6


def test_best_effort_batches_are_kept_small_so_urgent_work_waits_less():
    class Small(Recorder):
        def batch_limit(self, priority: int) -> int:
            return self.max_batch_size if priority == 0 else 2

    w = Small()
    items = [f"partial-{i}" for i in range(5)] + ["urgent-a", "urgent-b", "urgent-c"]
    asyncio.run(_queued_behind_a_running_batch(w, items))
    assert w.batches[1] == ["urgent-a", "urgent-b", "urgent-c"]  # urgent ones batch whole
    assert [len(b) for b in w.batches[2:]] == [2, 2, 1]


def test_the_gate_holds_partials_longer_while_the_server_refuses_turns():
    from pipeline.config import VoxpipeConfig
    from pipeline.session.gate import TurnGate
    from tests.fakes import fake_engines

    cfg = VoxpipeConfig()
    adm = Admission(cfg.admission)
    gate = TurnGate(adm, fake_engines(), cfg, "s")
    assert gate.hold_ms() == 0.0  # nobody waits: live transcripts flow
    adm.decide(Load(), spoken=True, end_silence_ms=500, kv_tokens=1, now=time.monotonic(), key="waiting")
    assert gate.hold_ms() == cfg.asr.partial_hold_max_ms
    assert adm.decide(Load(llm_running=1, llm_step_ms=10_000.0), spoken=True, end_silence_ms=500, kv_tokens=1,
                      now=time.monotonic()) is not None  # refused: overloaded
    assert gate.hold_ms() == cfg.asr.partial_hold_overload_ms
    assert not adm.overloaded(time.monotonic() + cfg.admission.overload_s + 0.1)
