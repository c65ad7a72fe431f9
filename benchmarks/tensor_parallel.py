"""Tensor parallelism: TP=2 beside TP=1 on the same model, in one process and one run (two GPUs).

    tinypaged weights random --config llama-3.1-8b --out /tmp/m8b
    python3 benchmarks/tensor_parallel.py --model /tmp/m8b --out benchmarks/results/tensor-parallel-h200x2.json

For each size, one engine (the same arguments as benchmarks/throughput.py's) measures, in this order:
- numerics: the logits of prompts of several lengths each followed by TP=1's greedy continuation, as the
  engine's first step computes them (`Executor.prompt_logits`: one prefill on every rank), and the greedy
  continuation itself (the engine's own steps: CUDA graphs, async scheduling). TP=2 is compared with TP=1:
  max-abs and relative L2 error of the logits, tokens agreeing, and where a continuation parts, the gap between
  TP=1's two best logits there against the logits' difference (a near-tie that bf16 rounding flips);
- W1 (BENCHMARKS.md, "Targets") through the engine's loop (throughput.py's `run_ours`);
- batch-1 decode after a 512-token prompt, CUDA graphs with async scheduling (common.py's `run_latency`), and
  the TTFT of a 1024-token prompt;
- torch.profiler over 32 batch-1 decode steps and over a mixed and a decode window of W1: GPU kernel time by
  class, the all-reduces' (NCCL) share of the step among them. The profile is rank 0's; the ranks are symmetric.
With `--nccl-too`, each size above 1 runs a second time with NCCL doing every all-reduce
(`disable_custom_all_reduce`), before the default (small all-reduces through symmetric memory). Each variant
also decodes a batch of 96 short prompts greedily (16 tokens: its decode steps' all-reduces are 768 KiB, which
symmetric memory takes): at TP=2 a sum of two is correctly rounded either way, so both variants must agree
token for token.
With `--fault kill|stop`, last: TP=2's worker is killed (or frozen) during a generation, and the time until the
engine raises EngineDeadError, its message, the shutdown's time and the GPUs' memory after it are recorded.

A table is printed last; the JSON (every figure, written after each part) goes to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import signal
import subprocess
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    add_w1_args,
    common_prefix,
    device_name,
    greedy,
    make_workload,
    prompt_logits,
    run_latency,
    w1_engine_args,
    write_json,
)
from latency import profile_batch1
from throughput import profile_ours, roofline, run_ours

from tinypaged import LLM
from tinypaged.errors import EngineDeadError

GiB = 1 << 30


def numerics(llm: LLM, prompts: list[list[int]], tokens: int, path: list[list[int]] | None) -> dict[str, Any]:
    """Greedy continuations through the engine's steps, and the logits of each prompt followed by `path` (TP=1's
    continuations; this engine's own when None), every position, on the CPU."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tokens))
    conts = [o.outputs[0].token_ids for o in outs]
    path = path or conts
    # One prompt at a time: every position's logits of a long prompt are big (~0.5 GB in fp32 at 8B).
    logits = [prompt_logits(llm, [p + c])[0] for p, c in zip(prompts, path, strict=True)]
    return {"continuations": conts, "logits": logits}


