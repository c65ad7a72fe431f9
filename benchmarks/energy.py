"""Energy per unit of work on one GPU, each kind of work sustained long enough to reach the board's power limit:
what W1's kernels spend against the plainest kernels that move the same bytes or do the same FLOPs.

    python3 benchmarks/energy.py [--model DIR] [--seconds S] [--out DIR]
    python3 benchmarks/energy.py --from-json FILE      (a saved result's tables again, no GPU)

Each block replays one CUDA graph back to back for S seconds (default 4) while nvidia-smi samples the board's
power and SM clock every 20 ms; a block's power is the mean over its last S - 1 seconds (the first is the power
controller's ramp). Blocks:
- idle; 2 GiB read (summed) and copied by a Triton kernel of wide loads (J per TB moved);
- decode attention as W1 runs it: 32 layers of 256 sequences over contexts uniform in [96, 1536], with the
  engine's decode tile and two others (J per TB of K/V read);
- a decode step's matmuls at the 8B shape (32 x qkv, o, gate_up, down, and the LM head, weights out of the L2) at
  256, 192, 128 and 64 rows (J per TB of weights, pJ per FLOP), and an 8192^3 bf16 matmul (pJ per FLOP);
- those matmuls beside the read on part of the SMs (two streams): each alone, then both at once;
- with `--model`, W1 itself (seed 2, greedy), twice: against the strict roofline and the per-op floor at
  DESIGN.md's constants, and against the power-capped estimate at this board's (`roofline` in throughput.py);
  and its energy split by what its parts cost alone here.
Prints the tables last and writes `energy-h200.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import (
    COPY_TBPS,
    MATMUL_TFLOPS,
    generate_with_stats,
    greedy,
    kv_bytes_per_token,
    make_workload,
    prefill_flops,
    write_json,
)
from kernel_speed import DEV, DT, GEMV_SHAPES, capture, decode_layers
from throughput import ideal_decode_steps, roofline

import tinypaged.kernels as tk
from tinypaged import LLM, ops
from tinypaged.config import ModelConfig
from tinypaged.weights.random_model import PRESETS

ROOT = Path(__file__).resolve().parents[1]


class PowerLog:
    """nvidia-smi's samples of board power (W) and SM clock (MHz), each stamped on arrival."""

    def __init__(self, period_ms: int = 20) -> None:
        self.samples: list[tuple[float, float, float]] = []
        for power in ("power.draw.instant", "power.draw"):  # the instant reading where the driver has it
            cmd = [
                "nvidia-smi",
                f"--query-gpu={power},clocks.sm",
                "--format=csv,noheader,nounits",
                f"-lms={period_ms}",
            ]
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1
            )
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
            time.sleep(1.0)
            if self.samples:
                self.field = power
                return
            self.close()
        raise RuntimeError("nvidia-smi gave no power samples")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                watts, mhz = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), watts, mhz))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Mean power and clock over [t0, t1], and the energy (J) as mean power x duration."""
        inside = [(w, c) for t, w, c in self.samples if t0 <= t <= t1]
        if len(inside) < 5:
            raise RuntimeError(f"only {len(inside)} power samples in a {t1 - t0:.1f} s window")
        watts = sum(w for w, _ in inside) / len(inside)
        return {
            "watts": watts,
            "sm_mhz": sum(c for _, c in inside) / len(inside),
            "joules": watts * (t1 - t0),
            "samples": len(inside),
        }

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def sustain(log: PowerLog, graph: torch.cuda.CUDAGraph | None, seconds: float) -> dict[str, float]:
    """Replay `graph` back to back for `seconds` (or sleep, for None); the power of the last seconds - 1, and
    the device time of one replay over that window."""
    start = time.monotonic()
    if graph is None:
        time.sleep(seconds)
        return log.window(start + 1.0, time.monotonic()) | {"ms": 0.0}
    graph.replay()
    torch.cuda.synchronize()
    one = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one[0].record()
    graph.replay()
    one[1].record()
    one[1].synchronize()
    per = max(one[0].elapsed_time(one[1]), 1e-3)  # ms, to size the batches of replays between syncs
    batch = max(1, int(50 / per))
    while time.monotonic() - start < 1.0:
        for _ in range(batch):
            graph.replay()
        torch.cuda.synchronize()
    t0, replays = time.monotonic(), 0
    ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev[0].record()
    while time.monotonic() - t0 < seconds - 1.0:
        for _ in range(batch):
            graph.replay()
        replays += batch
        torch.cuda.synchronize()
    ev[1].record()
    ev[1].synchronize()
    t1 = time.monotonic()
    return log.window(t0, t1) | {"ms": ev[0].elapsed_time(ev[1]) / replays}


def block_res(
    log: PowerLog, name: str, fns: list[Any] | None, seconds: float, **units: float
) -> dict[str, Any]:
    """One block: `units` are what one replay of fns does (bytes, flops); the result adds their rates and the
    energy each costs."""
    res = sustain(log, capture(fns) if fns else None, seconds) | {"name": name} | units
    if fns:
        joules = res["watts"] * res["ms"] * 1e-3
        res["joules_per_replay"] = joules
        if "bytes" in units:
            res["TBps"] = units["bytes"] / res["ms"] / 1e9
            res["J_per_TB"] = joules / units["bytes"] * 1e12
        if "flops" in units:
            res["TFLOPs"] = units["flops"] / res["ms"] / 1e9
            res["pJ_per_flop"] = joules / units["flops"] * 1e12
    print(
        f"{name}: {res['ms']:.3f} ms, {res['watts']:.0f} W, {res['sm_mhz']:.0f} MHz"
        + (f", {res['TBps']:.2f} TB/s, {res['J_per_TB']:.0f} J/TB" if "TBps" in res else "")
        + (f", {res['TFLOPs']:.0f} TFLOP/s, {res['pJ_per_flop']:.2f} pJ/FLOP" if "TFLOPs" in res else ""),
        flush=True,
    )
    return res


@triton.jit
def _stream_kernel(src, dst, sums, num_chunks, BLOCK: tl.constexpr, COPY: tl.constexpr):
    """The programs take chunks of BLOCK elements in turn: copy them (COPY) or sum them (one float a program)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(pid, num_chunks, programs):
        offs = c * BLOCK + tl.arange(0, BLOCK)  # int32: the buffer holds under 2**31 elements
        x = tl.load(src + offs)
        if COPY:
            tl.store(dst + offs, x)
        else:
            acc += x.to(tl.float32)
    if not COPY:
        tl.store(sums + pid, tl.sum(acc))


