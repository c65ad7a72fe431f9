"""How fast the GPU's memory serves the INT4 kernel's word loads with no arithmetic behind them (issue 38).

    python3 benchmarks/load_pattern.py --json benchmarks/results/load-pattern-h200.json

The INT4 Gluon kernel (`kernels/lowbit_mma.py`) reads its layers at 2.1-2.5 TB/s at one row where bf16's GEMV
reads 3.95 on the same board (benchmarks/NOTES.md, runs 133-135). Neither fewer instructions, nor a second step's
words in flight, nor 128-byte row runs moved it (run 110). This script asks whether the loads alone can go faster:
a kernel that reads the words in the INT4 kernel's pattern (a step: 64 bytes of each of 128 rows, four 16-byte
loads a thread, 8 KB a program; the next step's asked for while the step is "used", here XOR-ed into a register)
and nothing else. It times the same bytes read:
- `rows64`: that pattern, over rows of 4096 INT4 codes (gate_up's and the other K = 4096 layers'), 128 x 24 rows a
  multiprocessor (830 MB on 132), so that every program count below gets a whole number of tasks each;
- `rows64_l2`: the same loads asking the L2 for 128 bytes of the row (`ld.global.nc.L2::128B`, the kernel's);
- `rows128` / `rows256`: 128 or 256 bytes of each of 64 or 32 rows a step (the same 8 KB a step);
- `contig`: a step's 8 KB contiguous (what a layout repacked by tile would read);
each with the step's words used at once (`ahead` 0), one step (the kernel's) or two steps ahead, and the programs
on the board capped at 1, 2, 4 or 6 a multiprocessor (a persistent grid: the INT4 kernel holds four, at 122
registers a thread), so that bytes in flight and the pattern are measured apart. A read of every byte as one
device-to-device copy is the ceiling beside them. Each launch reads its own copy of the words (past the L2), timed
as CUDA-graph replays; the table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from common import write_json
from fp8_gemm_sweep import graph_us
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tinypaged.kernels.lowbit_mma import _words_l2_asm

WORDS_STEP = gl.constexpr(2048)  # int32 words a program reads a step: 8 KB, the INT4 kernel's at 128 rows
# name: (words of a row a step, L2 size asked for (0: plain loads), contiguous step)
PATTERNS = {
    "rows64": (16, 0, False),
    "rows64_l2": (16, 128, False),
    "rows128": (32, 0, False),
    "rows256": (64, 0, False),
    "contig": (16, 0, True),
}


@gluon.jit
def _load(w_ptr, offs, L2: gl.constexpr):
    if L2 == 0:
        return gl.load(w_ptr + offs)
    else:
        ASM: gl.constexpr = _words_l2_asm(L2, 4)[0]
        ARGS: gl.constexpr = _words_l2_asm(L2, 4)[1]
        return gl.inline_asm_elementwise(ASM, ARGS, [w_ptr + offs], gl.int32, is_pure=True, pack=4)


@gluon.jit
def _offsets(task, i, r, c, words_per_row, steps, pieces, RUN: gl.constexpr, CONTIG: gl.constexpr):
    """Word offsets of step i of a task (a tile of rows and a piece of K) `[BLOCK_N, RUN]`."""
    BLOCK_N: gl.constexpr = r.shape[0]
    if CONTIG:  # the task's steps one after the other, each BLOCK_N * RUN words in a run
        base = (task * steps + i) * (BLOCK_N * RUN)
        offs = base + r[:, None] * RUN + c[None, :]
    else:
        tile = task // pieces
        word0 = gl.multiple_of(((task % pieces) * steps + i) * RUN, RUN)
        offs = (tile * BLOCK_N + r).to(gl.int64)[:, None] * words_per_row + (word0 + c)[None, :]
    return offs


@gluon.jit
def _step_words(w_ptr, task, i, r, c, words_per_row, steps, pieces, RUN: gl.constexpr, CONTIG: gl.constexpr,
                L2: gl.constexpr):  # fmt: skip
    """Step i's words of a task."""
    return _load(w_ptr, _offsets(task, i, r, c, words_per_row, steps, pieces, RUN, CONTIG), L2)