def batch_greedy(llm: LLM, prompts: list[list[int]]) -> dict[str, Any]:
    """Greedy continuations of a batch of prompts, decoded together (16 tokens each)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16))
    return {"continuations": [o.outputs[0].token_ids for o in outs]}


def compare(one: dict[str, Any], two: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """TP=2 against TP=1: logits along TP=1's continuations, and the continuations themselves."""
    rows = []
    for p, a, b, ca, cb in zip(
        prompts, one["logits"], two["logits"], one["continuations"], two["continuations"], strict=True
    ):
        diff = (a - b).abs()
        agree = common_prefix(ca, cb)
        row: dict[str, Any] = {
            "prompt_len": len(p),
            "max_abs": diff.max().item(),
            "rel_l2": ((a - b).norm() / a.norm()).item(),
            "first_step_max_abs": diff[len(p) - 1].max().item(),
            "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "tokens_agree": agree,
            "tokens": len(ca),
        }
        if agree < len(ca):  # the first position where the continuations part, in TP=1's logits there
            at = a[len(p) - 1 + agree]
            top2 = at.topk(2)
            row["parted"] = {
                "position": agree,
                "tp1_token": ca[agree],
                "tp2_token": cb[agree],
                "tp1_top2_gap": (top2.values[0] - top2.values[1]).item(),
                "tp1_logit_of_tp2_token_below_best": (at.max() - at[cb[agree]]).item(),
                "logits_max_abs_diff_there": diff[len(p) - 1 + agree].max().item(),
            }
        rows.append(row)
    total = sum(r["tokens"] for r in rows)
    return {
        "per_prompt": rows,
        "max_abs": max(r["max_abs"] for r in rows),
        "rel_l2": max(r["rel_l2"] for r in rows),
        "first_step_max_abs": max(r["first_step_max_abs"] for r in rows),
        "logits_abs_max": max(x.abs().max().item() for x in one["logits"]),
        "tokens_agree_before_parting": sum(r["tokens_agree"] for r in rows),
        "tokens": total,
        "continuations_equal": sum(r["tokens_agree"] == r["tokens"] for r in rows),
    }


