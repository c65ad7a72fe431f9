"""The warm-up's tables (engine/step/warmup.py) against the dispatch itself, on the CPU. With the ops sent to the
Triton kernels and each launch recorded instead of run (its specialisation, as Triton compiles a kernel for:
constexprs, tensor dtypes and 16-byte alignment, integers equal to 1 or divisible by 16, launch options), the
warm-up must launch every kernel of tinypaged.kernels (dense weights, FP8 weights, FP8 KV cache, INT4 / INT8, and
INT4 in groups of 128 in bf16 routed as on a GPU: the Gluon kernel, which the CPU cannot run), and every
specialisation that a sweep of step shapes and of requests with random sampling parameters launches; every
field of SamplingParams that reaches the device has a variant. A new kernel, tile class or sampling path
without a warm-up entry fails here. The engine's own warm-up does nothing on the CPU (nothing compiles)."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import random
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from triton.runtime.jit import JITFunction

import tinypaged.kernels
from tinypaged import ops
from tinypaged.config import EngineConfig
from tinypaged.core.schedule_types import ScheduledSeq
from tinypaged.core.scheduler import SchedulerOutput
from tinypaged.engine.step import warmup
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.kernels import attention, attention_fp8, lowbit_mma
from tinypaged.kernels.attention_configs import splits_for_programs
from tinypaged.model.quant.linear import IntLinearMethod
from tinypaged.sampling_params import SamplingParams, StructuredOutputsParams
from tinypaged.weights.random_model import make_random_model

Key = tuple[str, tuple[Any, ...], tuple[Any, ...]]
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
SHAPE |= {"num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
CONFIGS = {
    "dense": {},
    "fp8": {"quantization": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "int4": {"quantization": "int4"},
    "int8": {"quantization": "int8"},
    # INT4 in groups of 128 (a model whose layers take 128 or 256 columns) in bf16: the Gluon kernel's layers.
    "int4_g128": {"quantization": "int4", "dtype": "bfloat16"},
    # INT8 in groups of 128 in bf16: the Gluon kernel's at 2-16 rows, the GEMV at one.
    "int8_g128": {"quantization": "int8", "dtype": "bfloat16"},
    # An FP8 cache with its decode steps through the Gluon kernel (switched on; bf16 queries, as on a GPU).
    "fp8_kv_mma": {"kv_cache_dtype": "fp8", "dtype": "bfloat16"},
}
WIDE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def _key(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """What Triton compiles `fn` for at this launch."""
    bound = dict(zip(fn.arg_names, args, strict=False)) | {
        k: v for k, v in kwargs.items() if k in fn.arg_names
    }
    spec = []
    for p in fn.params:
        v = bound.get(p.name, p.default)
        if p.is_constexpr:
            spec.append((p.name, v))
        elif isinstance(v, torch.Tensor):
            spec.append((p.name, str(v.dtype), v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or v is None:
            spec.append((p.name, v))
        elif isinstance(v, int):
            spec.append((p.name, "int", None if p.do_not_specialize else (v == 1, v % 16 == 0, v >= 2**31)))
        else:
            spec.append((p.name, type(v).__name__))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in fn.arg_names))
    return fn.__name__, tuple(spec), options


def record(f: Callable[[], object], fp8_attention_mma: bool = False) -> set[Key]:
    """Run f with the ops on the Triton kernels, each launch recorded (not run); the launches' keys.
    `fp8_attention_mma`: decode over an FP8 cache through the Gluon kernel (switched on)."""
    keys: set[Key] = set()

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        keys.add(_key(self, args, kwargs))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(JITFunction, "run", run)
        m.setattr(ops, "_INTERPRET", True)
        m.setattr(attention, "choose_num_splits", _gpu_splits)
        m.setattr(
            lowbit_mma, "usable", lowbit_mma.takes
        )  # as on a GPU: the Gluon kernels where they run there
        m.setattr(attention_fp8, "usable", attention_fp8.takes)
        m.setattr(attention_fp8, "splits", functools.partial(attention_fp8.splits, sms=132))  # an H200's
        m.setattr(attention_fp8, "FP8_DECODE_MMA", fp8_attention_mma)
        # The tiny models' batches (2 KV heads, up to 8 sequences) on both kernels, as a GPU's are from 32
        # sequences: 1-3 on the Triton kernel, 4-8 on the Gluon one.
        m.setattr(attention_fp8, "MIN_PROGRAMS", 8)
        f()
    return keys


def _gpu_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Decode attention's split count as on an H200 (132 SMs): the CPU's is always 1."""
    slots = 4 * 132
    return splits_for_programs(num_seqs * num_kv_heads, slots, max(1, min(64, max_seq_len // (4 * block_n))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model("smollm2-135m", tmp_path_factory.mktemp("warm") / "m", overrides=SHAPE)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model("smollm2-135m", tmp_path_factory.mktemp("warm") / "w", overrides=SHAPE | WIDE)


def _engine(path: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            max_num_seqs=8,
            max_num_batched_tokens=144,
            swap_space=0.01,
            cpu_kv_cache_space=0.02,
            **kw,
        )
    )


def _launched_kernels() -> set[str]:
    """Every Triton kernel tinypaged.kernels launches (by convention `_..._kernel`; helpers are inlined)."""
    names = set()
    for info in pkgutil.iter_modules(tinypaged.kernels.__path__):
        module = importlib.import_module(f"tinypaged.kernels.{info.name}")
        names |= {n for n, v in vars(module).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    return names


def _seq(i: int, done: int, new: int, block_size: int) -> ScheduledSeq:
    table = tuple(range(-(-(done + new) // block_size)))
    return ScheduledSeq(i, f"sweep-{i}", done, new, (0,) * new, table, True)


def _sweep_steps(engine: LLMEngine, rng: random.Random) -> Iterator[SchedulerOutput]:
    """Eager steps of every token count up to the step budget (prefills, from position 0 or later), decode
    batches of every size with random contexts, and mixed steps."""
    cfg, bs = engine.config, engine.config.block_size
    longest = min(cfg.max_model_len, engine.runner.num_gpu_blocks * bs)
    for t in range(1, cfg.max_num_batched_tokens + 1):
        done = rng.choice([0, rng.randrange(0, longest - t + 1)]) if t < longest else 0
        yield SchedulerOutput((_seq(0, done, t, bs),), (), (), (), (), (), t)
    for b in range(1, cfg.max_num_seqs + 1):
        seqs = tuple(_seq(i, rng.randrange(0, longest), 1, bs) for i in range(b))
        yield SchedulerOutput(seqs, (), (), (), (), (), b)
    for _ in range(6):
        t = rng.randrange(2, 40)
        seqs = (_seq(0, 0, t, bs),) + tuple(_seq(i, rng.randrange(0, longest), 1, bs) for i in range(1, 4))
        yield SchedulerOutput(seqs, (), (), ((0, 1),), (), (), t + 3)


def _random_params(rng: random.Random) -> SamplingParams:
    """A request's parameters with a random subset of the sampling features."""
    common: dict[str, Any] = {"max_tokens": rng.randint(2, 4), "ignore_eos": True}
    if rng.random() < 0.3:
        common["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.15:
        return SamplingParams(temperature=0.0, n=2, use_beam_search=True, **common)
    kw: dict[str, Any] = {"temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.4:
        kw["top_p"] = 0.8
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([3, 50])
    if rng.random() < 0.3:
        kw["min_p"] = 0.1
    if rng.random() < 0.3:
        kw |= {"repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.3}
    if rng.random() < 0.3:
        kw["min_tokens"] = 2
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 3])
    if rng.random() < 0.2:
        kw["seed"] = rng.randrange(100)
    if rng.random() < 0.2 and kw["temperature"] > 0:
        kw |= {"n": 2, "best_of": 3}
    if rng.random() < 0.2:
        kw["structured_outputs"] = StructuredOutputsParams(choice=["yes", "no"])
    return SamplingParams(**kw, **common)


def _sweep(engine: LLMEngine, seed: int) -> None:
    rng = random.Random(seed)
    for sched in _sweep_steps(engine, rng):
        engine.executor.execute(sched, (0,) if rng.random() < 0.5 else ())
    for i in range(24):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, _random_params(rng))
        if rng.random() < 0.5:
            while engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture(scope="module")
def warmed(tiny: Path, wide: Path) -> dict[str, tuple[LLMEngine, set[Key]]]:
    """An engine of each configuration, and what its warm-up launches."""
    out = {}
    for name, kw in CONFIGS.items():
        # The layers in the GPU's layout, not repacked for the CPU's kernels.
        if name in ("int4_g128", "int8_g128"):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(IntLinearMethod, "pack_for_cpu", lambda self, layer: None)
                engine = _engine(wide, **kw)
        else:
            engine = _engine(tiny, **kw)
        assert dict(engine.startup)["warmup"] == 0.0  # the CPU: nothing to compile, nothing done
        out[name] = engine, record(lambda e=engine: warmup.warm_up(e, force=True), name == "fp8_kv_mma")
    yield out
    for engine, _ in out.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def swept(warmed) -> dict[str, set[Key]]:
    """What a sweep of step shapes and random requests launches on each configuration's engine."""
    return {
        name: record(lambda e=engine, s=i: _sweep(e, seed=s), name == "fp8_kv_mma")
        for i, (name, (engine, _)) in enumerate(warmed.items())
    }


# Kernels the engine never launches (the model runs the fused kernel beside them): the ops facade keeps them for
# direct callers. A sweep that launches one of them fails the test below.
NOT_IN_THE_ENGINE = {
    "_write_kv_kernel": "ops.write_kv; the model writes K/V with ops.rotary_write_kv",
    "_rotary_kernel": "ops.rotary_embedding; the model rotates with ops.rotary_write_kv",
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_warmup_launches_what_the_engine_can(name: str, warmed, swept) -> None:
    missing = sorted(swept[name] - warmed[name][1], key=str)
    assert not missing, "specialisations the warm-up does not compile:\n" + "\n".join(map(str, missing[:8]))


def test_every_kernel_is_warmed(warmed, swept) -> None:
    """Over the three configurations, the warm-up launches every kernel of tinypaged.kernels the engine can."""
    seen = {key[0] for _, warm in warmed.values() for key in warm}
    assert _launched_kernels() - seen == set(NOT_IN_THE_ENGINE)
    assert not {key[0] for keys in swept.values() for key in keys} & set(NOT_IN_THE_ENGINE)


def test_int8_in_groups_of_128_takes_the_gluon_kernel_from_two_rows(swept) -> None:
    """INT8 layers in groups of 128 run the Gluon kernel as on a GPU: both its tiles (up to 8 and up to 16 rows)
    are launched by the sweep (and warmed: the test above)."""
    tiles = set()
    for name, spec, _ in swept["int8_g128"]:
        args = {entry[0]: entry[1] for entry in spec if len(entry) == 2}
        if name == "_wint_mma_kernel" and args["BITS"] == 8:
            tiles.add(args["BLOCK_M"])
    assert tiles == {8, 16}


def test_every_device_side_sampling_field_has_a_variant() -> None:
    """A field of SamplingParams is either host-side only (declared) or set away from its default by a
    variant: a new sampling parameter fails here until the warm-up covers it (or says why it need not)."""
    defaults = SamplingParams()
    covered = {
        f.name
        for f in fields(SamplingParams)
        for v in warmup.SAMPLING_VARIANTS
        if getattr(v.params, f.name) != getattr(defaults, f.name)
    }
    assert warmup.HOST_ONLY_FIELDS <= {f.name for f in fields(SamplingParams)}
    assert warmup.sampling_fields() - covered == set()


def test_the_warmup_leaves_the_engine_as_it_was(tiny: Path) -> None:
    """No counters, no blocks held, and the same unseeded draws after it as without it."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    first = _engine(tiny)
    expected = [o.outputs[0].token_ids for o in _generate(first, params)]
    first.shutdown()
    engine = _engine(tiny)
    record(lambda: warmup.warm_up(engine, force=True))
    stats = engine.stats()
    assert stats.num_steps == stats.generation_tokens_total == stats.prompt_tokens_total == 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert [o.outputs[0].token_ids for o in _generate(engine, params)] == expected
    engine.check_integrity()
    engine.shutdown()


def _generate(engine: LLMEngine, params: SamplingParams) -> list:
    for i in range(3):
        engine.add_request(f"g{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step().outputs if o.finished]
    return sorted(done, key=lambda o: o.request_id)


def test_the_sampler_compiles_once_per_logits_dtype(swept) -> None:
    """The sampler pads its parameter rows, so that their alignment does not depend on the row count: one
    specialisation of its kernel per logits dtype (the CPU's float32 here; a GPU's bf16 and float32)."""
    assert len({key for key in swept["dense"] if key[0] == "_sample_kernel"}) == 1


def test_row_counts_straddle_the_fp8_swiglu_switch() -> None:
    """The FP8 SwiGLU quantizes in tiles up to kernels/fp8.py's TILED_ROWS rows and one program a row above
    (kernels the sweep's 144 tokens do not reach): the warm-up's row counts take both sides."""
    from tinypaged.kernels.fp8 import TILED_ROWS

    assert warmup.FP8_SWIGLU_TILED_ROWS == TILED_ROWS
    assert {TILED_ROWS, TILED_ROWS + 1} <= set(warmup.ROW_COUNTS)


def test_the_warmup_verifies_proposed_tokens(tiny: Path) -> None:
    """With speculative decoding, the warm-up's eager steps include verifications (a decode with k proposed
    tokens, its k + 1 rows sampled) and run them through the rejection sampler; the engine is left as it was."""
    engine = _engine(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    steps = warmup.eager_steps(engine.config, engine.runner.num_gpu_blocks)
    assert any(s.scheduled[0].num_spec_tokens == 3 and s.scheduled[0].num_new_tokens == 4 for s in steps)
    record(lambda: warmup.warm_up(engine, force=True))
    stats = engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks and stats.spec_decode_num_drafts == 0
    engine.shutdown()


def test_wide_decodes_are_warmed_only_without_decode_graphs(tiny: Path) -> None:
    """Decode batches of several widths at each context run eagerly only where no decode graph replays them (the
    graphs' capture compiles each batch size's kernels); one sequence a context either way."""
    engine = _engine(tiny)
    cfg, blocks = engine.config, engine.runner.num_gpu_blocks

    def decodes(graphs: bool) -> set[tuple[int, int]]:
        steps = warmup.eager_steps(cfg, blocks, decode_graphs=graphs)[:-1]  # the last: the sampler's batch
        return {
            (len(s.scheduled), s.scheduled[0].num_computed_tokens + 1)
            for s in steps
            if all(q.num_new_tokens == 1 for q in s.scheduled)
        }

    with_graphs, without = decodes(True), decodes(False)
    assert {w for w, _ in with_graphs} == {1}
    assert with_graphs < without and {w for w, _ in without} == {1, 2, 4, cfg.max_num_seqs}
    engine.shutdown()
