"""FP8 on the H200 (issue 37): FP8 weights and the FP8 KV cache side by side with bf16, in one run.

Two parts, each a run of its own (under 10 minutes on one H200), the engines one after the other:

- `--part speed`: engines bf16, bf16 weights + FP8 KV, FP8 weights, FP8 weights + FP8 KV (and an f32 engine
  for the accuracy reference). For each: W1 (BENCHMARKS.md; 256 requests at once) output tokens/s, batch-1
  decode tokens/s (CUDA graphs), each against its roofline counting the bytes and FLOPs of its own dtypes; and
  accuracy against the f32 engine on the same weights: per-token logprob error of each prompt's actual next
  tokens (teacher-forced prompt logprobs; mean, p99, max of |difference|) and greedy agreement over 32 prompts.
  With `--profile`, each engine's decode steps are also profiled by kernel class (W1's and batch-1's).
- `--part kv-bound`: a workload bound by KV memory by construction, FP8 weights in both engines and the KV
  dtype the only difference. 512 requests at once, prompts uniform in [1024, 4096] tokens, outputs uniform in
  [256, 1024] (random token ids, EOS ignored, seed 2); `max_num_seqs` 1024; the KV cache capped at the bytes of
  `--bf16-blocks` bf16 blocks (default 12,800 blocks of 16 tokens: 64 sequences of the mean final length,
  3,200 tokens; 25 GiB on the 8B shape), which hold twice as many FP8 blocks. Printed: peak KV tokens held,
  peak sequences in one step, preemptions, output tokens/s. `--kv-engines` picks the engines (the first, bf16
  KV, is the ratios' base).

An engine name ending in `/gluon` runs its FP8-KV decode steps through the Gluon kernel (kernels/attention_fp8.py)
for its life, one ending in `/triton` through the Triton kernel, whatever `TINYPAGED_FP8_ATTN_MMA` says, so that
both attention kernels run in one process.

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/fp8.py --model /tmp/llama-3.1-8b --part speed --json benchmarks/results/fp8-speed.json
    python benchmarks/fp8.py --model /tmp/llama-3.1-8b --part kv-bound --json benchmarks/results/fp8-kv.json

Rooflines: weights and KV at the copy bandwidth (4.28 TB/s), matmuls at the measured rate of their dtype
(bf16 680 TFLOP/s, FP8 `--fp8-tflops`, 1,196 measured on 8192^3 with torch._scaled_mm, NOTES.md); the LM head
and the embedding stay bf16 under FP8 weights.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from common import (
    COPY_TBPS,
    MATMUL_TFLOPS,
    Work,
    add_w1_args,
    common_prefix,
    free_llm,
    generate_with_stats,
    greedy,
    header,
    kv_bytes_per_token,
    layer_params,
    make_workload,
    prefill_flops,
    profile_steps,
    prompt_logits,
    random_prompt,
    run_latency,
    w1_engine_args,
    write_json,
)
from throughput import ideal_decode_steps, run_ours

import tinypaged.kernels as tk
from tinypaged import LLM
from tinypaged.config import ModelConfig

ENGINES: dict[str, dict[str, Any]] = {
    "bf16": {},
    "bf16+kv8": {"kv_cache_dtype": "fp8"},
    "fp8": {"quantization": "fp8"},
    "fp8+kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    # FP8-KV decode steps through the Gluon kernel (kernels/attention_fp8.py, on by default from `MIN_PROGRAMS`
    # programs) or the Triton kernel alone, for the engine's life: both side by side in one process
    "fp8+kv8/gluon": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "fp8+kv8/triton": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "fp8+kv8/gluon-waves": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def splits_in_waves(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, q: torch.Tensor, sms: int | None = None
) -> int:
    """A candidate split rule for the Gluon kernel (engine `/gluon-waves`), from run 118's uniform batches: up to
    half a wave of programs, fill one wave (the kernel's rule); past it, about two waves of split programs
    (128 sequences: 3 splits, 256: 2), where the kernel's rule leaves a second wave a third full."""
    slots = tk.attention_fp8.PROGRAMS_PER_SM * (sms or tk.attention_configs.num_sms(q.device))
    programs = num_seqs * num_kv_heads
    most = max(1, min(64, max_seq_len // (4 * tk.attention_fp8.BLOCK_N)))
    if 2 * programs <= slots:
        return max(1, min(most, slots // programs))
    return max(1, min(most, round(2 * slots / programs)))


@contextlib.contextmanager
def attention_of(name: str) -> Iterator[None]:
    """The FP8-KV decode attention an engine name asks for (`/gluon`: the Gluon kernel switched on, with its split
    rule; `/gluon-waves`: with `splits_in_waves` (run 120); `/triton`: the Triton kernel alone; else the process's
    own, `TINYPAGED_FP8_ATTN_MMA`'s)."""
    before = tk.attention_fp8.FP8_DECODE_MMA, tk.attention_fp8.splits
    if "/gluon" in name or name.endswith("/triton"):
        tk.attention_fp8.FP8_DECODE_MMA = "/gluon" in name
    if name.endswith("/gluon-waves"):
        tk.attention_fp8.splits = splits_in_waves
    try:
        yield
    finally:
        tk.attention_fp8.FP8_DECODE_MMA, tk.attention_fp8.splits = before


# ---- rooflines with FP8 bytes ----------------------------------------------------------------------------------


def weight_bytes(cfg: ModelConfig, fp8_weights: bool) -> int:
    """Bytes a decode step reads of weights: the decoder layers' matmuls in their dtype (norms bf16), the final
    norm and the bf16 LM head."""
    norms = 2 * cfg.num_layers * cfg.hidden_size
    matmuls = layer_params(cfg) - norms
    return (1 if fp8_weights else 2) * matmuls + 2 * (
        norms + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    )


def w1_roofline(cfg: ModelConfig, work: Work, fp8_weights: bool, kv_elem: int, fp8_tflops: float) -> float:
    """Seconds W1 needs at the strict roofline (as benchmarks/throughput.py's, with this engine's dtypes): each
    decode step max(bytes / bandwidth, FLOPs / rate), prefills at the matmul rate."""
    bw = COPY_TBPS * 1e12
    rate = (fp8_tflops if fp8_weights else MATMUL_TFLOPS) * 1e12
    weights, kvb = weight_bytes(cfg, fp8_weights), kv_bytes_per_token(cfg, kv_elem)
    flops_token = 2 * (layer_params(cfg) - 2 * cfg.num_layers * cfg.hidden_size)
    head_flops_token = 2 * cfg.vocab_size * cfg.hidden_size  # bf16 in every engine
    attn_flops_ctx = 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers
    total = 0.0
    for n, ctx in ideal_decode_steps(work):
        flops_s = n * flops_token / rate + (n * head_flops_token + ctx * attn_flops_ctx) / (
            MATMUL_TFLOPS * 1e12
        )
        total += max((weights + ctx * kvb) / bw, flops_s)
    return total + sum(prefill_flops(cfg, len(p)) for p, _ in work) / rate


# ---- accuracy against the f32 engine ---------------------------------------------------------------------------


def accuracy_prompts(vocab: int, seed: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """(16 prompts of 256 random tokens for teacher-forced logprobs, 32 prompts of 32-160 tokens for greedy)."""
    rng = np.random.default_rng(seed)
    scored = [rng.integers(0, vocab, size=256).tolist() for _ in range(16)]
    greedy_prompts = [rng.integers(0, vocab, size=int(rng.integers(32, 161))).tolist() for _ in range(32)]
    return scored, greedy_prompts


def reference_of(
    llm: LLM, scored: list[list[int]], greedy_prompts: list[list[int]], n: int
) -> dict[str, Any]:
    """What the accuracy compares: each scored prompt's logprob of its own next tokens, and greedy tokens."""
    lps = []
    for p, logits in zip(scored, prompt_logits(llm, scored), strict=True):
        lp = torch.log_softmax(logits[:-1].float(), dim=-1)
        lps.append(lp.gather(1, torch.tensor(p[1:])[:, None])[:, 0])
    outs = llm.generate([{"prompt_token_ids": p} for p in greedy_prompts], greedy(n))
    return {"logprobs": torch.cat(lps), "greedy": [o.outputs[0].token_ids for o in outs]}


def accuracy(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    err = (got["logprobs"] - ref["logprobs"]).abs()
    prefixes = [common_prefix(a, b) / len(b) for a, b in zip(got["greedy"], ref["greedy"], strict=True)]
    return {
        "tokens_scored": int(err.numel()),
        "logprob_err_mean": float(err.mean()),
        "logprob_err_p99": float(err.quantile(0.99)),
        "logprob_err_max": float(err.max()),
        "greedy_identical": sum(a == b for a, b in zip(got["greedy"], ref["greedy"], strict=True)),
        "greedy_prompts": len(ref["greedy"]),
        "greedy_mean_prefix_share": statistics.mean(prefixes),
    }


def profile_decode(llm: LLM, work: Work) -> dict[str, Any]:
    """Device time by kernel class (`common.profile_steps`) over 20 of W1's decode steps (from step 40, after its
    prefills) and over 40 steps of one request decoding alone (batch-1)."""
    engine = llm.engine
    for i, (p, o) in enumerate(work):
        engine.add_request(f"prof-{i}", {"prompt_token_ids": p}, greedy(o))
    for _ in range(40):
        engine.step()
    out = {"w1_decode": profile_steps(llm, 20)}
    while engine.has_unfinished_requests():
        engine.step()
    prompt = random_prompt(np.random.default_rng(3), 512, llm.config.model_config.vocab_size)
    engine.add_request("prof-b1", prompt, greedy(128))
    for _ in range(20):
        engine.step()
    out["batch1"] = profile_steps(llm, 40)
    while engine.has_unfinished_requests():
        engine.step()
    return out


# ---- parts -----------------------------------------------------------------------------------------------------


def guarded(res: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    try:
        res[key] = fn()
    except Exception as e:
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {e}"}
    return res[key]


def part_speed(args: argparse.Namespace, res: dict[str, Any]) -> None:
    cfg = ModelConfig.from_dir(args.model)
    scored, greedy_prompts = accuracy_prompts(cfg.vocab_size)
    if not args.skip_accuracy:
        llm = LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=32)
        ref = reference_of(llm, scored, greedy_prompts, args.greedy_tokens)
        free_llm(llm)
    else:
        ref = None
    work = make_workload(args.num_requests, cfg.vocab_size, args.seed, args.prompt_range, args.output_range)
    for name in args.engines:
        with attention_of(name):
            speed_engine(args, res, name, cfg, work, scored, greedy_prompts, ref)


def speed_engine(
    args: argparse.Namespace,
    res: dict[str, Any],
    name: str,
    cfg: ModelConfig,
    work: list[Work],
    scored: Any,
    greedy_prompts: Any,
    ref: Any,
) -> None:
    """One engine of the speed part: W1, batch 1, accuracy against `ref` (the f32 engine's) and the profile."""
    extra = ENGINES[name]
    out: dict[str, Any] = res.setdefault("engines", {}).setdefault(name, {"args": extra})
    t0 = time.perf_counter()
    try:
        llm = LLM(model=args.model, **w1_engine_args(args), **extra)
    except Exception as e:
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
        return
    out["init_s"] = time.perf_counter() - t0
    out["num_gpu_blocks"] = llm.engine.runner.num_gpu_blocks
    out["weights_bytes"] = llm.engine.runner.stats.weights_bytes
    fp8_w, kv_elem = "quantization" in extra, 1 if "kv_cache_dtype" in extra else 2
    if not args.skip_accuracy:
        got = guarded(
            out,
            "accuracy_raw",
            lambda llm=llm: reference_of(llm, scored, greedy_prompts, args.greedy_tokens),
        )
        if "error" not in got:
            out["accuracy"] = accuracy(out.pop("accuracy_raw"), ref)
    w1 = guarded(out, "w1", lambda llm=llm: run_ours(llm, work))
    if "output_tokens_per_s" in w1:
        w1["roofline_s"] = w1_roofline(cfg, work, fp8_w, kv_elem, args.fp8_tflops)
        w1["fraction_of_roofline"] = w1["roofline_s"] / w1["elapsed_s"]
    lat = guarded(out, "batch1", lambda llm=llm: run_latency(llm, modes=("graphs",)))
    if "graphs" in lat:
        ctx = lat["prompt_len"] + lat["gen_tokens"] / 2
        step_bytes = weight_bytes(cfg, fp8_w) + ctx * kv_bytes_per_token(cfg, kv_elem)
        lat["roofline_tokens_per_s"] = COPY_TBPS * 1e12 / step_bytes
        lat["fraction_of_roofline"] = lat["graphs"]["decode_tokens_per_s"] / lat["roofline_tokens_per_s"]
    if args.profile:
        guarded(out, "profile", lambda llm=llm: profile_decode(llm, work))
    free_llm(llm)
    write_json(args.json, res)


def part_kv_bound(args: argparse.Namespace, res: dict[str, Any]) -> None:
    for name in args.kv_engines:
        with attention_of(name):
            kv_bound_engine(args, res, name)


def kv_bound_engine(args: argparse.Namespace, res: dict[str, Any], name: str) -> None:
    """One engine of the KV-bound part (`--kv-engines`)."""
    extra = ENGINES[name]
    blocks = args.bf16_blocks * (2 if "kv_cache_dtype" in extra else 1)
    llm = LLM(
        model=args.model,
        max_model_len=8192,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        num_gpu_blocks_override=blocks,
        **extra,
    )
    cfg = llm.config.model_config
    work = make_workload(args.kv_requests, cfg.vocab_size, 2, tuple(args.kv_prompts), tuple(args.kv_outputs))
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    llm.generate(prompts[:2], greedy(4))  # warm-up
    t0 = time.perf_counter()
    outs, stats = generate_with_stats(llm, prompts, [greedy(o) for _, o in work])
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res.setdefault("kv_bound", {})[name] = {
        "num_gpu_blocks": blocks,
        "kv_cache_bytes": llm.engine.runner.stats.kv_cache_bytes,
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "peak_kv_tokens": max(s.num_kv_tokens for s in stats),
        "peak_seqs": max(s.num_seqs for s in stats),
        "mean_decode_seqs": statistics.mean(
            [s.num_seqs for s in stats if s.num_seqs and not s.num_prefill_tokens] or [0]
        ),
        "preempted": sum(s.num_preempted for s in stats),
        "steps": len(stats),
        # Host wall time of the calls whose step ran prefill tokens, and of the others (decode only): what
        # FP8 KV's larger batches can shorten is the second.
        "prefill_steps_s": sum(s.total_s for s in stats if s.num_prefill_tokens),
        "decode_steps_s": sum(s.total_s for s in stats if not s.num_prefill_tokens),
        # how many steps ran prompt tokens, and the sequences each carried (the decodes riding along)
        "prefill_steps": sum(1 for s in stats if s.num_prefill_tokens),
        "mean_prefill_step_seqs": statistics.mean([s.num_seqs for s in stats if s.num_prefill_tokens] or [0]),
        "prompts": args.kv_prompts,
        "outputs": args.kv_outputs,
    }
    free_llm(llm)
    write_json(args.json, res)


# ---- the table -------------------------------------------------------------------------------------------------


def print_table(res: dict[str, Any]) -> None:
    engines = res.get("engines", {})
    if engines:
        base = engines.get("bf16", {})
        b_w1 = base.get("w1", {}).get("output_tokens_per_s")
        b_b1 = base.get("batch1", {}).get("graphs", {}).get("decode_tokens_per_s")
        print(
            f"{'engine':<9} {'W1 tok/s':>9} {'x bf16':>6} {'roof':>5} {'b1 tok/s':>8} {'x bf16':>6} {'roof':>5} "
            f"{'lp err mean':>11} {'p99':>7} {'max':>7} {'greedy=':>7} {'prefix':>6}"
        )
        for name, e in engines.items():
            if "error" in e:
                print(f"{name:<9} {e['error'][:100]}")
                continue
            w1, b1, acc = e.get("w1", {}), e.get("batch1", {}), e.get("accuracy", {})
            w = w1.get("output_tokens_per_s", float("nan"))
            b = b1.get("graphs", {}).get("decode_tokens_per_s", float("nan"))
            print(
                f"{name:<9} {w:9.1f} {w / (b_w1 or w):6.3f} {w1.get('fraction_of_roofline', float('nan')):5.3f} "
                f"{b:8.1f} {b / (b_b1 or b):6.3f} {b1.get('fraction_of_roofline', float('nan')):5.3f} "
                f"{acc.get('logprob_err_mean', float('nan')):11.4f} {acc.get('logprob_err_p99', float('nan')):7.4f} "
                f"{acc.get('logprob_err_max', float('nan')):7.4f} "
                f"{acc.get('greedy_identical', '-'):>4}/{acc.get('greedy_prompts', '-'):<2} "
                f"{acc.get('greedy_mean_prefix_share', float('nan')):6.3f}"
            )
    for name, e in engines.items():
        for where, prof in e.get("profile", {}).items():
            if "by_class_s" not in prof:
                continue
            per = {c: f"{1e3 * t / prof['steps']:.2f}" for c, t in prof["by_class_s"].items()}
            print(
                f"{name} {where} ms/step: busy {prof['busy_ms_per_step']:.2f}, "
                + ", ".join(f"{c} {t}" for c, t in per.items())
            )
    kv = res.get("kv_bound", {})
    if kv:
        print(
            f"{'KV-bound':<9} {'blocks':>7} {'peak tok':>9} {'peak seqs':>9} {'preempt':>7} {'out tok/s':>9} "
            f"{'elapsed s':>9} {'prefill s':>9} {'decode s':>9}"
        )
        for name, k in kv.items():
            print(
                f"{name:<9} {k['num_gpu_blocks']:7d} {k['peak_kv_tokens']:9d} {k['peak_seqs']:9d} "
                f"{k['preempted']:7d} {k['output_tokens_per_s']:9.1f} {k['elapsed_s']:9.1f} "
                f"{k.get('prefill_steps_s', float('nan')):9.1f} {k.get('decode_steps_s', float('nan')):9.1f}"
            )
        a = kv.get("fp8")
        for name, b in kv.items():
            if a is None or name == "fp8":
                continue
            print(
                f"{name} / bf16 KV: tokens held {b['peak_kv_tokens'] / a['peak_kv_tokens']:.2f}x, peak sequences "
                f"{b['peak_seqs'] / a['peak_seqs']:.2f}x, throughput "
                f"{b['output_tokens_per_s'] / a['output_tokens_per_s']:.3f}x"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (e.g. from `tinypaged weights random`)")
    ap.add_argument("--part", choices=("speed", "kv-bound"), required=True)
    ap.add_argument(
        "--engines", nargs="+", default=["bf16", "bf16+kv8", "fp8", "fp8+kv8"], choices=list(ENGINES)
    )
    ap.add_argument(
        "--kv-engines",
        nargs="+",
        default=["fp8", "fp8+kv8"],
        choices=[e for e in ENGINES if e.startswith("fp8")],
        help="kv-bound: the engines (FP8 weights; the first is the base of the ratios)",
    )
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--fp8-tflops", type=float, default=1196.0, help="the FP8 matmul rate (8192^3, measured)")
    ap.add_argument("--bf16-blocks", type=int, default=12800)
    ap.add_argument("--kv-requests", type=int, default=512)
    ap.add_argument("--kv-prompts", type=int, nargs=2, default=[1024, 4096], help="kv-bound: prompt lengths")
    ap.add_argument("--kv-outputs", type=int, nargs=2, default=[256, 1024], help="kv-bound: output lengths")
    ap.add_argument("--profile", action="store_true", help="speed: also profile decode steps by kernel class")
    ap.add_argument(
        "--skip-accuracy", action="store_true", help="speed: no f32 reference, no accuracy columns"
    )
    ap.add_argument("--json", required=True)
    add_w1_args(ap)
    args = ap.parse_args()
    res = header(args)
    try:
        (part_speed if args.part == "speed" else part_kv_bound)(args, res)
    finally:
        write_json(args.json, res)
        print_table(res)


if __name__ == "__main__":
    main()
