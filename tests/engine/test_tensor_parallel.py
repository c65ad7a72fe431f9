"""Tensor parallelism on the CPU (gloo): the default model (9 heads, 3 KV heads) split over 3 ranks gives the
outputs of one rank, with preemption by swap and by recompute, n > 1, beam search, logprobs and prefix caching;
rank 2 joins as a worker of another node would (`tinypaged worker` through MASTER_ADDR/MASTER_PORT); a worker
that hangs fails the engine within seconds. (The server over a tensor-parallel engine, prompt logprobs, and a
worker killed under it: tests/server/test_tp_server.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop

from tinypaged import LLM, SamplingParams
from tinypaged.engine.device import executor
from tinypaged.engine.frontend.async_engine import AsyncEngine
from tinypaged.errors import EngineDeadError

WORDS = "the a river mountain quickly blue seven engine paged memory block table copy write token".split()
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Greedy prompts (several with a shared prefix), then groups of several sequences: the latest arrivals are
# preempted first, and groups of several sequences are swapped out, single ones recomputed.
PROMPTS: list[tuple[str, SamplingParams]] = [
    ("The capital of France is", GREEDY),
    (" ".join(WORDS * 2) + " one", GREEDY),
    (
        " ".join(WORDS * 2) + " two",
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
    ),
    ("def fibonacci(n):", GREEDY),
    ("Write a haiku about memory:", SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12)),
    (
        "Paged attention splits the cache into",
        SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=8),
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp3(model_dir: Path) -> Iterator[tuple[LLM, subprocess.Popen[bytes]]]:
    """TP=3 over a cache small enough to preempt, with prefix caching: ranks 0 and 1 on this "node"
    (LOCAL_WORLD_SIZE=2), rank 2 started apart, as on another node."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "LOCAL_WORLD_SIZE": "2"}
    remote = subprocess.Popen(
        [sys.executable, "-P", "-m", "tinypaged.cli", "worker", "--rank", "2"], env=os.environ | env
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        llm = LLM(
            model=model_dir,
            tensor_parallel_size=3,
            block_size=4,
            num_gpu_blocks_override=16,
            swap_space=0.05,
            enable_prefix_caching=True,
        )
    yield llm, remote
    llm.shutdown()  # the stop reaches rank 2 too
    assert remote.wait(10) is not None
    assert not any(_alive(pid) for pid in llm.engine.executor.worker_pids.values())


def _alive(pid: int) -> bool:
    """Whether a process with this id exists (our children are reaped once they end)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tokens(outs: list) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outs]


def test_outputs_equal_one_rank_under_preemption(tp3, llm: LLM, generate_with_stats) -> None:
    engine = tp3[0].engine
    prompts, params = [p for p, _ in PROMPTS], [sp for _, sp in PROMPTS]
    want = llm.generate(prompts, params)
    got, steps = generate_with_stats(engine, prompts, params)
    assert _tokens(got) == _tokens(want)
    sched = engine.scheduler
    print(f"\nTP=3: {sched.num_preemptions} preemptions ({sched.num_swap_outs} by swap), {len(steps)} steps")
    assert sched.num_swap_outs > 0 and any(s.num_blocks_swapped_in for s in steps)  # by swap
    assert sched.num_preemptions > sched.num_swap_outs  # and by recompute
    # The logprobs agree to float32 rounding (three ranks sum their partial products in another order).
    for a, b in zip(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    engine.check_integrity()
    stats = engine.stats()
    assert (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )


def test_prefix_cache_hits(tp3, llm: LLM) -> None:
    engine = tp3[0].engine
    prompt = " ".join(WORDS * 3)  # several full blocks
    first = tp3[0].generate(prompt + " first", GREEDY)
    hits = engine.stats().prefix_cache_hits_total
    second = tp3[0].generate(prompt + " second", GREEDY)
    assert engine.stats().prefix_cache_hits_total > hits
    assert _tokens(first + second) == _tokens(llm.generate([prompt + " first", prompt + " second"], GREEDY))


def test_a_hung_worker_fails_the_engine(tp3, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP rank 2 (a worker of "another node": nothing here can kill it) mid-stream: its heartbeat stops,
    the stream ends with EngineDeadError naming it within seconds although rank 0's step waits on it still (a
    gloo collective), and the engine refuses new requests. Last in this module: the engine is dead after it."""
    llm, remote = tp3
    monkeypatch.setattr(executor, "HEARTBEAT_TIMEOUT_S", 2.0)
    aengine = AsyncEngine(llm.config, engine=llm.engine)

    async def main() -> tuple[float, BaseException | None, BaseException | None]:
        stream = aengine.generate("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True), "hang")
        await anext(stream)
        t0 = time.monotonic()
        os.kill(remote.pid, signal.SIGSTOP)
        error = later = None
        try:
            async for _ in stream:
                pass
        except EngineDeadError as e:
            error = e
        took = time.monotonic() - t0
        try:
            aengine.generate("again", GREEDY, "again")
        except EngineDeadError as e:
            later = e
        remote.kill()  # the step still waiting on rank 2 returns, and the engine can shut down
        await aengine.shutdown()
        return took, error, later

    took, error, later = uvloop.run(main())
    assert error is not None and "worker 2 sent no heartbeat" in str(error), error
    assert took < 10, took
    assert later is not None and "worker 2" in str(later)
    with pytest.raises(EngineDeadError, match="worker 2"):
        llm.generate("and again", GREEDY)
    # The driver killed the worker it had started.
    pids = llm.engine.executor.worker_pids
    assert not any(_alive(pid) for pid in pids.values())