class Stream:
    """A 2 GiB bf16 buffer streamed by `_stream_kernel` on a given number of programs (8 warps each), `block`
    elements a load: 4,096 over the whole GPU; on few programs, wider loads keep more bytes in flight."""

    def __init__(self, n: int = 2**30) -> None:
        assert n < 2**31 and n % 2**16 == 0
        self.src = torch.randn(n, device=DEV, dtype=DT)
        self.dst = torch.empty_like(self.src)
        self.sums = torch.zeros(n // 4096, device=DEV, dtype=torch.float32)
        self.nbytes = n * 2

    def launch(self, programs: int, copy: bool = False, block: int = 4096) -> None:
        _stream_kernel[(programs,)](
            self.src, self.dst, self.sums, self.src.numel() // block, BLOCK=block, COPY=copy, num_warps=8
        )

    def check(self, programs: int, block: int = 4096) -> None:
        self.sums.zero_()
        self.launch(programs, block=block)
        torch.testing.assert_close(self.sums.sum(), self.src.float().sum(), rtol=1e-3, atol=1.0)
        self.launch(programs, copy=True, block=block)
        assert torch.equal(self.dst, self.src), "the copy kernel must copy"


def streams(log: PowerLog, seconds: float, st: Stream) -> list[dict[str, Any]]:
    """The plainest bytes: the buffer read (summed) and copied over the whole GPU."""
    full = 8 * torch.cuda.get_device_properties(DEV).multi_processor_count
    st.check(full)
    return [
        block_res(log, "read (Triton)", [lambda: st.launch(full)], seconds, bytes=st.nbytes),
        block_res(log, "copy (Triton)", [lambda: st.launch(full, copy=True)], seconds, bytes=2 * st.nbytes),
    ]


def side_by_side(
    log: PowerLog, seconds: float, st: Stream, name: str, fns: list[Any], programs: int, block: int
) -> dict:
    """FLOPs beside bytes at the power cap: `fns` (a matmul graph) on one stream and the buffer read by
    `programs` programs on another, each alone, then both at once, the same work each time."""
    graph = capture(fns)
    st.check(programs, block)

    def timed(count_a: int, count_b: int) -> tuple[float, dict[str, float]]:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for i in range(max(count_a, count_b)):
            if i < count_a:
                with torch.cuda.stream(a):
                    graph.replay()
            if i < count_b:
                with torch.cuda.stream(b):
                    st.launch(programs, block=block)
        torch.cuda.synchronize()
        t1 = time.monotonic()
        return t1 - t0, log.window(t0 + 0.5, t1) if t1 - t0 > 1.5 else {}

    timed(3, 3)
    per_a = timed(5, 0)[0] / 5
    per_b = timed(0, 5)[0] / 5
    count_a, count_b = max(1, int(seconds / per_a)), max(1, int(seconds / per_b))
    timed(count_a, 0)  # to the power cap
    alone_a, pa = timed(count_a, 0)
    alone_b, pb = timed(0, count_b)
    both, pab = timed(count_a, count_b)
    res = {
        "name": f"{name} beside a read on {programs} programs ({block} a load)",
        "alone_a_s": alone_a,
        "alone_b_s": alone_b,
        "both_s": both,
        "serial_s": alone_a + alone_b,
        "overlap": (alone_a + alone_b - both) / min(alone_a, alone_b),
        "read_TBps_alone": count_b * st.nbytes / alone_b / 1e12,
        "power_alone_a": pa,
        "power_alone_b": pb,
        "power_both": pab,
    }
    print(
        f"{res['name']}: alone {alone_a:.2f} + {alone_b:.2f} s (read {res['read_TBps_alone']:.2f} TB/s, "
        f"{pb['watts']:.0f} W), both {both:.2f} s ({pab['watts']:.0f} W, {pab['sm_mhz']:.0f} MHz): "
        f"{100 * res['overlap']:.0f}% of the shorter hidden",
        flush=True,
    )
    return res


ATTN_TILES = {  # decode tiles: the engine's, then two that W1 measured near it (BENCHMARKS.md, runs 45-48)
    "main": None,
    "2 warps": tk.attention.AttnConfig(16, 64, num_warps=2, num_stages=3),
    "128 keys": tk.attention.AttnConfig(16, 128, num_warps=4, num_stages=3),
}


def attention(log: PowerLog, seconds: float, batch: int = 256, layers: int = 32) -> list[dict[str, Any]]:
    """A decode step's attention as the engine launches it (longest sequences first, splits for 2,048 tokens),
    with the engine's decode tile and two others."""
    hq, hkv, d = 32, 8, 128
    ls = decode_layers(batch, layers, hq, hkv, d)
    q = torch.randn(batch, hq, d, device=DEV, dtype=DT)
    out = torch.empty_like(q)
    kv_bytes = sum(int(x["sl"].sum()) for x in ls) * hkv * d * 2 * 2
    prefill = tk.attention.default_configs(q, hq // hkv)[1]
    res = []
    for name, tile in ATTN_TILES.items():
        fns = [
            lambda x=x, c=(tile, prefill) if tile else None: tk.paged_attention(
                q,
                x["kv"],
                x["bt"],
                x["sl"],
                x["qsl"],
                d**-0.5,
                max_query_len=1,
                max_seq_len=2048,
                seq_order=x["order"],
                out=out,
                configs=c,
            )
            for x in ls
        ]
        res.append(
            block_res(
                log, f"decode attention, {batch} x {layers} layers, {name}", fns, seconds, bytes=kv_bytes
            )
        )
    del ls
    torch.cuda.empty_cache()
    return res


MATMUL_ROWS = (256, 192, 128, 64)


def matmuls(log: PowerLog, seconds: float, st: Stream, rows: tuple[int, ...] = MATMUL_ROWS) -> list[dict]:
    """A decode step's linear layers (32 of each, and the LM head), every weight its own tensor, as in the
    engine; then the 8192^3 matmul the roofline's FLOP rate comes from; then each of those beside a read."""
    layers = [s for s in GEMV_SHAPES if "tp2" not in s[0]]
    weights = {
        name: [
            torch.randn(n, k, device=DEV, dtype=DT) / k**0.5 for _ in range(1 if name == "lm_head" else 32)
        ]
        for name, n, k in layers
    }
    wbytes = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    out, step = [], {}
    for m in rows:
        xs = {k: torch.randn(m, k, device=DEV, dtype=DT) for _, _, k in layers}
        step[m] = [lambda x=xs[k], w=w: F.linear(x, w) for name, _, k in layers for w in weights[name]]
        flops = sum(2 * m * w.numel() for ws in weights.values() for w in ws)
        out.append(block_res(log, f"decode matmuls, {m} rows", step[m], seconds, bytes=wbytes, flops=flops))
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=DT) for _ in range(2))
    c = torch.empty_like(a)
    big = [lambda: torch.mm(a, b, out=c)] * 4
    out.append(block_res(log, "matmul 8192^3", big[:1], seconds, flops=2 * 8192**3))
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for programs, block in ((sms // 4, 16384), (sms // 2, 16384), (sms // 2, 32768)):
        out.append(side_by_side(log, seconds, st, "matmul 8192^3", big, programs, block))
    out.append(
        side_by_side(log, seconds, st, f"decode matmuls, {rows[0]} rows", step[rows[0]], sms // 2, 16384)
    )
    return out


def board(res: dict[str, Any]) -> dict[str, Any]:
    """This board's constants from the blocks: the read's bandwidth, the 8192^3 matmul's rate, and the power of
    idle, of that read, of that matmul, and the board's limit."""
    by = {r["name"]: r for r in res["blocks"]}
    read, mm = by["read (Triton)"], by["matmul 8192^3"]
    return {
        "copy_tbps": read["TBps"],
        "matmul_tflops": mm["TFLOPs"],
        "watts": (by["idle"]["watts"], read["watts"], mm["watts"], res["power_limit_w"]),
        "design": {"copy_tbps": COPY_TBPS, "matmul_tflops": MATMUL_TFLOPS},
    }


def w1(log: PowerLog, model: str, constants: dict[str, Any], runs: int = 2) -> dict[str, Any]:
    """W1 (seed 2, greedy, the engine's defaults) with its power, against the strict roofline and the per-op
    floor at DESIGN.md's constants, and against the power-capped estimate at this board's."""
    llm = LLM(model=model, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
    cfg = llm.engine.config.model_config
    work = make_workload(256, cfg.vocab_size, seed=2)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [greedy(o) for _, o in work]
    llm.generate(prompts[:4], greedy(4))
    design = roofline(cfg, work)
    here = roofline(cfg, work, constants["copy_tbps"], constants["matmul_tflops"], constants["watts"])
    bounds = {
        "strict_s": design["total_strict_s"],
        "per_op_s": design["total_per_op_s"],
        "strict_this_board_s": here["total_strict_s"],
        "capped_this_board_s": here["total_capped_s"],
    }
    out: dict[str, Any] = {"bounds": bounds, "runs": []}
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        outs, _ = generate_with_stats(llm, prompts, params, time_device=False)
        torch.cuda.synchronize()
        t1 = time.monotonic()
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        run = log.window(t0, t1) | {"elapsed_s": t1 - t0, "tok_s": n / (t1 - t0)}
        run |= {"of_" + k.removesuffix("_s"): v / (t1 - t0) for k, v in bounds.items()}
        run["J_per_token"] = run["joules"] / n
        print(
            f"W1: {run['tok_s']:.0f} tok/s, {run['watts']:.0f} W, {run['sm_mhz']:.0f} MHz, {run['joules']:.0f} J; "
            + ", ".join(f"{100 * run['of_' + k.removesuffix('_s')]:.1f}% of {k}" for k in bounds),
            flush=True,
        )
        out["runs"].append(run)
        time.sleep(2.0)
    return out


def energy_parts(cfg: ModelConfig, res: dict[str, Any]) -> dict[str, float]:
    """W1's measured energy split by what its work costs alone on this board (the blocks): the decode steps'
    matmuls (each step's batch size interpolated between the blocks' row counts, extrapolated below the
    smallest), decode attention (the ideal schedule's K/V bytes at the engine tile's J/TB) and the prefill's FLOPs
    (at the 8192^3 matmul's pJ/FLOP). The rest is everything else: norms, SwiGLU, rotary, the prefill's attention
    beyond that rate, sampling, gaps between kernels."""
    by = {r["name"]: r for r in res["blocks"]}
    work = make_workload(256, cfg.vocab_size, seed=2)
    rows = sorted(MATMUL_ROWS)
    joules = [by[f"decode matmuls, {m} rows"]["joules_per_replay"] for m in rows]
    per_row = (joules[1] - joules[0]) / (rows[1] - rows[0])
    xs, ys = [0, *rows], [joules[0] - rows[0] * per_row, *joules]
    steps = list(ideal_decode_steps(work))
    kv = sum(ctx for _, ctx in steps) * kv_bytes_per_token(cfg)
    parts = {
        "decode_matmuls_j": sum(float(np.interp(n, xs, ys)) for n, _ in steps),
        "decode_attention_j": kv * by["decode attention, 256 x 32 layers, main"]["J_per_TB"] / 1e12,
        "prefill_flops_j": sum(prefill_flops(cfg, len(p)) for p, _ in work)
        * by["matmul 8192^3"]["pJ_per_flop"]
        / 1e12,
    }
    runs = res["w1"]["runs"]
    w1_j = sum(r["joules"] for r in runs) / len(runs)
    w1_s = sum(r["elapsed_s"] for r in runs) / len(runs)
    parts["sum_j"] = sum(parts.values())
    return parts | {
        "kv_tb": kv / 1e12,
        "w1_j": w1_j,
        "rest_j": w1_j - parts["sum_j"],
        "sum_at_w1_power_s": parts["sum_j"] / (w1_j / w1_s),
    }


def table(res: dict[str, Any]) -> str:
    """The blocks and W1's runs as a markdown table."""
    cols = (
        ("ms", 3),
        ("watts", 0),
        ("sm_mhz", 0),
        ("TBps", 2),
        ("J_per_TB", 0),
        ("TFLOPs", 0),
        ("pJ_per_flop", 2),
    )
    lines = [
        "| block | ms | W | SM MHz | TB/s | J/TB | TFLOP/s | pJ/FLOP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["blocks"]:
        if "both_s" not in r:
            cells = [f"{r[k]:.{p}f}" if r.get(k) is not None else "" for k, p in cols]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| side by side | alone, s | the read alone, s (TB/s, W) | both, s (W, SM MHz) | of the shorter hidden |",
        "|---|---|---|---|---|",
    ]
    for r in res["blocks"]:
        if "both_s" in r:
            pb, pab = r["power_alone_b"], r["power_both"]
            lines.append(
                f"| {r['name']} | {r['alone_a_s']:.2f} | {r['alone_b_s']:.2f} ({r['read_TBps_alone']:.2f}, "
                f"{pb['watts']:.0f}) | {r['both_s']:.2f} ({pab['watts']:.0f}, {pab['sm_mhz']:.0f}) | "
                f"{100 * r['overlap']:.0f}% |"
            )
    if "w1" in res:
        bounds = res["w1"]["bounds"]
        lines += [
            "",
            "| W1 (seed 2) | tok/s | W | SM MHz | J | "
            + " | ".join(f"of {k.removesuffix('_s')} ({v:.2f} s)" for k, v in bounds.items())
            + " |",
            "|---" * (5 + len(bounds)) + "|",
        ]
        for r in res["w1"]["runs"]:
            lines.append(
                f"| {r['elapsed_s']:.2f} s | {r['tok_s']:.0f} | {r['watts']:.0f} | {r['sm_mhz']:.0f} | "
                f"{r['joules']:.0f} | "
                + " | ".join(f"{100 * r['of_' + k.removesuffix('_s')]:.1f}%" for k in bounds)
                + " |"
            )
    parts = res.get("w1", {}).get("energy_parts")
    if parts:
        lines += ["", "| W1's energy | J |", "|---|---|"]
        lines += [
            f"| {k.removesuffix('_j').replace('_', ' ')} | {v:.0f} |"
            for k, v in parts.items()
            if k.endswith("_j")
        ]
        lines.append(f"| the parts alone at W1's mean power | {parts['sum_at_w1_power_s']:.2f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a model directory: also run W1")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "out")))
    parser.add_argument("--from-json", help="a saved result: print its tables again (no GPU needed)")
    args = parser.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        if "w1" in res:  # runs before the model's config was saved ran the 8B preset
            raw = res["w1"].get("model_config") or {"model_type": "llama", **PRESETS["llama-3.1-8b"]}
            res["w1"]["energy_parts"] = energy_parts(ModelConfig.from_dict(Path("."), raw), res)
        print(table(res))
        return
    torch.manual_seed(0)
    ops.prefer_cublaslt()
    log = PowerLog()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "blocks": []}
    res["power_field"] = log.field
    limit = ["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader,nounits"]
    res["power_limit_w"], res["max_sm_mhz"] = (
        float(v) for v in subprocess.check_output(limit, text=True).split(",")
    )
    try:
        res["blocks"].append(block_res(log, "idle", None, args.seconds))
        st = Stream()
        res["blocks"] += streams(log, args.seconds, st)
        res["blocks"] += attention(log, args.seconds)
        res["blocks"] += matmuls(log, args.seconds, st)
        res["constants"] = board(res)
        if args.model:
            res["w1"] = w1(log, args.model, res["constants"])
            res["w1"]["model_config"] = json.loads((Path(args.model) / "config.json").read_text())
            res["w1"]["energy_parts"] = energy_parts(ModelConfig.from_dir(args.model), res)
    finally:
        log.close()
        res["table"] = table(res)
        write_json(Path(args.out) / "energy-h200.json", res)
    print("\n" + res["table"])


if __name__ == "__main__":
    main()
