"""What the benchmark scripts share: the H200's measured constants and the roofline arithmetic, workload W1, a
driver that runs the engine's own loop and keeps every step's statistics (and their summaries), profiling,
batch-1 latency and the GPU numerics checks (latency.py, and throughput.py in the same process), HF
transformers loading, and JSON output. Targets and definitions: BENCHMARKS.md, "Targets".

Scripts run as `python3 benchmarks/NAME.py`, and Python imports from a script's folder first: `from common
import ...` needs no path edits. Nothing here reaches into the engine: it reads the StepStats of
`LLMEngine.step()` and `engine.stats()`, and uses the runner's public switches and methods.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinypaged import LLM, SamplingParams, ops
from tinypaged.config import ModelConfig
from tinypaged.engine.request import Prompt
from tinypaged.engine.step.stats import StepResult, StepStats
from tinypaged.outputs import RequestOutput

COPY_TBPS = 4.28  # H200 device-to-device copy, measured (BENCHMARKS.md, "Targets")
MATMUL_TFLOPS = 680.0  # H200 bf16 8192^3 matmul, measured

Work = list[tuple[list[int], int]]  # requests as (prompt token ids, output length)


# ---- roofline arithmetic -------------------------------------------------------------------------------------


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of the decoder layers (matmuls and norms)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = (
        cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    return cfg.num_layers * (per_layer + 2 * cfg.hidden_size)


def step_weight_bytes(cfg: ModelConfig, elem: int = 2) -> int:
    """Weight bytes a decode step must read: the layers, the final norm and the LM head (the embedding
    table is only gathered, one row per token)."""
    return elem * (layer_params(cfg) + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size)


def kv_bytes_per_token(cfg: ModelConfig, elem: int = 2) -> int:
    """K and V of one token, all layers."""
    return elem * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """FLOPs of one prompt's prefill: the matmuls of every token, causal attention, one row of logits."""
    matmul = 2 * prompt_len * (layer_params(cfg) - 2 * cfg.num_layers * cfg.hidden_size)
    attention = 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers * prompt_len * (prompt_len + 1) / 2
    return matmul + attention + 2 * cfg.vocab_size * cfg.hidden_size


# ---- workloads -----------------------------------------------------------------------------------------------


def make_workload(
    n: int,
    vocab: int,
    seed: int = 1,
    prompt: tuple[int, int] = (64, 1024),
    output: tuple[int, int] = (32, 512),
) -> Work:
    """W1's requests (with its defaults): prompt lengths and output lengths uniform in the given ranges,
    uniformly random token ids."""
    rng = np.random.default_rng(seed)
    p_lens = rng.integers(prompt[0], prompt[1] + 1, size=n)
    o_lens = rng.integers(output[0], output[1] + 1, size=n)
    return [
        (rng.integers(0, vocab, size=int(p)).tolist(), int(o)) for p, o in zip(p_lens, o_lens, strict=True)
    ]


def random_prompt(rng: np.random.Generator, length: int, vocab: int) -> dict[str, list[int]]:
    """A prompt of `length` uniformly random token ids."""
    return {"prompt_token_ids": rng.integers(0, vocab, size=length).tolist()}


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- driving the engine --------------------------------------------------------------------------------------


def run_steps(llm: LLM, time_device: bool = True) -> Iterator[StepResult]:
    """The engine's own loop, as `LLM.generate` runs it: `step()` until no request is left, each StepResult as
    it comes. With `time_device` the runner times each forward pass on the device meanwhile (CUDA only)."""
    engine, runner = llm.engine, llm.engine.runner
    before, runner.time_device = runner.time_device, time_device
    try:
        while engine.has_unfinished_requests():
            yield engine.step()
    finally:
        runner.time_device = before


def generate_with_stats(
    llm: LLM,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams],
    time_device: bool = True,
    cold: bool = True,
) -> tuple[list[RequestOutput], list[StepStats]]:
    """`LLM.generate` (its own steps, `LLM.batch_steps`), keeping every step's statistics; the outputs come back
    in the prompts' order. With `time_device` the runner times each forward pass on the device meanwhile (CUDA
    only). With `cold`, the prefix cache is emptied first: a workload run again on the same engine starts as
    cold as the first time."""
    if cold:
        llm.reset_prefix_cache()
    runner = llm.engine.runner
    before, runner.time_device = runner.time_device, time_device
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    stats: list[StepStats] = []
    try:
        for result in llm.batch_steps(prompts, params, ids):
            stats.append(result.stats)
            done.update((o.request_id, o) for o in result.outputs if o.finished)
    finally:
        runner.time_device = before
    return [done[rid] for rid in ids], stats


