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


class _CountingReads:
    """safe_open as the loader uses it, adding up the elements that its slice reads return (`total`)."""

    total = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        from safetensors import safe_open

        self.file = safe_open(*args, **kwargs)

    def __enter__(self) -> "_CountingReads":
        self.file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_slice(self, name: str) -> object:
        whole = self.file.get_slice(name)

        class Slice:
            get_shape = whole.get_shape

            def __getitem__(self, index: object) -> torch.Tensor:
                part = whole[index]
                _CountingReads.total += part.numel()
                return part

        return Slice()


@pytest.mark.parametrize("variant", ["gqa-tied", "mha-untied-bias"])
@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_shards_make_the_whole(
    tmp_path: Path, variant: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's share, read slice by slice, put back together is the whole checkpoint: QKV and gate/up by
    rows of each part, O and down by columns, vocabulary rows padded to a multiple of the ranks (zeros), KV
    heads replicated where the ranks outnumber them (gqa at 4: 2 KV heads on 4 ranks), O's bias on rank 0.
    And a rank reads exactly what it holds: no whole tensor is read to be cut down."""
    from tinypaged.model import loader
    from tinypaged.model.parallel import TPGroup

    path = _make_checkpoint(tmp_path, variant)
    cfg = ModelConfig.from_dir(path)
    whole = dict(load_model(cfg, torch.float32, torch.device("cpu"), 64).named_parameters())
    monkeypatch.setattr(loader, "safe_open", _CountingReads)
    ranks = []
    for r in range(size):
        _CountingReads.total = 0
        tp = TPGroup(r, size)
        ranks.append(dict(load_model(cfg, torch.float32, torch.device("cpu"), 64, tp).named_parameters()))
        start, end, rows = tp.vocab(cfg.vocab_size)
        padding = (rows - (end - start)) * cfg.hidden_size * (1 + (not cfg.tie_word_embeddings))
        assert _CountingReads.total == sum(p.numel() for p in ranks[-1].values()) - padding
    d, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, w in whole.items():
        parts = [r.get(name) for r in ranks]
        if "qkv_proj" in name:
            ql, kl = q // size, [p.shape[0] - q // size for p in parts]
            assert torch.equal(torch.cat([p[:ql] for p in parts]), w[:q]), name
            for r, p in enumerate(parts):
                head = TPGroup(r, size).kv_heads(cfg.num_kv_heads)[0]
                k, v = p[ql : ql + kl[r] // 2], p[ql + kl[r] // 2 :]
                assert torch.equal(k, w[q + head * d : q + head * d + k.shape[0]]), name
                assert torch.equal(v, w[q + kv + head * d : q + kv + head * d + v.shape[0]]), name
        elif "gate_up_proj" in name:
            il = cfg.intermediate_size // size
            gate = torch.cat([p[:il] for p in parts])
            up = torch.cat([p[il:] for p in parts])
            assert torch.equal(torch.cat([gate, up]), w), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), w), name
        elif name.endswith("o_proj.bias"):
            assert torch.equal(parts[0], w) and all(p is None for p in parts[1:]), name
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            rows = torch.cat(parts)
            assert rows.shape[0] % size == 0 and torch.equal(rows[: cfg.vocab_size], w), name
            assert not rows[cfg.vocab_size :].any(), name  # padding
        else:
            assert all(torch.equal(p, w) for p in parts), name
