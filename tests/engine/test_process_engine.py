"""ProcessEngine: the engine core in a process of its own. Its streams give what the in-process engine gives
(greedy, seeded samples, logprobs, stop strings, beams), cancelled and aborted requests free their blocks in
the core, refusals name their parameter, and a core that dies fails every stream within seconds."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import uvloop

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.engine.frontend.process_engine import ProcessEngine
from tinypaged.engine.frontend.wire import LOGPROB_CHUNK, DeltaDecoder, DeltaEncoder, Outputs, decode, encode
from tinypaged.engine.step.stats import EngineStats
from tinypaged.errors import EngineDeadError, EngineError, RequestError
from tinypaged.outputs import CompletionOutput, Logprob, RequestOutput
from tinypaged.sampling_params import StructuredOutputsParams

PROMPTS = ["Story number 1: once", "The capital of France is", "List three colors:", "def fib(n):"]
CASES = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=3, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=24, stop=[" the", "\n\n"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1),
    SamplingParams(temperature=0.8, seed=3, best_of=3, n=2, max_tokens=10),
    SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=8, temperature=0.0),
]


def _core(model_dir: Path) -> ProcessEngine:
    return ProcessEngine(EngineConfig(model=model_dir, seed=0))


async def _collect(
    engine: ProcessEngine, prompt: str, params: SamplingParams, rid: str
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


async def _idle(engine: ProcessEngine) -> None:
    """Wait until the core holds no request and every KV block is free, then check its invariants."""
    for _ in range(500):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks:
            break
        await asyncio.sleep(0.01)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0, stats
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks, stats
    await engine.check_integrity()


def _fields(out: RequestOutput) -> tuple:
    outputs = [
        (o.index, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.finish_reason, o.stop_reason)
        for o in out.outputs
    ]
    return out.prompt, out.prompt_token_ids, outputs, out.finished, out.error, out.prompt_logprobs


def _same(a: object, b: object) -> bool:
    """Equal, floats to 1e-4: another batch composition rounds the logits otherwise on the CPU too."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-4, abs=1e-4)
    if isinstance(a, Logprob) and isinstance(b, Logprob):
        return _same(a.logprob, b.logprob) and (a.rank, a.decoded_token) == (b.rank, b.decoded_token)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_streams_match_the_in_process_engine(model_dir: Path, llm: LLM) -> None:
    """Every case's final output equals LLM.generate's, field by field (metrics aside, logprobs to 1e-4: the
    batches differ); the streamed outputs
    of a request whose outputs only grow each extend the one before."""
    jobs = [
        (f"r{i}-{k}", prompt, params) for k, params in enumerate(CASES) for i, prompt in enumerate(PROMPTS)
    ]
    want = {rid: llm.generate([prompt], params)[0] for rid, prompt, params in jobs}
    engine = _core(model_dir)

    async def main() -> dict[str, list[RequestOutput]]:
        await engine.start()
        streams = await asyncio.gather(*(_collect(engine, p, params, rid) for rid, p, params in jobs))
        await _idle(engine)
        await engine.shutdown()
        return dict(zip([rid for rid, _, _ in jobs], streams, strict=True))

    got = uvloop.run(main())
    for rid, _, params in jobs:
        outs = got[rid]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert _same(_fields(outs[-1]), _fields(want[rid])), (rid, params)
        if params.use_beam_search or params.num_seqs > params.n:
            continue
        for before, after in itertools.pairwise(outs):
            for b, a in zip(before.outputs, after.outputs, strict=False):
                assert a.token_ids[: len(b.token_ids)] == b.token_ids and a.text.startswith(b.text)
    assert engine.stats().generation_tokens_total > 0


