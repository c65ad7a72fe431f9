"""The CPU's compiled decode step (model/cpu_graph.py): built in the background, it computes what the eager
model computes, runs only the steps it takes, and a build that fails or is stopped leaves the engine eager."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.cli import main
from tinypaged.model import cpu_graph

# A tiny Llama whose every linear layer packs for torch's INT4 kernel (sizes multiples of 64, groups of 64).
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[1, 5, 9], list(range(100, 140)), [7] * 21, [300 + i for i in range(17)]]


@pytest.fixture
def graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The graph turned on (the suite turns it off), its files under tmp_path."""
    monkeypatch.setenv(cpu_graph.ENV, "1")
    monkeypatch.setattr(cpu_graph, "graph_dir", lambda: tmp_path / "graphs")
    return tmp_path / "graphs"


def _generate(llm: LLM, batched: bool) -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    if batched:
        return [o.outputs[0] for o in llm.generate(reqs, sp)]
    return [llm.generate([r], sp)[0].outputs[0] for r in reqs]


def test_the_compiled_step_computes_the_eager_one(
    tmp_path: Path, tiny_hf_model, graphs: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    model = tiny_hf_model(tmp_path / "m", "Llama", **SHAPE)
    threads = torch.get_num_threads()
    llm = LLM(model=model, quantization="int4", seed=0, block_size=16)
    runner = llm.engine.runner
    graph = runner.cpu_graph
    assert graph is not None and runner.stats.cpu_graph == "building"
    assert torch.get_num_threads() == max(1, threads - 1)  # the build has a core of its own
    assert (
        graph.wait(600) == "loaded"
        and torch.get_num_threads() == threads
        and len(list(graphs.glob("*.pt2"))) == 1
    )
    assert not list(graphs.glob(".*.part.pt2"))
    calls = []
    run = graph._run
    monkeypatch.setattr(graph, "_run", lambda inputs: calls.append(inputs[0].shape[0]) or run(inputs))
    for batched in (False, True):
        got = _generate(llm, batched)
        runner.cpu_graph = None
        want = _generate(llm, batched)
        runner.cpu_graph = graph
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
                # The same top tokens; their logprobs within the bf16 rows' rounding (the module's docstring).
                assert lg.keys() == lw.keys()
                assert max(abs(lg[t].logprob - lw[t].logprob) for t in lg) < 2e-2
    # Every decode step went through the graph: 11 a request alone, then 11 steps of all four.
    assert calls == [1] * 11 * len(PROMPTS) + [len(PROMPTS)] * 11
    stats = llm.engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    llm.shutdown()
    # A second engine of the same shapes loads the file at once.
    again = LLM(model=model, quantization="int4", seed=0, block_size=16)
    assert again.engine.runner.stats.cpu_graph == "loaded"
    assert [o.token_ids for o in _generate(again, True)] == [o.token_ids for o in got]
    again.shutdown()
    # `tinypaged warmup` waits for the graph (here already built) and says where it is.
    assert main(["warmup", "--model", str(model), "--quantization", "int4"]) == 0
    assert f"CPU decode graph: loaded after 0.0 s ({graph.path})" in capsys.readouterr().out


def test_models_the_graph_does_not_take_run_eagerly(tmp_path: Path, tiny_hf_model, graphs: Path) -> None:
    model = tiny_hf_model(tmp_path / "m", "Llama", **SHAPE)
    dense = LLM(model=model, seed=0)  # float32 layers: not packed
    assert dense.engine.runner.cpu_graph is None
    dense.shutdown()
    eager = LLM(model=model, quantization="int4", seed=0, enforce_eager=True)
    assert eager.engine.runner.cpu_graph is None
    eager.shutdown()
    assert not graphs.exists()


def test_a_damaged_graph_file_leaves_the_engine_eager(tmp_path: Path, tiny_hf_model, graphs: Path) -> None:
    model = tiny_hf_model(tmp_path / "m", "Llama", **SHAPE)
    first = LLM(model=model, quantization="int4", seed=0)
    graph = first.engine.runner.cpu_graph
    path = graph.path
    first.shutdown()  # stops the build: no file, no partial file, no process left
    assert graph._proc is None and not list(graphs.glob("*.pt2")) and not list(graphs.glob(".*"))
    path.write_bytes(b"not a package")
    llm = LLM(model=model, quantization="int4", seed=0)
    assert llm.engine.runner.stats.cpu_graph == "failed"
    out = _generate(llm, True)
    assert all(len(o.token_ids) == 12 for o in out)
    llm.shutdown()


def test_a_build_that_fails_is_not_tried_again(
    tmp_path: Path, tiny_hf_model, graphs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_hf_model(tmp_path / "m", "Llama", **SHAPE)
    monkeypatch.setattr(cpu_graph.sys, "executable", "/bin/false")  # the build process exits 1 at once
    eager = LLM(model=model, quantization="int4", seed=0, enforce_eager=True).engine
    spec = cpu_graph.spec_of(eager.runner.model, eager.runner.kv_cache)
    eager.shutdown()
    stale = cpu_graph._part(graphs / f"{spec.key()}.pt2", 999_999_999)  # a build's, killed with its engine
    graphs.mkdir()
    stale.write_bytes(b"partial")
    llm = LLM(model=model, quantization="int4", seed=0)
    graph = llm.engine.runner.cpu_graph
    assert graph.path == graphs / f"{spec.key()}.pt2" and not stale.exists()
    assert graph.wait(60) == "failed" and graph.path.with_suffix(".failed").exists()
    assert all(len(o.token_ids) == 12 for o in _generate(llm, True))  # eager
    llm.shutdown()
    again = LLM(model=model, quantization="int4", seed=0)
    assert again.engine.runner.stats.cpu_graph == "failed" and again.engine.runner.cpu_graph._proc is None
    again.shutdown()


def test_the_step_s_inputs_follow_the_spec() -> None:
    """The placeholders a build exports with have the shapes the engine passes (no compile here)."""
    lin = cpu_graph.Linear(64, 128, ([128, 32], "uint8"), ([1, 128, 2], "bfloat16"))
    biased = cpu_graph.Linear(64, 128, ([128, 32], "uint8"), ([1, 128, 2], "bfloat16"), bias=True)
    layers = [cpu_graph.Layer([biased, lin, lin, lin], 8, True), cpu_graph.Layer([lin] * 4)]
    spec = cpu_graph.Spec(64, 4, 2, 16, 1e-5, 0.25, 16, 64, layers)
    assert cpu_graph.Spec.from_json(json.dumps(asdict(spec))) == spec
    x, positions, lens, write, read, cos_sin, norms, tensors, kv = cpu_graph._inputs(spec, 3, 5, 4)
    assert x.shape == (3, 64) and positions.dtype == lens.dtype == torch.int32 and len(norms) == 5
    assert [len(t) for t in tensors] == [8 + 1 + 2, 8] and tensors[0][2].shape == (128,)
    assert [t.shape for t in write] == [(3,)] * 2 and [t.shape for t in read] == [(3, 5)] * 2
    assert kv[0].shape == (2, 4, 16, 2, 16) and cos_sin.shape == (64, 16)


def test_biases_q_k_norms_and_windows_compute_as_eagerly(tmp_path: Path, tiny_hf_model, graphs: Path) -> None:
    """A Qwen3 with biases on q, k, v and o, its q/k norms, and a window of 8 on its second layer, in grouped INT8
    (split in nibbles, quant/cpu.py): the graph takes it and decodes as the eager model does, past the window."""
    model = tiny_hf_model(
        tmp_path / "m",
        "Qwen3",
        **(SHAPE | {"intermediate_size": 256}),
        head_dim=16,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    llm = LLM(model=model, quantization="int8", seed=0)
    runner = llm.engine.runner
    graph = runner.cpu_graph
    assert [(layer.window, layer.qk_norm) for layer in graph.spec.layers] == [(None, True), (8, True)]
    # quantization="int8" groups 128 columns (64 where 128 does not divide): per row where a row is one group.
    kernels = [(lin.bias, lin.doubled, lin.bits) for lin in graph.spec.layers[0].linears]
    assert kernels == [(True, False, 8), (True, False, 8), (False, False, 8), (False, True, 4)]
    assert graph.wait(600) == "loaded"
    calls = []
    run = graph._run
    graph._run = lambda inputs: calls.append(inputs[0].shape[0]) or run(inputs)
    got = _generate(llm, True)
    assert calls == [len(PROMPTS)] * 11
    runner.cpu_graph = None
    want = _generate(llm, True)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            assert lg.keys() == lw.keys() and max(abs(lg[t].logprob - lw[t].logprob) for t in lg) < 2e-2
    llm.shutdown()
