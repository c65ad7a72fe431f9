"""The default model served from its Q4_1 GGUF on the CPU against llama.cpp on the same file (issue 38, CPU part):
kernels, one request at a time, 32 batched, weights in memory, greedy agreement; a table against the targets last.

    pip install llama-cpp-python   # benchmark only, never in CI: builds llama.cpp from source (minutes on 2 cores)
    flock /work/notes/bench.lock python benchmarks/cpu_lowbit.py --json benchmarks/results/cpu-lowbit.json

llama-cpp-python is built on the machine from PyPI's sdist with its defaults plus `CMAKE_ARGS="-DGGML_NATIVE=ON
-DGGML_OPENMP=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"` (native: the machine's AVX2 / AVX-512;
OpenMP threads), `CMAKE_BUILD_PARALLEL_LEVEL=2`; it runs with `n_threads` = the cores torch uses (2 here). On a
machine with AMX (an Intel Xeon here) the native build enables AMX_INT8 and crashed in its first decode on the
VM: there, build with `-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF` instead (benchmarks/HISTORY.md).

- `kernels`: each layer shape of the model (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, the LM
  head 49152x576) at 1 and 32 rows: f32 matmul, the dequantize-then-matmul reference (`ref_wint_linear`),
  torch's INT4 kernel in bf16 and in f32 activations, its INT8 per-row kernel in bf16; the LM head also in
  bf16 and as `cpu.head_weight` (the Q8_0 codes split in two nibbles). Thirty copies of each small weight
  are cycled, as the model's 30 layers are, so they are read from memory, not cache.
- `single`: the same 8 chat prompts (token ids from tinypaged's tokenizer, given as ids to both engines), greedy,
  64 new tokens each (EOS ignored), one request at a time: tokens/s = generated tokens / wall time including
  prefill, tinypaged (GGUF served quantized, what `tinypaged serve` runs with no model) and llama.cpp,
  interleaved prompt by prompt (`--rounds` passes, the order alternating), so that the shared machine's drift
  falls on both alike.
- `batched`: 32 requests of those prompts at once through tinypaged (64 tokens each): generated tokens / wall.
- `memory`: the model's weights in memory (parameters; the engine's `weights_bytes`) against the f32 conversion.
- `agreement`: greedy tokens over 24 tokens on 3 prompts not used elsewhere (the target's count), and on those
  with 30 more ("Tell me about ..."), the quantized engine against its f32 conversion, and llama.cpp against it
  too: a steadier rate, and what llama.cpp's own arithmetic gives on the same file.

Targets: one at a time >= 0.7x llama.cpp; 32 batched >= 3x llama.cpp one at a time; weights <= 25% of f32;
agreement with f32 >= 2 of 3 prompts.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import write_json

from tinypaged import LLM, SamplingParams
from tinypaged.model.quant import cpu, lowbit
from tinypaged.weights import fetch

PROMPTS = [
    "Explain how a hash table works.",
    "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?",
    "Give three tips for learning a new language.",
    "Describe the water cycle in simple terms.",
    "How do vaccines train the immune system?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a list and a tuple in Python?",
]
HELD_OUT = ["Tell me about the history of the bicycle.", "Why is the sky blue?", "List some uses of copper."]
TOPICS = [
    "how bees make honey",
    "the French revolution",
    "black holes",
    "how to bake bread",
    "the rules of chess",
    "photosynthesis",
    "the stock market",
    "volcanoes",
    "the Roman empire",
    "machine learning",
    "how airplanes fly",
    "the water cycle",
    "coffee",
    "the moon landing",
    "earthquakes",
    "the human heart",
    "jazz music",
    "climate change",
    "the printing press",
    "sleep",
    "electric cars",
    "the Great Wall of China",
    "penguins",
    "the internet",
    "vitamins",
    "Shakespeare",
    "rainbows",
    "glaciers",
    "the Olympic games",
    "tea",
]
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NEW_TOKENS = 64


def _ms(fn: Any, n: int = 60) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def kernels() -> dict[str, Any]:
    """Milliseconds a call of each path, at 1 and 32 rows."""
    out: dict[str, Any] = {}
    for rows in (1, 32):
        for name, (n, k) in SHAPES.items():
            out[f"{name}_m{rows}"] = _layer_times(n, k, rows)
            print(f"{name:8s} m={rows:2d} " + _fmt(out[f"{name}_m{rows}"]), flush=True)
        out[f"lm_head_m{rows}"] = _head_times(rows)
        print(f"lm_head  m={rows:2d} " + _fmt(out[f"lm_head_m{rows}"]), flush=True)
    return out


def _fmt(row: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in row.items())


def _layer_times(n: int, k: int, rows: int) -> dict[str, float]:
    ws = [lowbit.quantize_rtn(torch.randn(n, k), 4, 32, False) for _ in range(30)]
    packs = [cpu.pack(lowbit.unpack(w.qweight, 4), w.scales, w.zeros, None, 4, 32) for w in ws]
    dense = [lowbit.dequantize_weight(w) for w in ws]
    w8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(30)]
    s8 = torch.rand(n).bfloat16()
    x = torch.randn(rows, k)
    xb = x.bfloat16()
    sz32 = packs[0].scales.float()
    i = iter(range(10**9))
    return {
        "f32": _ms(lambda: x @ dense[next(i) % 30].T),
        "dequant_ref": _ms(lambda: lowbit.ref_wint_linear(x, ws[next(i) % 30]), 10),
        "int4_bf16": _ms(lambda: cpu.packed_linear(x, packs[next(i) % 30])),
        "int4_f32": _ms(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packs[next(i) % 30].codes, 32, sz32), 10
        ),
        "int8_bf16": _ms(lambda: torch.ops.aten._weight_int8pack_mm(xb, w8[next(i) % 30], s8)),
    }


def _head_times(rows: int) -> dict[str, float]:
    w = _q8(torch.randn(49152, 576) * 0.05)
    emb = cpu.int8_embedding(w)
    assert emb is not None
    x = torch.randn(rows, 576)
    wb, head_scales = w.bfloat16(), torch.rand(49152).bfloat16()
    return {
        "f32": _ms(lambda: x @ w.T, 20),
        "bf16": _ms(lambda: x.bfloat16() @ wb.T, 20),
        "int8_row_bf16": _ms(
            lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), emb.codes, head_scales), 20
        ),
        "q8_0_nibbles_int4": _ms(lambda: emb.logits(x), 20),
    }


def _q8(w: torch.Tensor) -> torch.Tensor:
    """w rounded as Q8_0 (float16 scale amax / 127 per 32), in float32: a stand-in for the file's embedding."""
    g = w.view(w.shape[0], -1, 32)
    d = (g.abs().amax(-1) / 127).half().float()
    return (torch.round(g / d[..., None]).clamp(-127, 127) * d[..., None]).view_as(w)


