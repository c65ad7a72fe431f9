"""Llama 3 GGUFs against llama.cpp on the same files (issue 38; llama-cpp-python, benchmark only, never in CI):

- `vocab`: a vocab-only GGUF of the Llama 3 vocabulary (built from Meta's ranks as llama.cpp's converter writes
  one: tests/weights/test_gguf_llama3_tokenizer.py) tokenized by our converted tokenizer, by llama.cpp and by
  Meta's own tokenizer (llama-models, tiktoken): the tests' 22 texts and `--substrings` random pieces of them.
- `rope`: the tiny Llama 3.1 GGUF of tests/weights/test_gguf_families.py (its RoPE scaling as a `rope_freqs`
  tensor) converted by us and run over 300 positions, against llama.cpp on the same file; and, as the control,
  our conversion with the scaling dropped.

    pip install llama-cpp-python llama-models tiktoken   # built as benchmarks/cpu_lowbit.py says
    python benchmarks/gguf_llama3.py --json benchmarks/results/gguf-llama3.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import write_json

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "weights")]  # the tests' GGUF writers: one way to write a file

import test_gguf_families as families  # noqa: E402
import test_gguf_llama3_tokenizer as llama3  # noqa: E402
from conftest import _run_paged  # noqa: E402

from tinypaged.config import ModelConfig  # noqa: E402
from tinypaged.model import load_model  # noqa: E402
from tinypaged.weights import convert_gguf, default_gguf_path  # noqa: E402
from tinypaged.weights.gguf_tokenizer import build_tokenizer  # noqa: E402


def vocab(tmp: Path, substrings: int) -> dict[str, Any]:
    import gguf
    import llama_cpp
    from llama_models.llama3.tokenizer import Tokenizer

    ref = Tokenizer.get_instance()
    meta = llama3.gguf_metadata(ref.model._mergeable_ranks, llama3._specials(ref))
    path = tmp / "llama3-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (w.add_context_length, 256), (w.add_embedding_length, 64), (w.add_block_count, 1),
        (w.add_feed_forward_length, 96), (w.add_head_count, 4), (w.add_head_count_kv, 2),
        (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "llama-bpe"),
        (w.add_token_list, meta["tokenizer.ggml.tokens"]), (w.add_token_types, meta["tokenizer.ggml.token_type"]),
        (w.add_token_merges, meta["tokenizer.ggml.merges"]), (w.add_bos_token_id, ref.bos_id),
        (w.add_eos_token_id, ref.eot_id), (w.add_add_bos_token, True),
    ]:  # fmt: skip
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lc = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ours = build_tokenizer(meta)
    texts = llama3.TEXTS + llama3.LLAMA3_TEXTS
    pool, rng = "".join(texts), random.Random(0)
    for _ in range(substrings):
        n = rng.randint(1, 60)
        start = rng.randint(0, len(pool) - n)
        texts.append(pool[start : start + n])
    same_lc = same_meta = 0
    for text in texts:
        got = ours.encode(text).ids
        same_lc += got == lc.tokenize(text.encode(), add_bos=True, special=True)
        same_meta += got == ref.encode(text, bos=True, eos=False, allowed_special="all")
    return {"texts": len(texts), "same_as_llama_cpp": same_lc, "same_as_meta": same_meta}


def rope(tmp: Path) -> dict[str, Any]:
    import llama_cpp

    path = tmp / "llama31.gguf"
    families._write_llama_gguf(path, default_gguf_path(), "smollm", families.LLAMA3_SCALING)
    out, plain = tmp / "out", tmp / "plain"
    convert_gguf(path, out)
    shutil.copytree(out, plain)
    config = json.loads((plain / "config.json").read_text())
    config.pop("rope_scaling")
    (plain / "config.json").write_text(json.dumps(config))
    prompt = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    lc = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    lc.eval(prompt)
    theirs = torch.tensor(np.array(lc.scores[: len(prompt)]), dtype=torch.float32).log_softmax(-1)
    res: dict[str, Any] = {"positions": len(prompt), "original_context": 64}
    for name, model_dir in (("ours", out), ("scaling_dropped", plain)):
        model = load_model(ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"), 512)
        (logits,) = _run_paged(model, [prompt], 8, [[]])
        diff = (logits.log_softmax(-1) - theirs).abs()
        res[name] = {
            "max_abs_dlogprob": diff.max().item(),
            "argmax_agree": (logits.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["vocab", "rope"], choices=["vocab", "rope"])
    ap.add_argument("--substrings", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "vocab" in args.parts:
            res["vocab"] = vocab(Path(tmp), args.substrings)
        if "rope" in args.parts:
            res["rope"] = rope(Path(tmp))
    if "vocab" in res:
        v = res["vocab"]
        print(
            f"vocab: {v['texts']} texts, same ids as llama.cpp {v['same_as_llama_cpp']}, as Meta's {v['same_as_meta']}"
        )
    if "rope" in res:
        for name in ("ours", "scaling_dropped"):
            r = res["rope"][name]
            err, agree = r["max_abs_dlogprob"], r["argmax_agree"]
            print(f"rope {name:16s} vs llama.cpp: max |dlogprob| {err:.2e}, argmax {agree:.3f}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
