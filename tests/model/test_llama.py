"""Our Llama over a paged cache against HF transformers (test-only oracle), on tiny random checkpoints."""

from pathlib import Path

import pytest
import torch

from tinypaged.config import ModelConfig
from tinypaged.model import load_model

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "gqa-tied": dict(tie_word_embeddings=True),
    "mha-untied-bias": dict(num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True),
    "llama3-rope-sharded": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
    ),
}


def _make_checkpoint(tmp: Path, name: str) -> Path:
    torch.manual_seed(0)
    args = dict(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    cfg = transformers.LlamaConfig(**(args | VARIANTS[name]))
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Random norms too: HF initialises them to ones, which would hide a norm weight loaded in the wrong place.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    out = tmp / name
    model.save_pretrained(out, max_shard_size="100KB" if "sharded" in name else "1GB")
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_logits_match_hf(tmp_path: Path, variant: str, block_size: int, run_paged) -> None:
    path = _make_checkpoint(tmp_path, variant)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 256)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (5, 23, 1, 40)]
    decodes = [torch.randint(0, 211, (4,), generator=g).tolist() for _ in prompts]
    got = run_paged(ours, prompts, block_size, decodes)
    for p, d, logits in zip(prompts, decodes, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p + d])).logits[0]
        err = (logits - want).abs().max().item()
        assert err < 1e-4, f"{variant} bs={block_size}: max-abs {err}"
