"""The Llama family (Llama 2/3/3.1, SmolLM, TinyLlama) and its near relatives as plain torch modules over a
paged KV cache. The relatives are switches read from the config: Mistral (a sliding window), Qwen2/2.5 (biases
on q, k and v), Qwen3 (an RMSNorm over each head of q and k) and Gemma 3 (q/k norms too, windowed layers
interleaved with global ones, each kind with its own rotary base, norms around both blocks scaling by 1 + w
(folded into the weights at load), a GELU-tanh gate and an embedding scaled by sqrt(hidden_size))."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tinypaged import ops
from tinypaged.config import ModelConfig
from tinypaged.model.module import Module
from tinypaged.model.parallel import TPGroup
from tinypaged.model.quant import Linear, cpu, fp8, linear_method
from tinypaged.quantization import Quantization


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the batch's new tokens go in the paged KV cache and what each attends to.

    The batch is B sequences' new tokens back to back (T in all); `query_start_loc` `[B + 1]` delimits them.
    """

    slot_mapping: torch.Tensor  # [T] int64: the cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence, new tokens included
    query_start_loc: torch.Tensor  # [B + 1] int32
    # Host-side bounds that keep the attention launch free of device syncs (None: the kernel derives them).
    max_query_len: int | None = None
    max_seq_len: int | None = None
    # [B] int32, the sequences longest first: the order decode attention takes them in (speed only).
    decode_order: torch.Tensor | None = None
    # What the torch reference ops derive from these once a step and every layer reuses (ops.ref_paged_attention).
    memo: dict = field(default_factory=dict, compare=False, repr=False)


