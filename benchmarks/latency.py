"""Batch-1 latency on one GPU: decode tokens/s with and without CUDA graphs against the bandwidth roofline,
and the time to first token of a 1024-token prompt. `--check` adds the GPU numerics checks: greedy tokens of
the Triton path against the torch-reference path (bf16, and float32 where rounding cannot flip near-ties),
and prompt logits of both and of HF transformers in bf16 against HF transformers in float32.

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/latency.py --model /tmp/llama-3.1-8b --check --out benchmarks/results/latency-h200.json

Everything goes through the engine's own step (scheduler, runner, sampler), with random prompt token ids.
`benchmarks/throughput.py --latency --check` runs the same functions on its engine, in the same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinypaged import LLM, SamplingParams, ops
from tinypaged.config import ModelConfig
from tinypaged.model import AttentionMetadata

COPY_TBPS = 4.28  # H200 device-to-device copy, measured (DESIGN.md "The GPU")
MATMUL_TFLOPS = 680.0  # H200 bf16 8192^3 matmul, measured


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


class StepRecorder:
    """Wraps an engine's step and its runner's execute to record, per step: wall time, batch shape, the
    runner's GPU time (CUDA events around the forward pass) and the KV slots in use."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.rows: list[dict[str, Any]] = []
        self._cur: dict[str, Any] = {}
        self._step, self._execute = self.engine.step, self.engine.runner.execute
        self.engine.step = self.step
        self.engine.runner.execute = self.execute

    def close(self) -> None:
        """Put the engine's own methods back."""
        del self.engine.step, self.engine.runner.execute

    def execute(self, out, *rest):  # noqa: ANN001, ANN002, ANN201 (the runner's signature)
        cuda = torch.cuda.is_available()
        events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        )
        t0 = time.perf_counter()
        if events:
            events[0].record()
        result = self._execute(out, *rest)
        if events:
            events[1].record()
        self._cur = {
            "tokens": out.num_batched_tokens,
            "seqs": len(out.scheduled),
            "decode": all(s.num_new_tokens == 1 for s in out.scheduled),
            "launch_s": time.perf_counter() - t0,
            "events": events,
        }
        return result

    def step(self):  # noqa: ANN201
        self._cur = {}
        t0 = time.perf_counter()
        outs = self._step()
        wall = time.perf_counter() - t0
        kv = self.engine.kv
        used = kv.num_gpu_blocks - kv.num_free_gpu_blocks
        tokens = sum(
            s.num_computed_tokens
            for g in self.engine.scheduler.running
            for s in g.seqs
            if not s.status.is_finished
        )
        self.rows.append({**self._cur, "wall_s": wall, "blocks_used": used, "kv_tokens": tokens})
        return outs

    def summary(self, block_size: int) -> dict[str, Any]:
        """Totals per phase (steps with prefill tokens, decode-only steps) and KV use at peak."""
        _sync()
        for r in self.rows:
            ev = r.pop("events", None)
            r["gpu_s"] = ev[0].elapsed_time(ev[1]) / 1e3 if ev else 0.0
        out: dict[str, Any] = {"steps": len(self.rows)}
        for name, rows in (
            ("mixed", [r for r in self.rows if "decode" in r and not r["decode"]]),
            ("decode", [r for r in self.rows if r.get("decode")]),
        ):
            wall = sum(r["wall_s"] for r in rows)
            gpu = sum(r["gpu_s"] for r in rows)
            out[name] = {
                "steps": len(rows),
                "wall_s": wall,
                "runner_gpu_s": gpu,
                "gpu_busy_fraction": gpu / wall if wall else 0.0,
                "host_ms_per_step": 1e3 * (wall - gpu) / max(1, len(rows)),
                "launch_ms_per_step": 1e3 * statistics.mean(r["launch_s"] for r in rows) if rows else 0.0,
                "mean_batch_seqs": statistics.mean(r["seqs"] for r in rows) if rows else 0.0,
                "mean_batch_tokens": statistics.mean(r["tokens"] for r in rows) if rows else 0.0,
            }
        peak = max(self.rows, key=lambda r: r["blocks_used"])
        out["kv_peak"] = {
            "blocks_used": peak["blocks_used"],
            "tokens": peak["kv_tokens"],
            "slot_utilisation": peak["kv_tokens"] / max(1, peak["blocks_used"] * block_size),
        }
        return out