def device_times(stats: list[StepStats]) -> dict[int, float]:
    """Device seconds of each step's forward pass, by step index (a step's time comes with the call that
    applied its tokens: the next call under async scheduling)."""
    times: dict[int, float] = {}
    for s in stats:
        if len(s.device_s) == len(s.applied_steps):  # else timing was off for some of them
            times.update(zip(s.applied_steps, s.device_s, strict=True))
    return times


PHASES = ("schedule", "execute", "sample", "update", "wait")  # StepStats.<phase>_s; wait is part of update


def summarize_steps(llm: LLM, stats: list[StepStats]) -> dict[str, Any]:
    """Totals per kind of step (mixed: with prompt tokens; decode: one sampled token per sequence) and the KV
    slots in use at the peak of block use."""
    device = device_times(stats)
    out: dict[str, Any] = {"steps": len(stats)}
    ran = [s for s in stats if s.num_seqs]
    out["mixed"] = _phase_totals([s for s in ran if s.num_prefill_tokens], device)
    out["decode"] = _phase_totals([s for s in ran if not s.num_prefill_tokens], device)
    peak = min(stats, key=lambda s: s.num_free_blocks)
    used = llm.engine.stats().num_gpu_blocks - peak.num_free_blocks
    out["kv_peak"] = {
        "blocks_used": used,
        "tokens": peak.num_kv_tokens,
        "slot_utilisation": peak.num_kv_tokens / max(1, used * llm.config.block_size),
    }
    return out


def _phase_totals(rows: list[StepStats], device: dict[int, float]) -> dict[str, Any]:
    """Wall and device time of these steps, the host's share, and their mean batch."""
    n = max(1, len(rows))
    wall = sum(s.total_s for s in rows)
    gpu = sum(device.get(s.step, 0.0) for s in rows)
    return {
        "steps": len(rows),
        "wall_s": wall,
        "runner_gpu_s": gpu,
        "gpu_busy_fraction": gpu / wall if wall else 0.0,
        "host_ms_per_step": 1e3 * (wall - gpu) / n,
        # Host time to queue the step's device work: block moves, forward pass, sampling.
        "launch_ms_per_step": 1e3 * sum(s.execute_s + s.sample_s for s in rows) / n,
        "phase_ms_per_step": {p: 1e3 * sum(getattr(s, f"{p}_s") for s in rows) / n for p in PHASES},
        "mean_batch_seqs": sum(s.num_seqs for s in rows) / n,
        "mean_batch_tokens": sum(s.num_prefill_tokens + s.num_decode_tokens for s in rows) / n,
    }


# ---- profiling -----------------------------------------------------------------------------------------------