def test_deltas_rebuild_every_output() -> None:
    """The wire's deltas rebuild each output exactly, through a message, whether it grows, its text is
    rewritten (tokens only ever append unless the outputs go whole), a sequence is added, or the request's
    outputs go whole (beams)."""

    def out(rid: str, seqs: list[tuple[str, int]], finished: bool = False, plp: int = 0) -> RequestOutput:
        outputs = [
            CompletionOutput(
                i,
                text,
                list(range(100 * i, 100 * i + n)),
                -0.5 * n,
                [{t: Logprob(-1.0, 1, str(t))} for t in range(n)],
                "length" if finished else None,
                None,
            )
            for i, (text, n) in enumerate(seqs)
        ]
        prompt_lps = [None] + [{5: Logprob(-2.0, 3, "x")}] * plp if plp else None
        return RequestOutput(rid, "p", [1, 2], outputs, finished, prompt_logprobs=prompt_lps)

    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    history = {
        "grows": [
            out("grows", [("a", 1)], plp=1),
            out("grows", [("ab", 2), ("x", 1)], plp=2),
            out("grows", [("abc", 3 + 2 * LOGPROB_CHUNK), ("xy", 2)], True, 2),  # logprobs in 3 chunks
        ],
        "rewritten": [
            out("rewritten", [("hello", 1)]),
            out("rewritten", [("help", 2)]),
            out("rewritten", [("help!", 3)], True),
        ],
        "beams": [
            out("beams", [("ab", 2), ("ac", 2)]),
            out("beams", [("acd", 3), ("a", 1)]),
            out("beams", [("abde", 4)], True),
        ],
    }
    for rid in history:
        encoder.add(rid, whole=rid == "beams")
        decoder.add(rid, "p", [1, 2])
    stats = EngineStats(*[0] * 16)
    for step in range(3):
        sent = [encoder.encode(h[step]) for h in history.values()]
        msg = decode(encode(Outputs(step, sent, stats, None)))
        assert isinstance(msg, Outputs)
        for d, h in zip(msg.outputs, history.values(), strict=True):
            got = decoder.decode(d)
            assert got is not None and _fields(got) == _fields(h[step])
    # Finished: forgotten on both sides (the encoder would send the request whole again).
    assert decoder.decode(sent[0]) is None
    assert encoder.encode(history["grows"][0]).outputs[0].keep_text == 0


def test_cancel_abort_refuse_and_grammars(model_dir: Path) -> None:
    """Cancelled and aborted requests free their blocks in the core; refusals raise RequestError naming the
    parameter (checked here, or by the core's grammar compiler); a constrained request follows its grammar."""
    engine = _core(model_dir)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def cancelled(i: int) -> int:
        n = 0
        async for _ in engine.generate(f"Story {i}", long, f"c{i}"):
            n += 1
            if n == 3:
                break  # closes the stream: the request is aborted
        return n

    async def main() -> None:
        await engine.start()
        assert await asyncio.gather(*(cancelled(i) for i in range(8))) == [3] * 8
        last = None
        async for out in engine.generate("This one is aborted", long, "aborted"):
            last = out
            if len(out.outputs[0].token_ids) == 2:
                await engine.abort("aborted")
        assert last is not None and last.finished and last.outputs[0].finish_reason == "abort"
        await _idle(engine)

        with pytest.raises(RequestError, match="empty"):
            engine.generate("", long, "bad")
        with pytest.raises(RequestError) as err:
            engine.generate("x", SamplingParams(n=1000), "bad2")
        assert err.value.param == "n"
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"), max_tokens=4)
        with pytest.raises(RequestError) as err:
            await engine.compile_grammar(bad)
        assert err.value.param == "structured_outputs.regex"
        choice = SamplingParams(
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), max_tokens=8, temperature=0.0
        )
        await engine.compile_grammar(choice)
        outs = await _collect(engine, "Is the sky blue?", choice, "choice")
        assert outs[-1].outputs[0].text in ("yes", "no")
        snap = await engine.snapshot()
        assert snap.stats.num_gpu_blocks == len(snap.cache.gpu.ref_counts)
        await _idle(engine)
        await engine.shutdown()
        with pytest.raises(EngineError):
            engine.generate("x", long, "after")

    uvloop.run(main())
    assert not Path(f"/proc/{engine.core_pid}").exists()  # the core exited, and was reaped


def test_a_killed_core_fails_every_stream_within_seconds(model_dir: Path) -> None:
    engine = _core(model_dir)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main() -> float:
        await engine.start()
        streams = [asyncio.create_task(_collect(engine, f"Story {i}", long, f"k{i}")) for i in range(4)]
        while engine.stats().num_running < 4:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        assert engine.core_pid is not None
        os.kill(engine.core_pid, signal.SIGKILL)
        results = await asyncio.gather(*streams, return_exceptions=True)
        took = time.monotonic() - t0
        for r in results:
            assert isinstance(r, EngineDeadError) and "exited" in str(r), r
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.generate("x", long, "after")
        with pytest.raises(EngineDeadError):
            await engine.snapshot()
        await engine.shutdown()
        return took

    assert uvloop.run(main()) < 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_core_that_cannot_start_raises_its_error(model_dir: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(Exception, match="(?i)cuda|cublas"):
        ProcessEngine(EngineConfig(model=model_dir, device="cuda"))
    assert time.monotonic() - t0 < 60
