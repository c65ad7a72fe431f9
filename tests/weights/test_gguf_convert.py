"""The converted default model against HF transformers reading the same GGUF: config, tensors, logits."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tinypaged.weights import WeightsError, convert_gguf
from tinypaged.weights.gguf_convert import unpermute_rope_rows

EOS = 2  # <|im_end|>
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Le chat est sur la table. 北京是中国的首都。 1, 2, 3, 4,",
]


def test_config_values(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"


def test_tokenizer_and_generation_config(model_dir: Path, oracle_tokenizer) -> None:
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == oracle_tokenizer.chat_template
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["unk_token"] == "<|endoftext|>"
    assert tok_config["model_max_length"] == 8192
    assert tok_config["add_bos_token"] is False
    gen_config = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen_config["bos_token_id"], gen_config["eos_token_id"]) == (1, 2)


def test_tensors_match_oracle(model_dir: Path, oracle_model) -> None:
    oracle = oracle_model.state_dict()
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        # Tied: lm_head is the embedding, so only the oracle's module tree may list it.
        assert "lm_head.weight" not in names
        assert names == set(oracle) - {"lm_head.weight"}
        for name in sorted(names):
            ours = f.get_tensor(name)
            assert ours.dtype == torch.float32, name
            assert ours.shape == oracle[name].shape, name
            assert (ours - oracle[name]).abs().max().item() <= 1e-6, name


@dataclass(frozen=True)
class Run:
    """One prompt, our model's 32-token greedy continuation, and both models' logits over all of it."""

    prompt: str
    prompt_len: int
    token_ids: list[int]
    ours: torch.Tensor
    theirs: torch.Tensor


@pytest.fixture(scope="module")
@torch.no_grad()
def runs(converted_model, oracle_model, oracle_tokenizer) -> list[Run]:
    result = []
    for prompt in PROMPTS:
        ids = torch.tensor([oracle_tokenizer.encode(prompt, add_special_tokens=False)])
        out = converted_model.generate(
            ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=EOS
        )
        ours, theirs = converted_model(out).logits[0], oracle_model(out).logits[0]
        result.append(Run(prompt, ids.shape[1], out[0].tolist(), ours, theirs))
    return result


def test_logits_match_oracle(runs: list[Run]) -> None:
    worst = max((run.ours - run.theirs).abs().max().item() for run in runs)
    assert worst <= 1e-3, f"max-abs logit difference {worst}"


def test_greedy_continuations_identical(runs: list[Run]) -> None:
    for run in runs:
        n = run.prompt_len
        assert len(run.token_ids) == n + 32
        # The oracle's greedy continuation is ours iff its argmax after every prefix of ours is our next
        # token, so one teacher-forced forward checks all 32 steps.
        theirs = run.theirs[n - 1 : -1].clone()
        theirs[:, EOS] = float("-inf")  # min_new_tokens kept EOS out of ours: the same rule for the oracle
        assert theirs.argmax(-1).tolist() == run.token_ids[n:], run.prompt


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows, restated here as the thing to invert."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    weight = np.random.default_rng(0).standard_normal((n_head * 64, 40)).astype(np.float32)
    permuted = _llama_cpp_permute(weight, n_head)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_head), weight)


@pytest.mark.parametrize("keep", [0, 100, -10])
def test_truncated_gguf_raises(tmp_path: Path, gguf_path: Path, keep: int) -> None:
    data = gguf_path.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:keep])
    out = tmp_path / "out"
    with pytest.raises(WeightsError, match="truncated or not a GGUF file"):
        convert_gguf(broken, out)
    assert not out.exists()


def test_missing_gguf_raises(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="no such GGUF file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_bad_dtype_raises(tmp_path: Path, gguf_path: Path) -> None:
    with pytest.raises(WeightsError, match="unsupported dtype"):
        convert_gguf(gguf_path, tmp_path / "out", dtype="int8")
