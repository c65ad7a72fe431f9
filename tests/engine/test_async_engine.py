"""AsyncEngine on uvloop: concurrent streams, cancellation part-way, abort, a failing step, idle wake-up."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import uvloop

from tinypaged import LLM, RequestOutputKind, SamplingParams
from tinypaged.engine.frontend.async_engine import AsyncEngine
from tinypaged.errors import EngineError, RequestError
from tinypaged.outputs import RequestOutput


@pytest.fixture
def aengine(llm: LLM) -> AsyncEngine:
    """An AsyncEngine over the session's idle LLMEngine (one model load for the whole suite)."""
    assert not llm.engine.has_unfinished_requests()
    return AsyncEngine(llm.config, engine=llm.engine)


def _clean(engine: AsyncEngine) -> None:
    engine.engine.check_integrity()  # (its loop has stopped: the LLMEngine's own check)
    stats = engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert not engine.engine.has_unfinished_requests()


async def _consume(engine: AsyncEngine, i: int, params: SamplingParams, cancel_after: int | None):
    outs: list[RequestOutput] = []
    stream = engine.generate(f"Story number {i}: once", params, f"req-{i}")
    async for out in stream:
        outs.append(out)
        if cancel_after is not None and len(outs) >= cancel_after:
            if i % 4 == 1:
                await stream.aclose()  # the client closes the iterator
            else:
                raise asyncio.CancelledError  # the client's task is cancelled mid-stream
    return outs