def fault(llm: LLM, how: str) -> dict[str, Any]:
    """Kill rank 1 (`how` "kill": SIGKILL) or freeze it ("stop": SIGSTOP, found by its silent heartbeat) while
    96 requests decode (their steps' all-reduces, 768 KiB, go through symmetric memory unless it is off): how
    long until the engine raises, what it says, how long shutdown takes, and the GPUs' memory after it
    (nvidia-smi's view: every process)."""
    engine, executor = llm.engine, llm.engine.executor
    for i in range(96):
        engine.add_request(f"fault-{i}", {"prompt_token_ids": list(range(100 + i, 356 + i))}, greedy(100000))
    for _ in range(40):  # the prompts take 3 steps at W1's 8192 tokens a step
        engine.step()
    t0 = time.perf_counter()
    os.kill(executor.worker_pids[1], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    out: dict[str, Any] = {"how": how}
    try:
        while engine.has_unfinished_requests():
            engine.step()
        out["error"] = "no error raised"
    except EngineDeadError as e:
        out["raised_after_s"] = time.perf_counter() - t0
        out["error"] = str(e)
    t1 = time.perf_counter()
    llm.shutdown()
    out["shutdown_s"] = time.perf_counter() - t1
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        out["gpu_used_mib_after_shutdown"] = [
            int(x) for x in subprocess.check_output(query, text=True).split()
        ]
    return out


def title(key: str) -> str:
    """A variant's column title: tp2 -> TP=2, tp2_nccl -> TP=2 NCCL."""
    return key.replace("tp", "TP=").replace("_nccl", " NCCL")


def print_table(res: dict[str, Any]) -> None:
    """The figures side by side, last in the output; each later variant also as a ratio to the first."""
    lines = [f"\nTensor parallelism on {res['device']} x{res['gpus']}, {res['model']}, {res['date']}"]
    keys = res["variants"]
    first = title(keys[0])
    ratios = [f"{title(k)} / {first}" for k in keys[1:]]
    lines.append("| | " + " | ".join([title(k) for k in keys] + ratios) + " |")
    lines.append("|---" * (2 * len(keys)) + "|")

    def row(name: str, get: Any, fmt: str = "{:.1f}") -> None:
        vals = []
        for key in keys:
            try:
                vals.append(get(res[key]))
            except (KeyError, TypeError):
                vals.append(None)
        cells = [fmt.format(v) if isinstance(v, float | int) else "-" for v in vals]
        cells += [
            f"{v / vals[0]:.2f}x" if isinstance(v, float) and isinstance(vals[0], float) and vals[0] else ""
            for v in vals[1:]
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("W1 output tok/s", lambda r: r["w1"]["output_tokens_per_s"], "{:.0f}")
    row("W1 elapsed s", lambda r: r["w1"]["elapsed_s"], "{:.2f}")
    row("batch-1 decode tok/s (graphs)", lambda r: r["latency"]["graphs"]["decode_tokens_per_s"])
    row("batch-1 ms/token", lambda r: r["latency"]["graphs"]["ms_per_token"], "{:.2f}")
    row("TTFT 1024 tokens ms", lambda r: r["latency"]["ttft"]["median_ms"])
    row("engine start s", lambda r: r["init_s"])
    for window in ("batch1", "w1_mixed", "w1_decode"):
        for what, key in (("kernels ms/step", "gpu_kernel_s"), ("wall ms/step", "wall_s")):
            row(
                f"profile {window}: {what}",
                lambda r, w=window, k=key: 1e3 * r["profile"][w][k] / r["profile"][w]["steps"],
                "{:.2f}",
            )
        row(
            f"profile {window}: all-reduce ms/step",
            lambda r, w=window: (
                1e3 * r["profile"][w]["by_class_s"].get("all_reduce", 0.0) / r["profile"][w]["steps"]
            ),
            "{:.3f}",
        )
        row(
            f"profile {window}: all-reduce share of wall",
            lambda r, w=window: (
                r["profile"][w]["by_class_s"].get("all_reduce", 0.0) / r["profile"][w]["wall_s"]
            ),
            "{:.1%}",
        )
        row(
            f"profile {window}: all-reduces per step",
            lambda r, w=window: (
                r["profile"][w]["calls_by_class"].get("all_reduce", 0) / r["profile"][w]["steps"]
            ),
            "{:.1f}",
        )
    for key in keys[1:]:
        c = res[key].get("compare") if isinstance(res.get(key), dict) else None
        if not (isinstance(c, dict) and "rel_l2" in c):
            continue
        lines.append(
            f"logits {title(key)} vs {first} (every position of {len(c['per_prompt'])} prompts + continuations, "
            f"|logit| max "
            f"{c['logits_abs_max']:.2f}): max-abs {c['max_abs']:.4f}, rel L2 {c['rel_l2']:.2e}, first step "
            f"max-abs {c['first_step_max_abs']:.4f}; greedy: {c['continuations_equal']} of {len(c['per_prompt'])} "
            f"continuations equal, {c['tokens_agree_before_parting']} of {c['tokens']} tokens before parting"
        )
        for r in c["per_prompt"]:
            if "parted" in r:
                pt = r["parted"]
                lines.append(
                    f"  prompt {r['prompt_len']}: parted at token {pt['position']}: TP=1's top-2 gap "
                    f"{pt['tp1_top2_gap']:.4f}, logits' max-abs difference there {pt['logits_max_abs_diff_there']:.4f}"
                )
    for key in keys:
        agree = res[key].get("batch_equal_to_nccl") if isinstance(res.get(key), dict) else None
        if agree is not None:
            lines.append(
                f"{title(key)} vs {title(key)} NCCL, {len(res[key]['batch_continuations'])} greedy continuations "
                f"decoded together: {agree} equal"
            )
    f = res.get("fault")
    if isinstance(f, dict) and "error" in f:
        lines.append(
            f"fault ({f.get('how')} rank 1): EngineDeadError after {f.get('raised_after_s', float('nan')):.2f} s "
            f"({f['error']}); shutdown {f.get('shutdown_s', float('nan')):.2f} s; GPU memory used after: "
            f"{f.get('gpu_used_mib_after_shutdown')} MiB"
        )
    print("\n".join(lines), flush=True)


class Run:
    """The run's results (written to --out after each part) and what the sizes share: W1, the prompts, TP=1's
    numerics."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.res: dict[str, Any] = {
            "device": device_name(),
            "gpus": torch.cuda.device_count(),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "model": args.model,
            "date": time.strftime("%Y-%m-%d"),
            "sizes": args.sizes,
            "variants": [],
            "requests": args.num_requests,
        }
        self.kept: dict[str, dict[str, Any]] = {}  # numerics by variant (logits stay out of the JSON)
        self.work: Any = None
        self.prompts: list[list[int]] = []
        self.batch_prompts: list[list[int]] = []

    def section(self, where: dict[str, Any], name: str, fn: Any) -> Any:
        """Run one part; a failure is recorded and printed, and the other parts still run."""
        t0 = time.perf_counter()
        try:
            where[name] = fn()
        except Exception as e:
            traceback.print_exc()
            where[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{time.perf_counter() - t0:.1f} s] {name}", flush=True)
        if self.args.out:
            write_json(self.args.out, self.res)
        return where[name]

    def size(self, tp: int, nccl_only: bool = False) -> None:
        """Every measurement of one tensor-parallel size, on one engine (`nccl_only`: NCCL does every
        all-reduce)."""
        args, res = self.args, self.res
        key = f"tp{tp}_nccl" if nccl_only else f"tp{tp}"
        res["variants"].append(key)
        t0 = time.perf_counter()
        llm = LLM(
            model=args.model,
            tensor_parallel_size=tp,
            enforce_eager=args.enforce_eager,
            disable_custom_all_reduce=nccl_only,
            **w1_engine_args(args),
        )
        cfg = llm.config.model_config
        r = res[key] = {
            "init_s": time.perf_counter() - t0,
            "num_gpu_blocks": llm.engine.runner.num_gpu_blocks,
            "runner": asdict(llm.engine.runner.stats),
        }
        print(f"{title(key)}: engine ready in {r['init_s']:.1f} s", flush=True)
        if self.work is None:
            self.work = make_workload(
                args.num_requests, cfg.vocab_size, args.seed, args.prompt_range, args.output_range
            )
            res["roofline"] = roofline(cfg, self.work)
            rng = np.random.default_rng(args.seed + 7)
            self.prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in args.prompt_lens]
            self.batch_prompts = [rng.integers(0, cfg.vocab_size, size=24).tolist() for _ in range(96)]
        first = self.kept.get(res["variants"][0])
        path = first["continuations"] if first else None
        self.kept[key] = self.section(
            {}, "numerics", lambda: numerics(llm, self.prompts, args.greedy_tokens, path)
        )
        r["continuations"] = self.kept[key].get("continuations")
        batch = self.section({}, "batch", lambda: batch_greedy(llm, self.batch_prompts))
        r["batch_continuations"] = batch.get("continuations")
        twin = res.get(f"tp{tp}_nccl", {})
        if not nccl_only and r["batch_continuations"] and twin.get("batch_continuations"):
            pairs = zip(r["batch_continuations"], twin["batch_continuations"], strict=True)
            r["batch_equal_to_nccl"] = sum(a == b for a, b in pairs)
        if "w1" not in args.skip:
            self.section(r, "w1", lambda: run_ours(llm, self.work))
        if "latency" not in args.skip:
            self.section(r, "latency", lambda: run_latency(llm, modes=("graphs",)))
        if "profile" not in args.skip:
            prof: dict[str, Any] = r.setdefault("profile", {})
            self.section(prof, "batch1", lambda: profile_batch1(llm, 512))
            w1 = self.section(prof, "w1", lambda: profile_ours(llm, self.work))
            if isinstance(w1, dict) and "mixed" in w1:
                prof |= {"w1_mixed": w1.pop("mixed"), "w1_decode": w1.pop("decode")}
        if first is not None and "logits" in first and "logits" in self.kept[key]:
            self.section(r, "compare", lambda: compare(first, self.kept[key], self.prompts))
        if args.fault and tp == args.sizes[-1] and tp > 1 and not nccl_only:
            print_table(res)
            self.section(res, "fault", lambda: fault(llm, args.fault))
        else:
            llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    add_w1_args(ap)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[17, 130, 255, 512, 1000])
    ap.add_argument("--greedy-tokens", type=int, default=48)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--nccl-too",
        action="store_true",
        help="each size above 1 also with NCCL doing every all-reduce (before the default)",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["w1", "latency", "profile"])
    ap.add_argument(
        "--fault",
        choices=["kill", "stop"],
        default=None,
        help="kill or freeze the last size's worker 1 at the end",
    )
    ap.add_argument(
        "--deadline-s", type=float, default=0, help="dump stacks and exit after this long (0: never)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.deadline_s:
        faulthandler.dump_traceback_later(args.deadline_s, exit=True)
    run = Run(args)
    for tp in args.sizes:
        if args.nccl_too and tp > 1:
            run.size(tp, nccl_only=True)
        run.size(tp)
    if args.out:
        write_json(args.out, run.res)
    print_table(run.res)


if __name__ == "__main__":
    main()
