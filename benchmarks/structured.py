"""Structured outputs' cost: workload W1 (BENCHMARKS.md, "Targets") unconstrained, then with every request under
a JSON schema, in the same process on the same engine; the compile time of each schema (cold and cached) and
the token masks' host time per step.

W1: 256 requests, prompt lengths uniform in [64, 1024], output lengths uniform in [32, 512], random token ids,
greedy, EOS ignored. Constrained, request i follows SCHEMAS[i % 4] (realistic shapes, each with a free-text
field, so that most outputs run to their length as the unconstrained ones do; one whose grammar completes
earlier ends then, "stop", and the table says how many did and how many tokens each run made).

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/structured.py --model /tmp/llama-3.1-8b --out benchmarks/results/structured-h200.json
    python benchmarks/structured.py --device cpu --num-requests 8 --prompt-range 16 64 --output-range 16 48

Mask time is StepStats.mask_s (host: llguidance filling the step's bitmasks, in its threads for a large batch);
it overlaps the step's forward pass, so what it costs shows in the decode steps' wall time and the
device's busy fraction beside the unconstrained run's (device time: CUDA events around each forward pass).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    add_w1_args,
    device_name,
    generate_with_stats,
    make_workload,
    summarize_steps,
    sync_device,
    w1_engine_args,
)
from common import section as run_section

from tinypaged import LLM, SamplingParams
from tinypaged.engine.sampling.structured import GrammarCompiler
from tinypaged.sampling_params import StructuredOutputsParams

SCHEMAS: list[dict[str, Any]] = [
    {  # a support ticket
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "priority": {"enum": ["low", "normal", "high", "urgent"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "description": {"type": "string"},
        },
        "required": ["id", "priority", "tags", "description"],
        "additionalProperties": False,
    },
    {  # a person, nested address, $defs
        "$defs": {
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 40},
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "address": {"$ref": "#/$defs/address"},
            "bio": {"type": "string"},
        },
        "required": ["name", "age", "email", "address", "bio"],
        "additionalProperties": False,
    },
    {  # a product review with scores
        "type": "object",
        "properties": {
            "product": {"type": "string", "maxLength": 32},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
            "recommended": {"type": "boolean"},
            "text": {"type": "string"},
        },
        "required": ["product", "rating", "pros", "recommended", "text"],
        "additionalProperties": False,
    },
    {  # an event log: an array of records
        "type": "object",
        "properties": {
            "events": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "ts": {"type": "integer", "minimum": 0},
                        "level": {"enum": ["debug", "info", "warn", "error"]},
                        "message": {"type": "string"},
                    },
                    "required": ["ts", "level", "message"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["events"],
        "additionalProperties": False,
    },
]


def compile_times(llm: LLM, repeats: int = 100) -> dict[str, Any]:
    """The tokenizer view's build, then each schema's compile on a fresh compiler (cold: built and its first
    mask computed) and again (cached: a lookup), and a request's own matcher (built from the grammar in the pool)."""
    engine = llm.engine
    fresh = GrammarCompiler(
        engine.grammars.tokenizer_file, engine.grammars.vocab_size, engine.grammars.eos_ids
    )
    t0 = time.perf_counter()
    fresh.tokenizer()
    out: dict[str, Any] = {"tokenizer_view_s": time.perf_counter() - t0, "schemas": []}
    for i, schema in enumerate(SCHEMAS):
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        grammar = fresh.compile(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(repeats):
            fresh.compile(StructuredOutputsParams(json=schema))
        cached = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            fresh.start(spec).result()
        start = (time.perf_counter() - t0) / repeats
        out["schemas"].append(
            {
                "schema": i,
                "cold_ms": 1e3 * cold,
                "in_pool_ms": 1e3 * grammar.compile_s,
                "cached_us": 1e6 * cached,
            }
            | {"matcher_start_us": 1e6 * start}
        )
    fresh.shutdown()
    return out


def run(llm: LLM, work: list[tuple[list[int], int]], constrained: bool) -> dict[str, Any]:
    """W1 through the engine's loop, every request at once, timed end to end, with its step totals and (when
    constrained) the per-step mask times and what the outputs were."""
    prompts = [{"prompt_token_ids": p} for p, _ in work]

    def params(i: int, n: int) -> SamplingParams:
        spec = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=spec)

    llm.generate(prompts[:4], [params(i, 4) for i in range(4)])  # warm-up: kernels, compiles
    sync_device()
    t0 = time.perf_counter()
    outs, stats = generate_with_stats(llm, prompts, [params(i, n) for i, (_, n) in enumerate(work)])
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict[str, Any] = {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "steps": summarize_steps(llm, stats),
        "output_lens": [len(o.outputs[0].token_ids) for o in outs],
    }
    if not constrained:
        return res
    masked = [s for s in stats if s.num_constrained]
    mask_ms = np.array([1e3 * s.mask_s for s in masked]) if masked else np.zeros(1)
    per_row_us = np.array([1e6 * s.mask_s / s.num_constrained for s in masked]) if masked else np.zeros(1)
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    valid = 0
    for o, (i, _) in zip(outs, enumerate(work), strict=True):
        if o.outputs[0].finish_reason == "stop":
            valid += _valid(o.outputs[0].text, SCHEMAS[i % len(SCHEMAS)])
    res["mask"] = {
        "steps": len(masked),
        "ms_per_step_p50": float(np.percentile(mask_ms, 50)),
        "ms_per_step_p99": float(np.percentile(mask_ms, 99)),
        "ms_per_step_max": float(mask_ms.max()),
        "us_per_row_p50": float(np.percentile(per_row_us, 50)),
        "mean_rows": float(np.mean([s.num_constrained for s in masked])) if masked else 0.0,
        # The slowest fills, to tell what makes the tail: (step, ms, rows).
        "slowest": [
            (s.step, round(1e3 * s.mask_s, 3), s.num_constrained)
            for s in sorted(masked, key=lambda s: s.mask_s)[-8:]
        ],
    }
    res["finished_by_grammar"] = len(stopped)
    res["valid_of_finished"] = valid
    return res


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # the GPU machine may not have it: parsing is the check then
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def print_table(res: dict[str, Any]) -> None:
    """The summary, last in the output."""
    plain, json_ = res.get("unconstrained", {}), res.get("json_schema", {})
    lines = [f"\n== structured outputs, {res['device']}, {res['requests']} requests (W1 shape) =="]
    if "output_tokens_per_s" in plain and "output_tokens_per_s" in json_:
        ratio = json_["output_tokens_per_s"] / plain["output_tokens_per_s"]
        lines.append(
            f"{'run':<14}{'tok/s':>10}{'tokens':>10}{'time s':>9}{'decode ms/step':>16}{'gpu busy':>10}"
        )
        for name, r in (("unconstrained", plain), ("json_schema", json_)):
            d = r["steps"]["decode"]
            step_ms = 1e3 * d["wall_s"] / max(1, d["steps"])
            lines.append(
                f"{name:<14}{r['output_tokens_per_s']:>10.1f}{r['output_tokens']:>10}{r['elapsed_s']:>9.2f}"
                f"{step_ms:>16.2f}{d['gpu_busy_fraction']:>10.0%}"
            )
        lines.append(f"json_schema / unconstrained throughput: {ratio:.3f} (target >= 0.90)")
        same = res.get("unconstrained_same_lengths", {})
        if "output_tokens_per_s" in same:
            # Requests that the grammar ends early make fewer tokens; the same lengths unconstrained compare
            # the same work: the constraint's own cost.
            d = same["steps"]["decode"]
            lines.append(
                f"{'unconstrained, the json run lengths':<14}: {same['output_tokens_per_s']:.1f} tok/s, "
                f"{same['output_tokens']} tokens, {same['elapsed_s']:.2f} s, decode "
                f"{1e3 * d['wall_s'] / max(1, d['steps']):.2f} ms/step, gpu busy {d['gpu_busy_fraction']:.0%}"
            )
            lines.append(
                f"json_schema / unconstrained with the same output lengths: "
                f"{json_['output_tokens_per_s'] / same['output_tokens_per_s']:.3f} (time "
                f"{same['elapsed_s'] / json_['elapsed_s']:.3f})"
            )
        m = json_["mask"]
        lines.append(
            f"mask fill per step: p50 {m['ms_per_step_p50']:.3f} ms, p99 {m['ms_per_step_p99']:.3f} ms, max "
            f"{m['ms_per_step_max']:.3f} ms over {m['steps']} steps (mean {m['mean_rows']:.0f} rows; "
            f"{m['us_per_row_p50']:.1f} us/row p50)"
        )
        lines.append(f"slowest fills (step, ms, rows): {m.get('slowest')}")
        lines.append(
            f"finished by the grammar: {json_['finished_by_grammar']} of {res['requests']} "
            f"({json_['valid_of_finished']} valid); the rest ran to their length"
        )
    c = res.get("compile", {})
    if "schemas" in c:
        lines.append(f"tokenizer view built once: {1e3 * c['tokenizer_view_s']:.0f} ms")
        for s in c["schemas"]:
            lines.append(
                f"schema {s['schema']}: compile cold {s['cold_ms']:.2f} ms, cached {s['cached_us']:.1f} us, "
                f"a request's matcher {s['matcher_start_us']:.1f} us"
            )
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    add_w1_args(ap)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        device=args.device,
        **w1_engine_args(args),
    )
    cfg = llm.config.model_config
    res: dict[str, Any] = {
        "device": device_name() if llm.engine.runner.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": str(cfg.path),
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.num_requests,
        "seed": args.seed,
        "prompt_range": args.prompt_range,
        "output_range": args.output_range,
        "async_scheduling": llm.engine.async_scheduling,
        "init_s": time.perf_counter() - t0,
    }
    work = make_workload(args.num_requests, cfg.vocab_size, args.seed, args.prompt_range, args.output_range)

    def section(name: str, fn: Any) -> Any:
        return run_section(res, name, fn, args.out)

    section("compile", lambda: compile_times(llm))
    section("unconstrained", lambda: run(llm, work, constrained=False))
    section("json_schema", lambda: run(llm, work, constrained=True))
    lens = res.get("json_schema", {}).get("output_lens")
    if lens:
        same = [(p, n) for (p, _), n in zip(work, lens, strict=True)]
        section("unconstrained_same_lengths", lambda: run(llm, same, constrained=False))
    try:
        print_table(res)
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()
