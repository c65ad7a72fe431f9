"""Each family beside Llama (Qwen2/2.5, Qwen3, Mistral, Gemma 3) over a paged cache against HF transformers
(test-only oracle), in float32 on random weights in the family's real config shape scaled down: the same greedy
tokens and prompt logprobs within 1e-4."""

from pathlib import Path

import pytest
import torch

from tinypaged.config import ConfigError, ModelConfig
from tinypaged.model import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 211
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# family -> (HF config class, HF model class, the real config's distinguishing settings)
FAMILIES = {
    # Qwen2.5-7B-Instruct: biases on q/k/v, theta 1e6, a window written but switched off.
    "qwen2.5": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=131072),
    ),
    # Qwen3-8B: per-head q/k norms, an explicit head_dim (0.6B's: wider than hidden / heads).
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False
        ),
    ),
    # Mistral-7B-Instruct-v0.3: Llama's shape under another name, no window.
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(rope_theta=1e6, sliding_window=None, head_dim=16),
    ),
    # Gemma-3-4B's text model: windowed and global layers, linear rope scaling on the global ones.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=512,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            rms_norm_eps=1e-6,
        ),
    ),
}


def hf_checkpoint(tmp: Path, family: str, **overrides: object) -> Path:
    """A random checkpoint of `family` (norms random too: HF's ones/zeros would hide a misplaced norm)."""
    config_cls, model_cls, settings = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**(SHAPE | settings | overrides))
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5) if family != "gemma3" else p.uniform_(-0.5, 0.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.5)
    out = tmp / family
    model.save_pretrained(out)
    return out


def compare(path: Path, model_cls: str, run_paged, prompt_lens=(5, 23, 1), new=4, block_size=8) -> None:  # noqa: ANN001
    """Prompt logprobs within 1e-4 of HF's; HF's greedy continuation is ours too (each step's argmax)."""
    hf = getattr(transformers, model_cls).from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 256)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    greedy = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
        greedy.append(out[0, len(p) :].tolist())
    got = run_paged(ours, prompts, block_size, greedy)
    for p, d, logits in zip(prompts, greedy, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p + d])).logits[0]
        err = (logits.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
        assert err < 1e-4, f"{path.name}: logprobs max-abs {err}"
        assert logits[len(p) - 1 : -1].argmax(-1).tolist() == d, path.name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_hf(tmp_path: Path, family: str, run_paged) -> None:
    compare(hf_checkpoint(tmp_path, family), FAMILIES[family][1], run_paged)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_matches_hf(tmp_path: Path, family: str, run_paged) -> None:
    """Prompts and decodes past a window of 8 tokens (Mistral v0.1: every layer; Gemma 3: interleaved), over
    blocks of 4: the window's edge falls inside blocks."""
    path = hf_checkpoint(tmp_path, family, sliding_window=8)
    compare(path, FAMILIES[family][1], run_paged, prompt_lens=(5, 23, 13), new=6, block_size=4)


def test_qwen_window_off_and_gemma_layer_kinds(tmp_path: Path) -> None:
    """Qwen's `use_sliding_window: false` means no window; Gemma 3's layers are windowed as its types say (the
    old configs' `sliding_window_pattern` too), its windowed layers rotating with their own base."""
    qwen = ModelConfig.from_dir(hf_checkpoint(tmp_path, "qwen2.5"))
    assert (
        qwen.layer_windows == () and qwen.sliding_window is None and qwen.qkv_bias and not qwen.attention_bias
    )
    gemma = ModelConfig.from_dir(hf_checkpoint(tmp_path, "gemma3"))
    assert gemma.layer_windows == (512, None, 512) and gemma.local_rope_theta == 10000.0
    assert gemma.rope_theta == 1e6 and gemma.rope_scaling == {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }
    old = dict(
        model_type="gemma3_text",
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        **(SHAPE | dict(num_hidden_layers=7)),
    )
    cfg = ModelConfig.from_dict(tmp_path, old)
    assert cfg.layer_windows == (1024,) * 5 + (None, 1024) and cfg.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize(
    "raw",
    [
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
        {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
    ],
)
def test_unknown_architecture_is_one_line(tmp_path: Path, raw: dict) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(tmp_path, raw | SHAPE)
    message = str(e.value)
    assert "\n" not in message and repr(raw["model_type"]) in message
    assert "Qwen3" in message and "Gemma 3" in message


@pytest.mark.parametrize("family", ["qwen2.5", "gemma3"])
def test_tensor_parallel_shares(tmp_path: Path, family: str) -> None:
    """Under tensor parallelism (2 ranks) each rank holds its heads' rows of Qwen's q/k/v biases (KV heads
    replicated where the ranks outnumber them: not here) and the whole of the per-head q/k norms and Gemma's
    extra norms."""
    from tinypaged.model.parallel import TPGroup

    cfg = ModelConfig.from_dir(hf_checkpoint(tmp_path, family))
    whole = dict(load_model(cfg, torch.float32, torch.device("cpu"), 64).named_parameters())
    ranks = [
        dict(load_model(cfg, torch.float32, torch.device("cpu"), 64, TPGroup(r, 2)).named_parameters())
        for r in range(2)
    ]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, w in whole.items():
        if name.endswith("qkv_proj.bias"):
            parts = [r[name] for r in ranks]
            cuts = [(0, q // 2), (q // 2, q // 2 + kv // 2), (q // 2 + kv // 2, q // 2 + kv)]
            got = [torch.cat([p[a:b] for p in parts]) for a, b in cuts]
            assert torch.equal(torch.cat(got), w), name
        elif "norm" in name:
            assert all(torch.equal(r[name], w) for r in ranks), name
    assert any(n.endswith("qkv_proj.bias") or "q_norm" in n for n in whole)