def rope_cos_sin_cache(
    dim: int, theta: float, scaling: dict | None, max_positions: int, device: torch.device
) -> torch.Tensor:
    """`[max_positions, dim]` fp32: cos then sin of each position's rotation angles (Llama 3 and linear scaling
    too)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":  # positions divided by `factor`
        inv_freq = inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device=device, dtype=torch.float32)


class RMSNorm(Module):
    """RMSNorm with an optional fused residual add; with `fp8` set, its output comes quantized per token (for
    an FP8 layer that reads it: the quantization fused into the norm). `offset` (Gemma's norms scale by 1 + w):
    the loader adds 1 to the weight, kept in float32 so that 1 + w is not rounded to the model's dtype."""

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.weight.keep_dtype = offset  # type: ignore[attr-defined]
        self.offset = offset
        self.eps = eps
        self.fp8 = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | fp8.Fp8Activation | tuple[torch.Tensor | fp8.Fp8Activation, torch.Tensor]:
        if self.fp8:
            return fp8.rms_norm(x, self.weight, self.eps, residual)
        return ops.rms_norm(x, self.weight, self.eps, residual)


def linear(
    quant: Quantization | None, name: str, in_features: int, parts: tuple[int, ...], bias: bool
) -> Linear:
    """A linear layer run as `quant` says for checkpoint module `name` (the first of its fused parts); a dense
    one goes through ops.linear (a batch-1 step's matrix-vector products to the Triton GEMV)."""
    return Linear(in_features, parts, bias, linear_method(quant.scheme(name) if quant else None), name)


class Attention(Module):
    """Grouped-query self-attention that writes its new K/V into the paged cache and reads its context there
    (the last `window` positions of it, where the layer has a sliding window).

    Under tensor parallelism a rank holds its share of the heads; o_proj leaves partial sums, added by one
    all-reduce (its bias, where the model has one, on rank 0 alone so that it is added once)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, quant: Quantization | None, prefix: str, window: int | None
    ) -> None:
        super().__init__()
        self.window = window
        # New tokens a sequence that the decode launch takes (ops.paged_attention): a verification's k + 1 under
        # speculative decoding (set by the model runner), else 1.
        self.short_query_len = 1
        kv_start, kv_end = tp.kv_heads(cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, kv_end - kv_start
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul; the loader fills the three row ranges.
        parts = (self.q_size, self.kv_size, self.kv_size)
        bias = cfg.qkv_bias or cfg.attention_bias
        self.qkv_proj = linear(quant, f"{prefix}.q_proj", cfg.hidden_size, parts, bias)
        o_bias = cfg.attention_bias and tp.rank == 0
        self.o_proj = linear(quant, f"{prefix}.o_proj", self.q_size, (cfg.hidden_size,), o_bias)
        if cfg.qk_norm:
            offset = cfg.family == "gemma3"
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        # An FP8 KV cache's scales (stored = fp8(x / scale), read = stored * scale): plain floats, fixed once the
        # runner has set them (the checkpoint's, or calibrated), so that CUDA graphs capture them as they are.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.tp = tp

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        # Per-head q/k norms (Qwen3, Gemma 3) run inside the rotary launch, which holds each head's row.
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        q = ops.rotary_write_kv(
            positions,
            q,
            k,
            v,
            cos_sin_cache,
            kv_layer,
            meta.slot_mapping,
            **scales,
            memo=meta.memo,
            qk_norm=norms,
        )
        out = ops.paged_attention(
            q,
            kv_layer,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            seq_order=meta.decode_order,
            window=self.window,
            short_query_len=self.short_query_len,
            memo=meta.memo,
            **scales,
        )
        return self.tp.all_reduce(self.o_proj(out.view(t, self.q_size)))


class MLP(Module):
    """SwiGLU feed-forward (GELU-tanh gated for Gemma) with the gate and up projections fused; a rank holds its
    share of the inner columns, and down_proj's partial sums are added by one all-reduce. For an FP8 down_proj
    that reads its input per token, the SwiGLU quantizes its output."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: Quantization | None, prefix: str) -> None:
        super().__init__()
        inner = cfg.intermediate_size // tp.size
        self.gate_up_proj = linear(quant, f"{prefix}.gate_proj", cfg.hidden_size, (inner, inner), False)
        self.down_proj = linear(quant, f"{prefix}.down_proj", inner, (cfg.hidden_size,), False)
        self.fp8 = self.down_proj.method.fp8_input
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.tp = tp

    def forward(self, x: torch.Tensor | fp8.Fp8Activation) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.gelu:
            h = ops.gelu_tanh_and_mul(h)
            return self.tp.all_reduce(self.down_proj(fp8.per_token(h) if self.fp8 else h))
        return self.tp.all_reduce(self.down_proj(fp8.silu_and_mul(h) if self.fp8 else ops.silu_and_mul(h)))


class VocabEmbedding(Module):
    """The token embedding, its rows split over the ranks: a rank embeds the ids in its vocabulary range (zero
    rows for the others) and one all-reduce adds the ranks' rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.end, rows = tp.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp = tp

        self.int8: cpu.Int8Embedding | None = None  # keep_int8: the weight in a byte a weight

    def keep_int8(self) -> bool:
        """Hold the weight (float32 on the CPU, one rank) as its Q8_0 codes and scales where they give every
        value exactly, with an int8 LM head of the same values (model/quant/cpu.py), freeing the float32
        weight; False (nothing changed) where they do not."""
        if self.tp.size > 1 or self.weight.device.type != "cpu":
            return False
        self.int8 = cpu.int8_embedding(self.weight.data)
        if self.int8 is None:
            return False
        self.weight = nn.Parameter(self.weight.data[:0], requires_grad=False)
        held = (*self.int8[:2], *self.int8.head[:2])
        for name, t in zip(("codes", "scales", "head_codes", "head_scales"), held, strict=True):
            setattr(self, name, nn.Parameter(t, requires_grad=False))  # counted as the model's weights
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.lookup(ids)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class DecoderLayer(Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm. Gemma ("sandwich")
    also normalises each block's output before it is added, and the MLP's input after. Layer `index`'s
    checkpoint name (`model.layers.3`) is how `quant` says its linear layers run."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: Quantization | None, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.sandwich = cfg.family == "gemma3"
        size, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, self.sandwich
        self.input_layernorm = RMSNorm(size, eps, offset)
        self.self_attn = Attention(cfg, tp, quant, f"{prefix}.self_attn", cfg.window(index))
        self.post_attention_layernorm = RMSNorm(size, eps, offset)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, offset)
        self.mlp = MLP(cfg, tp, quant, f"{prefix}.mlp")
        # Each norm quantizes its output where the layer reading it is FP8 per token.
        self.input_layernorm.fp8 = self.self_attn.qkv_proj.method.fp8_input
        mlp_norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        mlp_norm.fp8 = self.mlp.gate_up_proj.method.fp8_input

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, kv_layer, meta, cos_sin_cache)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(Module):
    """Token ids in, hidden states out; `compute_logits` projects the rows that are sampled. With a `tp` group
    of several ranks, this rank's share of it (see `parallel.py`); every rank runs the same forward pass. With
    `quant`, the linear layers run quantized as it says (the embedding and the LM head stay dense)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TPGroup | None = None,
        quant: Quantization | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, quant, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family == "gemma3")
        rows = tp.vocab(cfg.vocab_size)[2]
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False)
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, cfg.head_dim), persistent=False)
        # Gemma 3's windowed layers' own rotary table (the others' is cos_sin_cache); None: one table for all.
        self.local_layers: set[int] = set()
        if cfg.local_rope_theta is not None:
            self.local_layers = {i for i in range(cfg.num_layers) if cfg.window(i) is not None}
        self.register_buffer("cos_sin_local", None, persistent=False)
        self.embed_scale = 1.0  # Gemma: sqrt(hidden_size), rounded to the model's dtype (init_rope)

    def init_rope(self) -> None:
        """Fill the rotary tables on the model's device (after the weights are loaded there); for Gemma, round
        the embedding scale to the weights' dtype, as HF does."""
        cfg, weight = self.cfg, self.embed_tokens.weight
        args = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, self.max_positions, weight.device)
        self.cos_sin_cache = rope_cos_sin_cache(*args)
        if cfg.local_rope_theta is not None:
            self.cos_sin_local = rope_cos_sin_cache(cfg.head_dim, cfg.local_rope_theta, None, *args[3:])
        if cfg.family == "gemma3":
            self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=weight.dtype).item()

    def fold_norm_offsets(self) -> None:
        """Gemma's checkpoints store w of norms that scale by 1 + w: add the 1, once, after loading."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, RMSNorm) and m.offset:
                    m.weight += 1.0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        residual = None
        for i, layer in enumerate(self.layers):
            rope = self.cos_sin_local if i in self.local_layers else self.cos_sin_cache
            x, residual = layer(x, residual, positions, kv_cache[i], meta, rope)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` of the given hidden rows, in the model's dtype (on every rank: each computes its
        vocabulary range, then they are gathered). Consumers upcast where they need to (log-softmax, penalties): a
        bf16 row is read at half the bytes of an fp32 copy, and greedy's argmax is exact on it."""
        if self.lm_head is None and self.embed_tokens.int8 is not None:
            logits = self.embed_tokens.int8.logits(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = ops.linear(hidden, weight)
        if self.tp.size > 1:
            logits = self.tp.gather_columns(logits)[:, : self.cfg.vocab_size]
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