_CLASSES = (
    ("attention", ("_paged_attn", "_reduce_kernel")),
    ("rms_norm", ("_rms_norm",)),
    ("rotary", ("_rotary",)),
    ("write_kv", ("_write_kv",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk")),
    ("copies", ("memcpy", "memset", "copy_")),
    ("elementwise", ("elementwise", "vectorized", "silu", "mul")),
)


def _kernel_table(prof: Any, wall: float, steps: int) -> dict[str, Any]:
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0.0) or 0.0
        if t > 0 and getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
            kernels[evt.key] = kernels.get(evt.key, 0.0) + t / 1e6
    classes: dict[str, float] = {}
    for name, t in kernels.items():
        low = name.lower()
        cls = next((c for c, keys in _CLASSES if any(k in low for k in keys)), "other")
        classes[cls] = classes.get(cls, 0.0) + t
    gpu = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {
        "steps": steps,
        "wall_s": wall,
        "gpu_kernel_s": gpu,
        "gpu_idle_fraction": 1 - gpu / wall,
        "by_class_s": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top_kernels_s": [[k[:90], t] for k, t in top],
    }


def random_prompt(rng: np.random.Generator, length: int, vocab: int) -> dict[str, list[int]]:
    """A prompt of `length` uniformly random token ids."""
    return {"prompt_token_ids": rng.integers(0, vocab, size=length).tolist()}


def _timed_request(llm: LLM, prompt: dict[str, list[int]], max_tokens: int) -> list[float]:
    """Run one request alone through the engine's steps; the wall time, from 0, at which each output token
    reached the caller (under async scheduling a step returns the previous step's token)."""
    engine = llm.engine
    rid = f"lat-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    _sync()
    t0 = time.perf_counter()
    ends: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                now = time.perf_counter() - t0
                ends += [now] * (len(out.outputs[0].token_ids) - len(ends))
    return ends


def run_latency(
    llm: LLM, prompt_len: int = 512, gen_tokens: int = 256, ttft_len: int = 1024, seed: int = 0
) -> dict[str, Any]:
    """Batch-1 decode tokens/s with and without CUDA graphs, and TTFT of a `ttft_len`-token prompt."""
    cfg = llm.config.model
    runner = llm.engine.runner
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
    graphs_before, async_before = runner.use_cuda_graphs, llm.engine.async_scheduling
    # graphs: the default engine (CUDA graphs, async scheduling); graphs_sync: the host work of each step not
    # overlapped; eager: no graphs (async scheduling on).
    for mode, graphs, overlap in (
        ("graphs", True, True),
        ("graphs_sync", True, False),
        ("eager", False, True),
    ):
        if graphs and not runner._graphs:
            continue
        runner.use_cuda_graphs = graphs
        llm.engine.async_scheduling = overlap
        _timed_request(llm, random_prompt(rng, prompt_len, cfg.vocab_size), 8)  # warm-up
        runs = []
        for _ in range(2):
            rec = StepRecorder(llm)
            ends = _timed_request(llm, random_prompt(rng, prompt_len, cfg.vocab_size), gen_tokens)
            rec.close()
            decode_s = ends[-1] - ends[0]
            runs.append((len(ends) - 1) / decode_s)
        steps = rec.summary(runner.block_size)["decode"]
        tps = max(runs)
        result[mode] = {
            "decode_tokens_per_s": tps,
            "runs": runs,
            "ms_per_token": 1e3 / tps,
            "fraction_of_roofline": tps / roofline_tps,
            "runner_gpu_ms_per_step": 1e3 * steps["runner_gpu_s"] / max(1, steps["steps"]),
            "host_ms_per_step": steps["host_ms_per_step"],
            "execute_launch_ms_per_step": steps["launch_ms_per_step"],
        }
    runner.use_cuda_graphs, llm.engine.async_scheduling = graphs_before, async_before
    ttfts = []
    for _ in range(5):
        ends = _timed_request(llm, random_prompt(rng, ttft_len, cfg.vocab_size), 1)
        ttfts.append(ends[0])
    floor = prefill_flops(cfg, ttft_len) / (MATMUL_TFLOPS * 1e12)
    result["ttft"] = {
        "prompt_len": ttft_len,
        "median_ms": 1e3 * statistics.median(ttfts),
        "all_ms": [1e3 * t for t in ttfts],
        "compute_floor_ms": 1e3 * floor,
    }
    return result


def profile_batch1(llm: LLM, prompt_len: int, steps: int = 32, seed: int = 3) -> dict[str, Any]:
    """torch.profiler over `steps` batch-1 decode steps (with CUDA graphs when the engine has them)."""
    engine = llm.engine
    rng = np.random.default_rng(seed)
    engine.add_request(
        "prof-b1",
        random_prompt(rng, prompt_len, llm.config.model.vocab_size),
        SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True),
    )
    for _ in range(4):
        engine.step()
    table = profile_steps(engine, steps)
    engine.abort_request("prof-b1")
    return table


