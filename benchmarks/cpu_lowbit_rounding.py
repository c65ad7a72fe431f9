"""Why the default model's GGUF on torch's CPU kernels leaves the f32 conversion's greedy tokens (issue 38): each of
the INT4 kernel's bf16 roundings emulated alone, in float32, and all together, against the served kernel and
against llama.cpp, over the same prompts; a table last.

    python benchmarks/cpu_lowbit_rounding.py --json benchmarks/results/cpu-lowbit-rounding.json

torch's INT4 CPU kernel (model/quant/cpu.py) rounds three things to bf16: each layer's input rows, each group's
scale and zero, and each layer's output; the LM head (the Q8_0 codes as two nibbles) rounds its input, its scales
and the logits. Here the GGUF is loaded kept quantized but not packed (`cpu_kernels=False`), and the reference
path's layers and LM head are replaced by float32 emulations that apply the chosen roundings: the weights from
the layout's own codes, scales, zeros and mins, `(code - 8) * bf16(scale) + bf16(zero)` as the kernel takes them.
"exact" must equal the f32 conversion on every prompt (the emulation's check). Each variant is the number of
prompts whose 24 greedy tokens equal the f32 conversion's; the served kernel (`LLM` on the GGUF, packed) and
llama.cpp (llama-cpp-python, when installed) are counted the same way. Prompts: cpu_lowbit.py's 8 and 3 held-out
ones, and 30 "Tell me about ..." ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import write_json
from cpu_lowbit import HELD_OUT, PROMPTS, TOPICS, llama_cpp_runner, prompt_ids

from tinypaged import LLM, SamplingParams
from tinypaged.engine.device import model_runner
from tinypaged.model.quant import cpu, lowbit
from tinypaged.weights import fetch

VARIANTS = {  # which roundings each emulation applies
    "exact": {},
    "inputs": {"act"},
    "scales": {"scale"},
    "outputs": {"out"},
    "LM head's logits": {"head_out"},
    "LM head's inputs": {"head_act"},
    "LM head's scales": {"head_scale"},
    "all (the kernel's arithmetic)": {"act", "scale", "out", "head_act", "head_scale", "head_out"},
    "all, inputs as two bf16 rows": {"hilo", "scale", "out", "head_act", "head_scale", "head_out"},
}


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


class Emulation:
    """The reference path's layers and LM head replaced by float32 emulations of the kernel's roundings."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.flags: set[str] = set()
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        emb = model.embed_tokens.weight.data.float()
        found = cpu.int8_embedding(emb)
        assert found is not None, "the embedding is not Q8_0's values"
        q = found.codes.to(torch.int32)
        d = found.scales.float().repeat_interleave(cpu.EMBED_GROUP, 1)
        hi, lo = torch.div(q, 16, rounding_mode="floor").float(), (q & 15).float()
        self.head = emb
        self.head_rounded = hi * bf16(16 * d) + (lo - 8) * bf16(d) + bf16(8 * d)  # cpu.head_weight's weight
        lowbit.ref_wint_linear = self.linear
        model.compute_logits = self.logits

    def weights(self, w: lowbit.IntWeight) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's exact weight and the one with bf16 scale and zero (cpu.pack's mapping)."""
        key = w.qweight.data_ptr()
        if key not in self._weights:
            codes = lowbit.unpack(w.qweight, w.bits).float()
            s = w.scales.float()
            zp = w.zeros.float() if w.zeros is not None else (0.0 if w.mins is not None else 8.0)
            zero = (8.0 - zp) * s + (w.mins.float() if w.mins is not None else 0.0)
            rounded = (codes - 8) * bf16(s).t().repeat_interleave(w.group, 1)
            rounded += bf16(zero).t().repeat_interleave(w.group, 1)
            self._weights[key] = lowbit.dequantize_weight(w).float(), rounded
        return self._weights[key]

    def linear(self, x: torch.Tensor, w: lowbit.IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        exact, rounded = self.weights(w)
        weight = rounded if "scale" in self.flags else exact
        xf = x.float()
        if "hilo" in self.flags:  # the input as high and low bf16 halves, each product rounded
            hi = bf16(xf)
            parts = [hi @ weight.T, bf16(xf - hi) @ weight.T]
            y = sum(bf16(p) if "out" in self.flags else p for p in parts)
        else:
            y = (bf16(xf) if "act" in self.flags else xf) @ weight.T
            y = bf16(y) if "out" in self.flags else y
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head_rounded if "head_scale" in self.flags else self.head
        x = bf16(hidden.float()) if "head_act" in self.flags else hidden.float()
        y = x @ weight.T
        return (bf16(y) if "head_out" in self.flags else y).to(hidden.dtype)


def greedy(llm: LLM, ids: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ids], sp)]


def kept(got: list[list[int]], want: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(got, want, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    gguf = fetch.default_gguf_path()
    f32 = LLM(seed=0)
    ids = prompt_ids(f32, PROMPTS + HELD_OUT + [f"Tell me about {t}." for t in TOPICS])
    want = greedy(f32, ids, sp)
    f32.shutdown()
    res: dict[str, Any] = {"prompts": len(ids), "tokens": args.tokens}
    served = LLM(model=gguf, seed=0)
    res["served kernel"] = kept(greedy(served, ids, sp), want)
    served.shutdown()
    load = model_runner.load_model
    model_runner.load_model = lambda *a, **k: load(*a, **{**k, "cpu_kernels": False})
    plain = LLM(model=gguf, seed=0)
    model_runner.load_model = load
    emulation = Emulation(plain.engine.runner.model)
    for name, flags in VARIANTS.items():
        emulation.flags = flags
        res[name] = kept(greedy(plain, ids, sp), want)
        print(f"{name}: {res[name]} of {len(ids)}", flush=True)
    assert res["exact"] == len(ids), "the emulation's exact variant must equal the f32 conversion"
    run: Callable[[list[int], int], list[int]] | None = llama_cpp_runner(gguf)
    if run is not None:
        res["llama.cpp"] = kept([run(p, args.tokens) for p in ids], want)
    print(f"\ngreedy tokens equal to the f32 conversion's, {len(ids)} prompts x {args.tokens} tokens")
    for name, n in res.items():
        if name not in ("prompts", "tokens"):
            print(f"  {name:34s} {n:3d} of {len(ids)}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