_CLASSES = (
    # Tensor parallelism's: NCCL's ncclDevKernel_AllReduce_..., symmetric memory's one_shot_all_reduce_kernel...
    ("all_reduce", ("allreduce", "all_reduce")),
    ("nccl_other", ("nccl",)),  # the input ids' broadcast, the logits' all-gather
    ("attention", ("_paged_attn", "_reduce_kernel")),
    ("rms_norm", ("_rms_norm",)),
    ("rotary", ("_rotary",)),
    ("write_kv", ("_write_kv",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk", "_gemv")),
    ("copies", ("memcpy", "memset", "copy_")),
    ("elementwise", ("elementwise", "vectorized", "silu", "mul")),
)


def _kernel_table(prof: Any, wall: float, steps: int) -> dict[str, Any]:
    kernels: dict[str, float] = {}
    calls: dict[str, int] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0.0) or 0.0
        if evt.key.startswith("nccl:"):
            continue  # the profiler's range around an eager NCCL call, not a kernel (its kernel is counted)
        if t > 0 and getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
            kernels[evt.key] = kernels.get(evt.key, 0.0) + t / 1e6
            calls[evt.key] = calls.get(evt.key, 0) + evt.count
    classes: dict[str, float] = {}
    class_calls: dict[str, int] = {}
    for name, t in kernels.items():
        low = name.lower()
        cls = next((c for c, keys in _CLASSES if any(k in low for k in keys)), "other")
        classes[cls] = classes.get(cls, 0.0) + t
        class_calls[cls] = class_calls.get(cls, 0) + calls[name]
    gpu = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {
        "steps": steps,
        "wall_s": wall,
        "gpu_kernel_s": gpu,
        "gpu_idle_fraction": 1 - gpu / wall,
        "by_class_s": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "calls_by_class": class_calls,
        "top_kernels_s": [[k[:90], t] for k, t in top],
    }


def _kernel_gaps(prof: Any, steps: int) -> dict[str, Any]:
    """From the trace's device intervals: the time some kernel (or copy) ran, and the gaps between them by length
    (under 10 us: launch boundaries inside a CUDA graph or stream; longer: the device waiting on the host)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy = 0.0
    gaps = {"under_10us": 0.0, "10_to_200us": 0.0, "over_200us": 0.0}
    short = 0
    end = spans[0][0] if spans else 0.0
    for start, stop in spans:
        if start > end:
            gap = start - end
            key = "under_10us" if gap < 10 else "10_to_200us" if gap < 200 else "over_200us"
            gaps[key] += gap
            short += gap < 10
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {
        "span_ms_per_step": (spans[-1][1] - spans[0][0]) / 1e3 / steps if spans else 0.0,
        "busy_ms_per_step": busy / 1e3 / steps,
        "gaps_ms_per_step": {k: v / 1e3 / steps for k, v in gaps.items()},
        "short_gaps_per_step": short / steps,
    }


def profile_steps(llm: LLM, steps: int) -> dict[str, Any]:
    """torch.profiler over the engine's next `steps` steps: kernel time by kernel and class against wall time,
    and the device's busy time and the gaps between its kernels (`_kernel_gaps`)."""
    from torch.profiler import ProfilerActivity, profile

    sync_device()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        sync_device()
        wall = time.perf_counter() - t0
    return {**_kernel_table(prof, wall, steps), **_kernel_gaps(prof, steps)}


# ---- batch-1 latency -----------------------------------------------------------------------------------------


def timed_request(
    llm: LLM, prompt: Prompt, max_tokens: int, time_device: bool = True
) -> tuple[list[float], list[StepStats]]:
    """Run one request alone through the engine's steps: the wall time, from 0, at which each output token
    reached the caller (under async scheduling a step returns the previous step's token), and the steps'
    statistics."""
    engine = llm.engine
    rid = f"lat-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, greedy(max_tokens))
    sync_device()
    t0 = time.perf_counter()
    ends: list[float] = []
    stats: list[StepStats] = []
    for result in run_steps(llm, time_device):
        for out in result.outputs:
            if out.request_id == rid:
                now = time.perf_counter() - t0
                ends += [now] * (len(out.outputs[0].token_ids) - len(ends))
        stats.append(result.stats)
    return ends, stats


def run_latency(
    llm: LLM,
    prompt_len: int = 512,
    gen_tokens: int = 256,
    ttft_len: int = 1024,
    seed: int = 0,
    modes: Sequence[str] = ("graphs", "graphs_sync", "eager"),
) -> dict[str, Any]:
    """Batch-1 decode tokens/s with and without CUDA graphs (the `modes` asked for), and TTFT of a
    `ttft_len`-token prompt."""
    cfg = llm.config.model_config
    engine, runner = llm.engine, llm.engine.runner
    rng = np.random.default_rng(seed)
    roofline_tps = (
        COPY_TBPS * 1e12 / (step_weight_bytes(cfg) + (prompt_len + gen_tokens / 2) * kv_bytes_per_token(cfg))
    )
    result: dict[str, Any] = {
        "prompt_len": prompt_len,
        "gen_tokens": gen_tokens,
        "roofline_decode_tokens_per_s": roofline_tps,
        "step_weight_bytes": step_weight_bytes(cfg),
    }
    graphs_before, async_before = runner.use_cuda_graphs, engine.async_scheduling
    # graphs: the default engine (CUDA graphs, async scheduling); graphs_sync: the host work of each step not
    # overlapped; eager: no graphs (async scheduling on).
    for mode, graphs, overlap in (
        ("graphs", True, True),
        ("graphs_sync", True, False),
        ("eager", False, True),
    ):
        if mode not in modes or (graphs and not runner.stats.graph_batch_sizes):  # no graphs were captured
            continue
        runner.use_cuda_graphs = graphs
        engine.async_scheduling = overlap
        timed_request(llm, random_prompt(rng, prompt_len, cfg.vocab_size), 8)  # warm-up
        runs = []
        for _ in range(2):
            ends, stats = timed_request(llm, random_prompt(rng, prompt_len, cfg.vocab_size), gen_tokens)
            runs.append((len(ends) - 1) / (ends[-1] - ends[0]))
        steps = summarize_steps(llm, stats)["decode"]  # of the last run
        tps = max(runs)
        result[mode] = {
            "decode_tokens_per_s": tps,
            "runs": runs,
            "ms_per_token": 1e3 / tps,
            "fraction_of_roofline": tps / roofline_tps,
            "runner_gpu_ms_per_step": 1e3 * steps["runner_gpu_s"] / max(1, steps["steps"]),
            "host_ms_per_step": steps["host_ms_per_step"],
            "execute_launch_ms_per_step": steps["launch_ms_per_step"],
            "phase_ms_per_step": steps["phase_ms_per_step"],
        }
    runner.use_cuda_graphs, engine.async_scheduling = graphs_before, async_before
    ttfts = []
    for _ in range(5):
        ends, _ = timed_request(llm, random_prompt(rng, ttft_len, cfg.vocab_size), 1, time_device=False)
        ttfts.append(ends[0])
    floor = prefill_flops(cfg, ttft_len) / (MATMUL_TFLOPS * 1e12)
    result["ttft"] = {
        "prompt_len": ttft_len,
        "median_ms": 1e3 * statistics.median(ttfts),
        "all_ms": [1e3 * t for t in ttfts],
        "compute_floor_ms": 1e3 * floor,
    }
    return result


# ---- numerics ------------------------------------------------------------------------------------------------


def prompt_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits `[P, vocab]` of every position of each prompt, by one ragged prefill of the engine's model
    into a scratch paged cache (the kernels or references that `ops` picks now), on every tensor-parallel rank."""
    return llm.engine.executor.prompt_logits(prompts)


def run_checks(
    llm: LLM, seed: int = 0, lengths: tuple[int, ...] = (17, 64, 130, 255), max_tokens: int = 16
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Triton path against the torch-reference path on the same engine: greedy tokens and prompt logits.

    Returns (report, state for `hf_checks`: the prompts, our logits and tokens)."""
    cfg = llm.config.model_config
    rng = np.random.default_rng(seed + 7)
    prompts = [random_prompt(rng, n, cfg.vocab_size)["prompt_token_ids"] for n in lengths]
    params = greedy(max_tokens)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    fast = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    fast_logits = prompt_logits(llm, prompts)
    runner = llm.engine.runner
    graphs, runner.use_cuda_graphs = runner.use_cuda_graphs, False
    eager = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    runner.use_cuda_graphs = graphs
    with ops.torch_reference_ops():
        ref = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
        ref_logits = prompt_logits(llm, prompts)
    agree = [common_prefix(a, b) for a, b in zip(fast, ref, strict=True)]
    diffs = [(a - b).abs().max().item() for a, b in zip(fast_logits, ref_logits, strict=True)]
    scale = max(b.abs().max().item() for b in ref_logits)
    report = {
        "prompt_lens": list(lengths),
        "max_tokens": max_tokens,
        "greedy_equal": fast == ref,
        "greedy_graphs_equal_eager": fast == eager,
        "greedy_common_prefix": agree,
        "logits_max_abs_triton_vs_torch_ref": max(diffs),
        "logits_max_abs_ref": scale,
        "logits_all_finite": all(bool(torch.isfinite(x).all()) for x in fast_logits),
    }
    # Where greedy outputs part, how close the reference's top two were (a near-tie flips under bf16).
    gaps = []
    for p, a, b, n in zip(prompts, fast, ref, agree, strict=True):
        if n < len(a):
            with ops.torch_reference_ops():
                lg = prompt_logits(llm, [p + b[:n]])[0][-1]
            top = lg.topk(2).values
            gaps.append({"position": n, "ref_top2_gap": (top[0] - top[1]).item(), "ours": a[n], "ref": b[n]})
    report["divergences"] = gaps
    state = {"prompts": prompts, "logits": fast_logits, "ref_logits": ref_logits, "tokens": fast}
    return report, state


def fp32_greedy_check(
    model_dir: str | Path, lengths: tuple[int, ...] = (17, 64, 130, 255), max_tokens: int = 16, seed: int = 0
) -> dict[str, Any]:
    """In float32 (where rounding cannot flip near-ties): greedy tokens of the Triton path with CUDA graphs,
    eagerly, and of the torch-reference path, on a float32 engine over the same weights. A budget of 128 tokens a
    step chunks the prompts, so that the graphs replay steps of prefill chunks beside decodes too."""
    llm = LLM(
        model=model_dir, dtype="float32", max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=128
    )
    rng = np.random.default_rng(seed + 7)
    reqs = [random_prompt(rng, n, llm.config.model_config.vocab_size) for n in lengths]
    params = greedy(max_tokens)
    graphs = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    llm.engine.runner.use_cuda_graphs = False
    eager = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    with ops.torch_reference_ops():
        ref = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    free_llm(llm)
    return {
        "prompt_lens": list(lengths),
        "max_tokens": max_tokens,
        "graphs_equal_ref": graphs == ref,
        "eager_equal_ref": eager == ref,
        "graphs_equal_eager": graphs == eager,
        "common_prefix_graphs_vs_ref": [common_prefix(a, b) for a, b in zip(graphs, ref, strict=True)],
    }


def _errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    num = sum(float((g - w).float().norm() ** 2) for g, w in zip(got, want, strict=True))
    den = sum(float(w.float().norm() ** 2) for w in want)
    return {
        "max_abs": max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)),
        "rel_l2": (num / den) ** 0.5,
    }