@gluon.jit
def _read_kernel(
    w_ptr, out_ptr, words_per_row, steps, pieces, tasks,
    RUN: gl.constexpr, L2: gl.constexpr, CONTIG: gl.constexpr, AHEAD: gl.constexpr, PROGRAMS: gl.constexpr,
    WARPS: gl.constexpr,
):  # fmt: skip
    BLOCK_N: gl.constexpr = WORDS_STEP // RUN
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (RUN // 4), RUN // 4], [WARPS, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, RUN, layout=gl.SliceLayout(0, layout))
    acc = gl.zeros([BLOCK_N, RUN], gl.int32, layout)
    for task in range(gl.program_id(0), tasks, PROGRAMS):
        if AHEAD == 0:  # each step's words used as they come
            for i in range(steps):
                acc = acc ^ _step_words(w_ptr, task, i, r, c, words_per_row, steps, pieces, RUN, CONTIG, L2)
        else:  # the words of the AHEAD (1 or 2) steps after the one used already asked for
            cur = _step_words(w_ptr, task, 0, r, c, words_per_row, steps, pieces, RUN, CONTIG, L2)
            nxt = _step_words(w_ptr, task, AHEAD - 1, r, c, words_per_row, steps, pieces, RUN, CONTIG, L2)
            for i in range(steps):
                j = gl.minimum(i + AHEAD, steps - 1)
                new = _step_words(w_ptr, task, j, r, c, words_per_row, steps, pieces, RUN, CONTIG, L2)
                acc = acc ^ cur
                if AHEAD == 1:
                    cur = new
                else:
                    cur = nxt
                    nxt = new
    gl.store(out_ptr + gl.program_id(0) * WORDS_STEP + r[:, None] * RUN + c[None, :], acc)


def read(w: torch.Tensor, out: torch.Tensor, pattern: str, ahead: int, programs: int, split: int) -> None:
    """Every word of `w` (rows x words) read once in `pattern`, K cut into `split` pieces a row tile."""
    run, l2, contig = PATTERNS[pattern]
    n, words = w.shape
    block_n = WORDS_STEP.value // run
    steps = words // (split * run)
    tasks = (n // block_n) * split
    _read_kernel[(programs,)](
        w, out, words, steps, split, tasks,
        RUN=run, L2=l2, CONTIG=contig, AHEAD=ahead, PROGRAMS=programs, WARPS=4, num_warps=4,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4, 6], help="programs an SM (7 fit)")
    p.add_argument("--aheads", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    p.add_argument("--split", type=int, default=2, help="K pieces a row tile (the INT4 kernel's gate_up: 2)")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # Rows of 4096 INT4 codes, as many as give each program count a whole number of tasks.
    n, words = 128 * 24 * sms, 4096 // 8
    nbytes = n * words * 4
    copies = 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randint(-(2**31), 2**31 - 1, (n, words), device="cuda", dtype=torch.int32, generator=gen)
          for _ in range(copies)]  # fmt: skip
    out = torch.empty(max(args.per_sm + [1]) * sms * WORDS_STEP.value, device="cuda", dtype=torch.int32)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "sms": sms, "bytes": nbytes, "rows": []}
    flat = [w.view(-1) for w in ws]
    dst = torch.empty_like(flat[0])
    copy_us = graph_us(lambda i: dst.copy_(flat[i]), copies)
    res["copy_us"] = copy_us
    res["copy_tbs"] = 2 * nbytes / copy_us / 1e6  # read and written
    print(f"device-to-device copy: {copy_us:.1f} us, {res['copy_tbs']:.2f} TB/s read + written", flush=True)
    # Every word read once: rows64 one step ahead on one program a multiprocessor, each program's XOR of the words
    # that fell on each place of its tile, against the same XOR of the words by torch.
    read(ws[0], out, "rows64", 1, sms, args.split)
    got = out[: sms * WORDS_STEP.value].view(sms, 128, 16)
    total = torch.zeros(128, 16, device="cuda", dtype=torch.int32)
    for p in range(sms):
        total ^= got[p]
    tiles = ws[0].view(n // 128, 128, words // 16, 16).permute(0, 2, 1, 3).reshape(-1, 128, 16)
    want = torch.zeros_like(total)
    while len(tiles) > 1:  # XOR-folded in halves
        if len(tiles) % 2:
            want ^= tiles[-1]
            tiles = tiles[:-1]
        tiles = tiles[0::2] ^ tiles[1::2]
    want ^= tiles[0]
    res["xor_equal"] = bool(torch.equal(total, want))  # every word read once
    print(f"every word read once (rows64, one ahead): {res['xor_equal']}")
    for pattern, ahead, per_sm in itertools.product(args.patterns, args.aheads, args.per_sm):
        programs = per_sm * sms
        us = graph_us(lambda i, p=pattern, a=ahead, g=programs: read(ws[i], out, p, a, g, args.split), copies)
        row = {"pattern": pattern, "ahead": ahead, "per_sm": per_sm, "us": us, "tbs": nbytes / us / 1e6}
        res["rows"].append(row)
        print(row, flush=True)
        write_json(args.json, res)
    write_json(args.json, res)
    print(f"\n| pattern | ahead | programs / SM | us | TB/s (copy {res['copy_tbs'] / 2:.2f} read) |")
    print("|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['pattern']} | {r['ahead']} | {r['per_sm']} | {r['us']:.1f} | {r['tbs']:.2f} |")


if __name__ == "__main__":
    main()
