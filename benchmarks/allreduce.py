"""All-reduce latency between this node's GPUs inside CUDA graphs, by message size: NCCL beside the
symmetric-memory kernels: torch's two-shot (tinypaged.model.parallel.SymmMemAllReduce, which tensor
parallelism uses between SYMM_MEM_MIN_BYTES and SYMM_MEM_MAX_BYTES) and one-shot (every rank reads every peer's
whole buffer), each with its copy into the shared buffer, and each checked against NCCL's sums.

    python3 benchmarks/allreduce.py [--gpus 2] [--out benchmarks/results/allreduce-h200x2.json]

bf16 messages from 8 KiB (a batch-1 decode step's hidden state at 4096) to 8 MiB; a graph holds 16 calls and
is replayed 20 times after warming up, so a figure is the mean of 320 calls. Prints a table last; JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import device_name, write_json

from tinypaged.model.parallel import SymmMemAllReduce

SIZES_KIB = [8, 32, 128, 512, 2048, 8192]
CALLS, REPLAYS = 16, 20


def one_shot(fast: SymmMemAllReduce, x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks in place by torch's one-shot kernel, from the same buffer."""
    flat = x.view(-1)
    buf = fast.buffer[: flat.numel()]
    buf.copy_(flat)
    torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", fast.group_name, flat)
    return x


def timed(fn: Any) -> float:
    """Microseconds per call of `fn` (one all-reduce), CALLS of them captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (CALLS * REPLAYS)


def rank_main(rank: int, world: int, port: int, out: Path | None) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    fast = SymmMemAllReduce.create(group, device)
    if fast is None:
        raise SystemExit("symmetric memory is not available here")
    rows = []
    for kib in SIZES_KIB:
        n = kib * 1024 // 2
        gen = torch.Generator(device).manual_seed(rank * 1000 + kib)
        src = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
        want = src.clone()
        dist.all_reduce(want, group=group)
        row: dict[str, Any] = {"kib": kib}
        methods = {"one_shot": lambda t: one_shot(fast, t), "two_shot": fast.all_reduce}
        for name, fn in methods.items():
            got = fn(src.clone())
            row[f"{name}_max_abs_vs_nccl"] = (got.float() - want.float()).abs().max().item()
        x = src.clone()
        # Scaled each call so that the values stay finite however often the graph replays.
        row["nccl_us"] = timed(lambda x=x: dist.all_reduce(x.mul_(0.5), group=group))
        for name, fn in methods.items():
            row[f"{name}_us"] = timed(lambda x=x, fn=fn: fn(x.mul_(0.5)))
        row["scale_us"] = timed(lambda x=x: x.mul_(0.5))
        rows.append(row)
    if rank == 0:
        res = {
            "device": device_name(),
            "gpus": world,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        res["rows"] = rows
        if out:
            write_json(out, res)
        print(
            f"\nbf16 all-reduce in CUDA graphs on {res['device']} x{world} (us a call, less the scaling kernel)"
        )
        print("| size | NCCL | one-shot | two-shot | one-shot / NCCL | max-abs vs NCCL (one / two) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            s = r["scale_us"]
            nccl, one, two = r["nccl_us"] - s, r["one_shot_us"] - s, r["two_shot_us"] - s
            print(
                f"| {r['kib']} KiB | {nccl:.1f} | {one:.1f} | {two:.1f} | {one / nccl:.2f} | "
                f"{r['one_shot_max_abs_vs_nccl']:.3g} / {r['two_shot_max_abs_vs_nccl']:.3g} |"
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.gpus, port, args.out), nprocs=args.gpus)


if __name__ == "__main__":
    main()