@torch.inference_mode()
def hf_checks(model_dir: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Prompt logits against HF transformers in float32 on the same weights (the oracle): ours (Triton, bf16),
    our torch-reference path (bf16) and HF itself loaded in bf16; then greedy tokens of HF bf16 against ours.
    (Each HF model is loaded in its dtype: casting a loaded model with .to() would also cast its rotary
    inverse frequencies.)"""

    def logits_of(m: Any) -> list[torch.Tensor]:
        return [m(torch.tensor([p], device=m.device)).logits[0].float().cpu() for p in state["prompts"]]

    model = load_hf(model_dir, torch.float32)
    oracle = logits_of(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    model = load_hf(model_dir)
    hf_bf16 = logits_of(model)
    agree = []
    for p, toks in zip(state["prompts"], state["tokens"], strict=True):
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(toks), do_sample=False
        )[0, len(p) :].tolist()
        agree.append(common_prefix(gen, toks))
    return {
        "oracle": "HF transformers float32",
        "oracle_logits_max_abs": max(x.abs().max().item() for x in oracle),
        "ours_triton_bf16": _errors(state["logits"], oracle),
        "ours_torch_ref_bf16": _errors(state["ref_logits"], oracle),
        "hf_bf16": _errors(hf_bf16, oracle),
        "ours_vs_hf_bf16": _errors(state["logits"], hf_bf16),
        "greedy_common_prefix_hf_bf16_vs_ours": agree,
        "greedy_tokens": len(state["tokens"][0]),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- HF transformers, memory, output -------------------------------------------------------------------------


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Any:
    """HF transformers' model on the same directory, on the GPU if there is one, EOS never stopping
    generation (padding id 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype,
        device_map="cuda" if torch.cuda.is_available() else "cpu",
    ).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def free_llm(llm: LLM) -> None:
    """Release an engine's memory (weights, KV caches, graphs; every tensor-parallel rank) before loading
    another model."""
    llm.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def sync_device() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def header(args: argparse.Namespace) -> dict[str, Any]:
    """What every result file opens with: the device, torch's version, the date and the arguments."""
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
    }


def write_json(path: str | Path, data: Any) -> None:
    """Write a result as indented JSON (what JSON cannot hold, as its str), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def section(res: dict[str, Any], name: str, fn: Any, out: str | Path | None = None) -> Any:
    """Run one part of a benchmark into `res[name]`: a failure is recorded and printed and the other parts
    still run; the results so far are written to `out` after each part."""
    try:
        res[name] = fn()
    except Exception as e:
        traceback.print_exc()
        res[name] = {"error": f"{type(e).__name__}: {e}"}
    if out:
        write_json(out, res)
    return res[name]


def add_w1_args(ap: argparse.ArgumentParser) -> None:
    """W1's workload and engine arguments, with W1's values as defaults (BENCHMARKS.md, "Targets")."""
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(64, 1024), help="W1: 64 1024")
    ap.add_argument("--output-range", type=int, nargs=2, default=(32, 512), help="W1: 32 512")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def w1_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments `add_w1_args` declared, as `LLM(...)` takes them."""
    return {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