def prompt_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    """Each prompt in the chat template, as token ids (both engines then read the same ids)."""
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def ours_run(llm: LLM, p: list[int], new: int) -> list[int]:
    """One greedy request of `new` tokens (EOS ignored), alone."""
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids)


def ours_eager(llm: LLM, p: list[int], new: int) -> list[int]:
    """`ours_run` with the compiled CPU decode graph detached (model/cpu_graph.py): every step eager."""
    runner = llm.engine.runner
    graph, runner.cpu_graph = runner.cpu_graph, None
    try:
        return ours_run(llm, p, new)
    finally:
        runner.cpu_graph = graph


def wait_for_graph(llm: LLM) -> tuple[str, float]:
    """Wait until the engine's CPU decode graph is built or loaded; its state and the seconds waited."""
    graph, t = llm.engine.runner.cpu_graph, time.perf_counter()
    return (graph.wait() if graph else "none"), time.perf_counter() - t


def ours_batched(llm: LLM, ids: list[list[int]], n: int, new: int) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    reqs = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(n)]
    t = time.perf_counter()
    outs = llm.generate(reqs, sp)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def llama_cpp_runner(path: Path) -> Callable[[list[int], int], list[int]] | None:
    """llama.cpp on the GGUF (one request at a time, greedy, the cores torch uses), or None when
    llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(path), n_ctx=2048, n_threads=torch.get_num_threads(), n_batch=512, verbose=False)

    def run(p: list[int], count: int) -> list[int]:
        got: list[int] = []
        for tok in llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(int(tok))
            if len(got) == count:
                break
        return got

    return run


def single_interleaved(
    runners: dict[str, Callable[[list[int], int], list[int]]], ids: list[list[int]], new: int, rounds: int
) -> dict[str, float]:
    """Tokens/s of each runner one request at a time, over the same prompts: each prompt goes to every runner in
    turn (the order reversed every other prompt), `rounds` times, so that a shared machine's drift lands on all
    of them alike. Each runner is warmed first."""
    for run in runners.values():
        run(ids[0], 4)
    tokens = dict.fromkeys(runners, 0)
    secs = dict.fromkeys(runners, 0.0)
    names = list(runners)
    for r in range(rounds):
        for i, p in enumerate(ids):
            for name in names if (i + r) % 2 == 0 else names[::-1]:
                t = time.perf_counter()
                tokens[name] += len(runners[name](p, new))
                secs[name] += time.perf_counter() - t
    return {name: tokens[name] / secs[name] for name in names}


def same(a: list[list[int]], b: list[list[int]]) -> int:
    """How many of the token lists are equal, pair by pair."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts, one at a time")
    args = ap.parse_args()
    res: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg(),
        "cpu": subprocess.run(
            ["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True
        ).stdout.strip(),
    }
    if not args.skip_kernels:
        res["kernels_ms"] = kernels()
    gguf = fetch.default_gguf_path()
    t = time.perf_counter()
    q = LLM(model=gguf, seed=0)
    res["engine_start_s"] = time.perf_counter() - t
    res["cpu_graph"], res["cpu_graph_wait_s"] = wait_for_graph(q)
    graph = f"CPU decode graph {res['cpu_graph']} after {res['cpu_graph_wait_s']:.1f} s more"
    print(f"engine {res['engine_start_s']:.1f} s; {graph}")
    ids = prompt_ids(q, PROMPTS)
    held = prompt_ids(q, HELD_OUT)
    res["weights_bytes"] = q.engine.runner.stats.weights_bytes
    lc = llama_cpp_runner(gguf)
    runners = {"ours": functools.partial(ours_run, q), "ours_eager": functools.partial(ours_eager, q)}
    if lc is not None:
        runners["llama_cpp"] = lc
    tps = single_interleaved(runners, ids, NEW_TOKENS, args.rounds)
    res["ours_single_tps"] = tps["ours"]
    res["ours_eager_single_tps"] = tps["ours_eager"]
    if "llama_cpp" in tps:
        res["llama_cpp_single_tps"] = tps["llama_cpp"]
    print(f"one at a time, interleaved: {tps}", flush=True)
    res["ours_batched32_tps"] = ours_batched(q, ids, 32, NEW_TOKENS)
    print(f"tinypaged 32 batched: {res['ours_batched32_tps']:.1f} tokens/s", flush=True)
    # Agreement: the 3 held-out prompts (the target), then those and TOPICS together for a steadier rate, of
    # tinypaged and of llama.cpp against the f32 conversion.
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    many = held + prompt_ids(q, [f"Tell me about {t}." for t in TOPICS])
    ours_many = [
        list(o.outputs[0].token_ids) for o in q.generate([{"prompt_token_ids": p} for p in many], sp)
    ]
    q.shutdown()
    del q
    f32 = LLM(seed=0)
    res["f32_weights_bytes"] = f32.engine.runner.stats.weights_bytes
    f32_many = [
        list(o.outputs[0].token_ids) for o in f32.generate([{"prompt_token_ids": p} for p in many], sp)
    ]
    f32.shutdown()
    del f32
    n = len(held)
    res["agree_f32"] = same(ours_many[:n], f32_many[:n])
    res["agree_f32_many"] = [same(ours_many, f32_many), len(many)]
    if lc is not None:
        lc_many = [lc(p, 24) for p in many]
        res["agree_llama_cpp"] = same(ours_many[:n], lc_many[:n])
        res["llama_cpp_agree_f32_many"] = [same(lc_many, f32_many), len(many)]
    res["load_after"] = os.getloadavg()
    ref = res.get("llama_cpp_single_tps")
    rows = [
        (
            "one at a time, tokens/s",
            f"{res['ours_single_tps']:.1f}",
            f"{ref:.1f}" if ref else "n/a",
            f"{res['ours_single_tps'] / ref:.2f}x (>= 0.7x)" if ref else "n/a",
        ),
        (
            "one at a time, eager (no CPU graph)",
            f"{res['ours_eager_single_tps']:.1f}",
            f"{ref:.1f}" if ref else "n/a",
            f"{res['ours_eager_single_tps'] / ref:.2f}x" if ref else "n/a",
        ),
        (
            "32 batched, tokens/s",
            f"{res['ours_batched32_tps']:.1f}",
            f"{ref:.1f} (one at a time)" if ref else "n/a",
            f"{res['ours_batched32_tps'] / ref:.2f}x (>= 3x)" if ref else "n/a",
        ),
        (
            "weights, MB",
            f"{res['weights_bytes'] / 1e6:.1f}",
            f"f32 {res['f32_weights_bytes'] / 1e6:.1f}",
            f"{res['weights_bytes'] / res['f32_weights_bytes']:.1%} (<= 25%)",
        ),
        ("greedy = f32 (3 prompts, 24 tokens)", f"{res['agree_f32']} of 3", "", ">= 2 of 3"),
        (
            "greedy = f32 (33 prompts, 24 tokens)",
            "{} of {}".format(*res["agree_f32_many"]),
            "{} of {}".format(*res["llama_cpp_agree_f32_many"]) if lc else "n/a",
            "reported",
        ),
        ("greedy = llama.cpp (3 prompts)", f"{res.get('agree_llama_cpp', 'n/a')} of 3", "", "reported"),
    ]
    print(f"\nload {res['load_before']} -> {res['load_after']}")
    print(f"{'':38s} {'tinypaged':>12s} {'llama.cpp':>24s}  target")
    for r in rows:
        print(f"{r[0]:38s} {r[1]:>12s} {r[2]:>24s}  {r[3]}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