def test_fifty_streams_half_cancelled(aengine: AsyncEngine, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate([f"Story number {i}: once" for i in range(0, 50, 2)], params)

    async def main() -> list:
        await aengine.start()
        tasks = [
            asyncio.create_task(_consume(aengine, i, params, cancel_after=3 if i % 2 else None))
            for i in range(50)
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(100):  # the aborts are applied by the loop between steps
            if aengine.stats().num_free_gpu_blocks == aengine.stats().num_gpu_blocks:
                break
            await asyncio.sleep(0.01)
        assert aengine.stats().num_running == 0
        await aengine.shutdown()
        return results

    results = uvloop.run(main())
    for i, res in enumerate(results):
        if i % 2:
            continue
        assert not isinstance(res, BaseException), res
        assert res[-1].finished and res[-1].outputs[0].token_ids == want[i // 2].outputs[0].token_ids
        texts = [o.outputs[0].text for o in res]
        assert all(texts[k + 1].startswith(texts[k]) for k in range(len(texts) - 1))  # cumulative
    _clean(aengine)
    stats = aengine.stats()
    assert stats.generation_tokens_total > 0 and stats.prompt_tokens_total > 0


def test_final_only_streams_yield_once_and_cancel_cleanly(aengine: AsyncEngine, llm: LLM) -> None:
    """A FINAL_ONLY request streams its finished output alone (LLM.generate's, the same); one cancelled
    before it finishes, while nothing has reached its client yet, still frees its blocks."""
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    want = llm.generate([f"Story number {i}: once" for i in range(6)], params)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, output_kind=params.output_kind)

    async def main() -> tuple[list, list]:
        await aengine.start()
        done = await asyncio.gather(*(_consume(aengine, i, params, None) for i in range(6)))
        cancelled = [asyncio.create_task(_consume(aengine, 100 + i, long, None)) for i in range(4)]
        for _ in range(1000):
            if aengine.stats().num_running == 4:
                break
            await asyncio.sleep(0.01)
        assert aengine.stats().num_running == 4
        for task in cancelled:
            task.cancel()
        results = await asyncio.gather(*cancelled, return_exceptions=True)
        for _ in range(100):  # the aborts are applied by the loop between steps
            if aengine.stats().num_free_gpu_blocks == aengine.stats().num_gpu_blocks:
                break
            await asyncio.sleep(0.01)
        await aengine.shutdown()
        return done, results

    done, results = uvloop.run(main())
    for outs, ref in zip(done, want, strict=True):
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[0].outputs[0].text == ref.outputs[0].text
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    _clean(aengine)


def test_abort_error_and_bad_input(aengine: AsyncEngine, monkeypatch) -> None:
    engine = aengine.engine
    real = engine.runner.execute

    def flaky(out, *rest):  # noqa: ANN001, ANN002
        if any(s.request_id == "doomed" for s in out.scheduled):
            raise RuntimeError("injected failure")
        return real(out, *rest)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main() -> None:
        await aengine.start()
        with pytest.raises(RequestError, match="empty"):
            async for _ in aengine.generate("", long, "bad"):
                pass
        with pytest.raises(RequestError, match="max_num_seqs") as err:
            async for _ in aengine.generate("x", SamplingParams(n=1000), "bad2"):
                pass
        assert err.value.param == "n"

        async def doomed() -> None:
            async for _ in aengine.generate("This one fails", long, "doomed"):
                pass

        async def aborted() -> RequestOutput:
            last = None
            async for out in aengine.generate("This one is aborted", long, "aborted"):
                last = out
                if len(out.outputs[0].token_ids) == 2:
                    await aengine.abort("aborted")
            assert last is not None
            return last

        async def fine() -> RequestOutput:
            last = None
            async for out in aengine.generate(
                "This one is fine", SamplingParams(n=2, temperature=1.0, max_tokens=10), "fine"
            ):
                last = out
            assert last is not None
            return last

        # A failing step fails the requests in it (they share its forward pass); the loop goes on. The client
        # learns that it failed, not the fault's text (that is logged).
        with pytest.raises(EngineError, match="internal error") as err:
            await doomed()
        assert "injected" not in str(err.value)
        res = await asyncio.gather(aborted(), fine())
        assert res[0].finished and res[0].outputs[0].finish_reason == "abort"
        assert res[1].finished and len(res[1].outputs) == 2
        # Idle now: the loop sleeps, and wakes for a new request.
        await asyncio.sleep(0.05)
        outs = [o async for o in aengine.generate("Wake up", SamplingParams(max_tokens=2), "late")]
        assert outs[-1].finished
        await aengine.shutdown()
        with pytest.raises(EngineError):
            async for _ in aengine.generate("x", long, "after"):
                pass

    uvloop.run(main())
    _clean(aengine)


def test_slow_consumer_gets_merged_outputs(aengine: AsyncEngine, llm: LLM) -> None:
    """A stream read slower than the engine steps skips the cumulative outputs it was too late for: fewer
    outputs than tokens, the same final result, and the text of every output extends the previous one."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate(["Story number 7: once"], params)[0]

    async def main() -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        async for out in aengine.generate("Story number 7: once", params, "slow"):
            outs.append(out)
            await asyncio.sleep(0.4)  # several steps of the default model on the CPU
        await aengine.shutdown()
        return outs

    outs = uvloop.run(main())
    final = outs[-1]
    assert final.finished and final.outputs[0].token_ids == want.outputs[0].token_ids
    assert final.outputs[0].text == want.outputs[0].text
    assert 1 < len(outs) < len(want.outputs[0].token_ids)
    for before, after in itertools.pairwise(outs):
        assert after.outputs[0].text.startswith(before.outputs[0].text)
        assert len(after.outputs[0].token_ids) > len(before.outputs[0].token_ids)
    _clean(aengine)


def test_snapshot_is_taken_between_steps_and_fails_once_the_loop_stops(
    aengine: AsyncEngine, monkeypatch
) -> None:
    """Snapshots (and integrity checks) are taken by the loop task, never while a step runs in the worker
    thread; viewers asking together share one; a viewer gone takes nothing; a failing one fails its viewer only;
    after shutdown a snapshot is an EngineError."""
    engine = aengine.engine
    in_step = threading.Event()
    taken = []
    broken = [True]  # the first snapshot fails
    real_step, real_snapshot = engine.step, engine.snapshot

    def step():  # noqa: ANN202
        in_step.set()
        try:
            return real_step()
        finally:
            in_step.clear()

    def snapshot():  # noqa: ANN202
        assert not in_step.is_set(), "a snapshot taken while a step runs"
        if broken:
            broken.pop()
            raise RuntimeError("broken view")
        taken.append(real_snapshot())
        return taken[-1]

    def check_integrity():  # noqa: ANN202
        assert not in_step.is_set(), "an integrity check while a step runs"
        checked.append(True)
        real_check()

    checked: list[bool] = []
    real_check = engine.check_integrity
    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "snapshot", snapshot)
    monkeypatch.setattr(engine, "check_integrity", check_integrity)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)

    async def main(seen: list) -> None:
        with pytest.raises(RuntimeError, match="broken view"):
            await aengine.snapshot()
        assert aengine.is_running  # a failed snapshot is its viewer's: the loop goes on
        idle = await aengine.snapshot()
        assert not idle.cache.gpu.holders and idle.stats.num_free_gpu_blocks == idle.stats.num_gpu_blocks
        run = asyncio.create_task(_drain(aengine.generate("A story about blocks", params, "viewed")))
        while not run.done():
            first, second = await asyncio.gather(aengine.snapshot(), aengine.snapshot())
            assert first is second  # asked together: one snapshot
            seen.append(first)
            await aengine.check_integrity()  # taken between steps too
            gone = asyncio.create_task(aengine.snapshot())
            await asyncio.sleep(0)
            gone.cancel()  # its viewer left before the loop got to it
        await run
        busy = [s for s in seen if s.cache.gpu.holders]
        assert busy and all(set(s.cache.gpu.holders.values()) == {("viewed",)} for s in busy)
        for s in seen:  # the cache and the stats of one moment
            assert s.cache.gpu.ref_counts.count(0) == s.stats.num_free_gpu_blocks
        await aengine.shutdown()
        with pytest.raises(EngineError):
            await aengine.snapshot()

    seen: list = []
    uvloop.run(main(seen))
    assert len(taken) == 1 + len(seen)  # the idle one, one per pair; a viewer gone costs none
    assert len(checked) == len(seen)
    _clean(aengine)


async def _drain(stream) -> None:  # noqa: ANN001
    async for _ in stream:
        pass