def profile_steps(engine: Any, steps: int) -> dict[str, Any]:
    """torch.profiler over the engine's next `steps` steps: kernel time by kernel and class against wall time."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = time.perf_counter() - t0
    return _kernel_table(prof, wall, steps)


# ---- numerics ----------------------------------------------------------------------------------------------


@torch.inference_mode()
def prompt_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits `[P, vocab]` of every position of each prompt, by one ragged prefill of the engine's model
    into a scratch paged cache (the kernels or references that `ops` picks now)."""
    runner = llm.engine.runner
    dev, bs = runner.device, runner.block_size
    widths = [-(-len(p) // bs) for p in prompts]
    kv = runner._allocate(sum(widths), dev)
    tables, slots, first = [], [], 0
    for p, w in zip(prompts, widths, strict=True):
        table = list(range(first, first + w))
        first += w
        tables.append(table + [0] * (max(widths) - w))
        slots += [table[i // bs] * bs + i % bs for i in range(len(p))]
    starts = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).tolist()
    meta = AttentionMetadata(
        torch.tensor(slots, device=dev),
        torch.tensor(tables, dtype=torch.int32, device=dev),
        torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev),
        torch.tensor(starts, dtype=torch.int32, device=dev),
    )
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device=dev)
    logits = runner.model.compute_logits(runner.model(ids, pos, kv, meta))
    return [logits[starts[i] : starts[i + 1]].cpu() for i in range(len(prompts))]


def run_checks(
    llm: LLM, seed: int = 0, lengths: tuple[int, ...] = (17, 64, 130, 255), max_tokens: int = 16
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Triton path against the torch-reference path on the same engine: greedy tokens and prompt logits.

    Returns (report, state for `hf_checks`: the prompts, our logits and tokens)."""
    cfg = llm.config.model
    rng = np.random.default_rng(seed + 7)
    prompts = [random_prompt(rng, n, cfg.vocab_size)["prompt_token_ids"] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
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
    agree = [_common_prefix(a, b) for a, b in zip(fast, ref, strict=True)]
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
    eagerly, and of the torch-reference path, on a float32 engine over the same weights."""
    llm = LLM(
        model=model_dir, dtype="float32", max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=2048
    )
    rng = np.random.default_rng(seed + 7)
    reqs = [random_prompt(rng, n, llm.config.model.vocab_size) for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runner = llm.engine.runner
    graphs = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    runner.use_cuda_graphs = False
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
        "common_prefix_graphs_vs_ref": [_common_prefix(a, b) for a, b in zip(graphs, ref, strict=True)],
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
        agree.append(_common_prefix(gen, toks))
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


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Any:
    """HF transformers' model on the same directory, on the GPU, EOS never stopping generation."""
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
    """Release an engine's GPU memory (weights, KV cache, graphs) before loading another model."""
    runner = llm.engine.runner
    runner._graphs.clear()
    del runner.model, runner.kv_cache
    del llm.engine
    gc.collect()
    torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="numerics: Triton vs torch reference vs HF")
    ap.add_argument("--profile", action="store_true", help="kernel time of batch-1 decode steps (graphs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=16)
    result: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if args.check:
        result["check"], state = run_checks(llm)
    result["latency"] = run_latency(llm, args.prompt_len, args.gen_tokens)
    if args.profile:
        result["profile_batch1"] = profile_batch1(llm, args.prompt_len)
    if args.check:
        free_llm(llm)
        result["check_fp32"] = fp32_greedy_check(args.model)
        result["check_hf"] = hf_checks(args.model, state)
    print(json.dumps(result, indent=1))
    lat = result["latency"]
    for m in ("graphs", "graphs_sync", "eager"):
        if m in lat:
            print(
                f"batch-1 decode {m}: {lat[m]['decode_tokens_per_s']:.1f} tok/s "
                f"({lat[m]['fraction_of_roofline']:.0%} of {lat['roofline_decode_tokens_per_s']:.0f}), "
                f"GPU {lat[m]['runner_gpu_ms_per_step']:.2f} ms + "
                f"host {lat[m]['host_ms_per_step']:.2f} ms/step"
            )
    if "profile_batch1" in result:
        w = result["profile_batch1"]
        print(
            f"profile batch-1: {1e3 * w['wall_s'] / w['steps']:.2f} ms/step wall, "
            f"{1e3 * w['gpu_kernel_s'] / w['steps']:.2f} ms/step kernels; by class (ms/step): "
            + ", ".join(f"{k} {1e3 * v / w['steps']:.3f}" for k, v in w["by_class_s"].items())
        )
        for k, t in w["top_kernels_s"][:8]:
            print(f"  {1e3 * t / w['steps']:.3f} ms/step  {k}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
