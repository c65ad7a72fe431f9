"""Shared fixtures: the default model (fetched and converted once into the model cache), an engine on it, and
HF transformers reading the original GGUF as the independent oracle (it has its own dequantization, tensor
renaming, Q/K un-permutation and tokenizer builder)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tinypaged.model import AttentionMetadata

# No engine of the suite compiles its CPU decode graph in the background (model/cpu_graph.py) but where a test
# turns it on (tests/model/test_cpu_graph.py): a build takes a minute of both cores.
os.environ["TINYPAGED_CPU_GRAPH"] = "0"

# The suite's time budget, part by part (tests/_budget.py; the budgets: pyproject.toml).
pytest_plugins = ["_budget"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted default model in the model cache (`tinypaged_home()`); fetched if not there yet."""
    from tinypaged.weights import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def gguf_path(model_dir: Path) -> Path:
    """The GGUF file the default model was converted from."""
    from tinypaged.weights import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def llm(model_dir: Path):
    """One engine on the default model, shared by the tests that only generate."""
    from tinypaged import LLM

    return LLM(model=model_dir, seed=0)


@pytest.fixture(scope="session")
def oracle_model(gguf_path: Path):
    """HF transformers' model read straight from the GGUF (test-only oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def oracle_tokenizer(gguf_path: Path):
    """HF transformers' tokenizer read straight from the GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _generate_with_stats(engine, prompts: list, params: list, check: bool = False) -> tuple[list, list]:  # noqa: ANN001
    """What LLM.generate does, keeping each step's StepStats: (final outputs in order, stats per step); with
    `check`, the KV cache's invariants are checked after every step."""
    requests = [
        engine.process_inputs(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for request in requests:
        engine.add(request)
    finals, steps = {}, []
    while engine.has_unfinished_requests():
        result = engine.step()
        if check:
            engine.check_integrity()
        steps.append(result.stats)
        finals.update((o.request_id, o) for o in result.outputs if o.finished)
    return [finals[r.request_id] for r in requests], steps


@pytest.fixture
def generate_with_stats():
    """`generate_with_stats(engine, prompts, params_list, check=False) -> (outputs, [StepStats per step])`."""
    return _generate_with_stats


@pytest.fixture(scope="session")
def tiny_hf_model(model_dir: Path):
    """`tiny_hf_model(out, family, **config) -> out`: a random HF model of that family ("Llama", "Mistral", ...),
    tiny (2 layers, hidden 32, GQA) but for `config`, saved with the default model's tokenizer (vocab sized to
    match)."""
    import shutil

    import transformers

    def make(out: Path, family: str, **config: object) -> Path:
        shape = dict(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        cfg = getattr(transformers, f"{family}Config")(**(shape | config))
        getattr(transformers, f"{family}ForCausalLM")(cfg).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(model_dir / name, out / name)
        return out

    return make


@pytest.fixture
def run_paged():
    """Run a model over a paged KV cache with a simple block assignment (see `_run_paged`)."""
    return _run_paged


@pytest.fixture
def agrees_with_hf():
    """`check(ours, hf, vocab, tol)`: three prompts (5, 17 and 1 tokens) prefilled, then 3 tokens decoded each,
    over the paged cache; every logit within `tol` of an HF model's over the same tokens in one pass."""

    def check(ours, hf, vocab: int, tol: float) -> None:  # noqa: ANN001
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 17, 1)]
        decodes = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in prompts]
        for p, d, logits in zip(prompts, decodes, _run_paged(ours, prompts, 4, decodes), strict=True):
            with torch.no_grad():
                want = hf(torch.tensor([p + d])).logits[0]
            assert (logits - want).abs().max().item() < tol

    return check


def _run_paged(model, prompts: list[list[int]], block_size: int, decode_steps: list[list[int]]):
    """Prefill all prompts in one ragged batch, then decode the given tokens one step at a time (with the
    staging's launch hints, so that decode steps take the model's decode path, as the engine's do).

    Returns the logits of every position of every prompt, then of each decode step: list per sequence."""
    cfg = model.cfg
    total = [len(p) + len(d) for p, d in zip(prompts, decode_steps, strict=True)]
    width = max(math.ceil(n / block_size) for n in total)
    num_blocks = width * len(prompts) + 3
    cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[perm.pop() for _ in range(width)] for _ in prompts]
    bt = torch.tensor(tables, dtype=torch.int32)

    def forward(chunks: list[list[int]], firsts: list[int]) -> list[torch.Tensor]:
        ids, pos, slots, starts = [], [], [], [0]
        for chunk, first, table in zip(chunks, firsts, tables, strict=True):
            ids += chunk
            rng = range(first, first + len(chunk))
            pos += list(rng)
            slots += [table[p // block_size] * block_size + p % block_size for p in rng]
            starts.append(starts[-1] + len(chunk))
        seq_lens = [f + len(c) for f, c in zip(firsts, chunks, strict=True)]
        meta = AttentionMetadata(
            torch.tensor(slots),
            bt,
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(c) for c in chunks),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), cache, meta))
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]

    results = forward(prompts, [0] * len(prompts))
    lengths = [len(p) for p in prompts]
    for step in range(len(decode_steps[0])):
        outs = forward([[d[step]] for d in decode_steps], lengths)
        results = [torch.cat([r, o]) for r, o in zip(results, outs, strict=True)]
        lengths = [n + 1 for n in lengths]
    return results
