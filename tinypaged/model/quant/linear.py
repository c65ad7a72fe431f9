"""Linear layers and their methods: how a layer's weight is stored, filled from a checkpoint, and applied.

A `Linear` holds its output rows as one or more parts (q, k and v in one matmul; gate and up) and hands every
question about its weight to its `LinearMethod`: which parameters it has (`create`), which checkpoint tensors
it reads and how they lie over the weight's rows and columns (`tensors`: the loader then reads only this rank's
slices, per-shard scales included), how a tensor is put in place (`load`), what is repacked once all are in
(`finish`: where GPU kernels want another layout) and how the layer runs (`apply`).
`linear_method(scheme)` is the one place a scheme (tinypaged/quantization.py) becomes a method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType

import torch
from torch import nn

from tinypaged import ops
from tinypaged.errors import ConfigError
from tinypaged.model.module import Module
from tinypaged.model.quant import cpu, fp8, lowbit
from tinypaged.quantization import Fp8Scheme, IntScheme, Scheme


@dataclass(frozen=True)
class TensorLayout:
    """How a checkpoint tensor lies over its layer's `[out_features, in_features]` weight: the dim that runs
    along the output rows and the one along the input columns (None: the tensor does not), and how many rows
    (columns) one stored element covers (a block's size, several values packed in one element)."""

    out_dim: int | None = 0
    in_dim: int | None = 1
    out_per: int = 1
    in_per: int = 1
    fixed: tuple[
        int, ...
    ] = ()  # the shape of a tensor along neither (compressed-tensors' `weight_shape`: (2,))

    def shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The stored shape for a weight of `rows` x `cols` (size-1 dims aside: a scalar is `()`)."""
        if self.out_dim is None and self.in_dim is None:
            return self.fixed
        dims = {self.out_dim: math.ceil(rows / self.out_per), self.in_dim: math.ceil(cols / self.in_per)}
        dims.pop(None, None)
        return tuple(dims[d] for d in sorted(dims))  # type: ignore[type-var]

    def fits(self, shape: tuple[int, ...], rows: int, cols: int) -> bool:
        """Whether a checkpoint tensor of `shape` is this layout of a `rows` x `cols` weight. Trailing size-1
        dims may be dropped or added (a per-channel scale is written `[out]` or `[out, 1]`, a per-tensor one
        `[]` or `[1]`), no other: `[1, out]` holds the same values across, not along, the rows."""

        def trimmed(s: tuple[int, ...]) -> tuple[int, ...]:
            while s and s[-1] == 1:
                s = s[:-1]
            return s

        return trimmed(tuple(shape)) == trimmed(self.shape(rows, cols))

    def index(self, rows: slice, cols: slice, name: str) -> tuple[slice, ...] | EllipsisType:
        """The stored part of the given weight rows and columns (which must start on a stored element; `...`:
        the whole of a tensor that does not run along either, e.g. a per-tensor scale)."""
        if self.out_dim is None and self.in_dim is None:
            return ...
        index = [slice(None)] * (max(d for d in (self.out_dim, self.in_dim) if d is not None) + 1)
        for dim, part, per in ((self.out_dim, rows, self.out_per), (self.in_dim, cols, self.in_per)):
            if dim is None or part.start is None:
                continue
            if part.start % per:
                raise ConfigError(
                    f"{name}: this rank's share starts at {part.start}, inside a block of {per} "
                    "(the tensor-parallel split must fall on block boundaries)"
                )
            index[dim] = slice(part.start // per, math.ceil(part.stop / per))
        return tuple(index)


def keep_dtype(p: nn.Parameter) -> nn.Parameter:
    """Mark a parameter whose dtype is part of its format (FP8 values, float32 scales): the loader keeps it,
    where other parameters take the model's dtype."""
    p.keep_dtype = True  # type: ignore[attr-defined]
    return p


class LinearMethod:
    """How a linear layer's weight is stored, loaded and applied (this one: dense, in the model's dtype)."""

    # Whether `apply` takes its input quantized per token (an `fp8.Fp8Activation`), so that the kernel that
    # produces the input can quantize it as it writes it.
    fp8_input = False

    def create(self, layer: Linear) -> None:
        """Register the layer's weight parameters (on the meta device; the loader materialises them)."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def tensors(self) -> dict[str, TensorLayout]:
        """The checkpoint tensors the method reads, by name suffix (`q_proj.weight`: `weight`), and their layout."""
        return {"weight": TensorLayout()}

    def load(self, layer: Linear, suffix: str, src: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Put this rank's part of a checkpoint tensor in place: `rows` are the weight rows it fills (None:
        all of them)."""
        if src.dtype.itemsize == 1:  # copied as it is, FP8 or integer codes would lose their scales
            raise ConfigError(
                f"{layer.name}.{suffix} is {src.dtype}, but no quantization_config covers the layer"
            )
        _rows(layer.weight, rows).copy_(src)

    def finish(self, layer: Linear) -> None:
        """After every tensor is loaded: repack for the kernels that run the layer (nothing to do here)."""

    def pack_for_cpu(self, layer: Linear) -> None:
        """On the CPU, repack the loaded weight for torch's fast kernels where they take it (nothing here)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for input rows x (quantized ones where `fp8_input`)."""
        return ops.linear(x, layer.weight, layer.bias)

    def __str__(self) -> str:
        return "unquantized"


class Fp8LinearMethod(LinearMethod):
    """E4M3 weights with float32 scales: `weight_scale` per output row (a per-tensor scale, one per fused part,
    is spread over that part's rows: per-shard scales cost nothing) or per block; activations quantized as the
    scheme says, `input_scale` one static scale (the largest of the fused parts'). Runs `fp8.fp8_linear`; with
    dynamic per-token activations (`fp8_input`) the producer of the input may quantize it."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.fp8_input = scheme.activations == "token" and scheme.block is None

    def create(self, layer: Linear) -> None:
        out, cols, block = layer.out_features, layer.in_features, self.scheme.block
        layer.weight = keep_dtype(nn.Parameter(torch.empty(out, cols, dtype=fp8.FP8_DTYPE)))
        if block is None:
            scale = torch.empty(out)
        else:
            # A fused part that ended inside a block would share that block's scale with the next part.
            if any(p % block[0] for p in layer.parts[:-1]):
                raise ConfigError(
                    f"{layer.name}: parts of {list(layer.parts)} rows do not fall on {block[0]}-row weight blocks"
                )
            scale = torch.empty(math.ceil(out / block[0]), math.ceil(cols / block[1]))
        layer.weight_scale = keep_dtype(nn.Parameter(scale))
        if self.scheme.activations == "static":
            layer.input_scale = keep_dtype(nn.Parameter(torch.empty(1)))

    def tensors(self) -> dict[str, TensorLayout]:
        if self.scheme.online:
            return {"weight": TensorLayout()}
        block = self.scheme.block
        scale = {
            "tensor": TensorLayout(None, None),
            "channel": TensorLayout(0, None),
            "block": TensorLayout(0, 1, *(block or (1, 1))),
        }[self.scheme.weights]
        found = {"weight": TensorLayout(), self.scheme.scale_name: scale}
        if self.scheme.activations == "static":
            found["input_scale"] = TensorLayout(None, None)
        return found

    def load(self, layer: Linear, suffix: str, src: torch.Tensor, rows: tuple[int, int] | None) -> None:
        if suffix == "weight" and self.scheme.online:
            q, scale = fp8.quantize_per_channel(src)
            _rows(layer.weight, rows).copy_(q)
            _rows(layer.weight_scale, rows).copy_(scale)
        elif suffix == "weight":
            if src.dtype != fp8.FP8_DTYPE:
                raise ConfigError(
                    f"{layer.name}.weight is {src.dtype}, expected {fp8.FP8_DTYPE} for {self.scheme}"
                )
            _rows(layer.weight, rows).copy_(src)
        elif suffix == "input_scale":
            layer.input_scale.copy_(torch.maximum(layer.input_scale, src.float().reshape(1)))
        elif self.scheme.weights == "tensor":
            _rows(layer.weight_scale, rows).fill_(src.float().item())
        elif self.scheme.weights == "channel":
            _rows(layer.weight_scale, rows).copy_(src.float().reshape(-1))
        else:  # block scales: this part's rows of blocks (parts start on block boundaries, see create)
            assert self.scheme.block is not None
            start = 0 if rows is None else rows[0] // self.scheme.block[0]
            layer.weight_scale[start : start + src.shape[0]].copy_(src.float())

    def apply(self, layer: Linear, x: torch.Tensor | fp8.Fp8Activation) -> torch.Tensor:
        return fp8.fp8_linear(
            x, layer.weight, layer.weight_scale, layer.bias, self.scheme, getattr(layer, "input_scale", None)
        )

    def __str__(self) -> str:
        return str(self.scheme)


class IntLinearMethod(LinearMethod):
    """Weight-only INT4 / INT8: codes, float32 scales and zero points in the kernels' layout
    (model/quant/lowbit.py), each checkpoint format repacked into it as its tensors are read, losslessly; a
    full-precision weight (format "online") rounded to nearest there. Fused parts and tensor-parallel shares
    take their own rows (columns) of every tensor: scales and zero points are per group, so a share holds
    exactly its groups' (a share must start on a group, and, where zero points are packed 8 to a word along
    the output rows, on a word). Runs `lowbit.wint_linear`."""

    def __init__(self, scheme: IntScheme) -> None:
        self.scheme = scheme

    def create(self, layer: Linear) -> None:
        s, out, cols = self.scheme, layer.out_features, layer.in_features
        group = s.group or cols
        if s.format == "online":  # 128, else the largest of 64 and 32 that divides the input
            group = next((g for g in (group, 64, 32) if cols % g == 0), group)
        if cols % group or group % (16 if s.format == "gguf" else 32):  # GGUF's Q6_K: 16
            raise ConfigError(
                f"{layer.name}: {cols} input columns do not split into groups of {group} ({s}); tinypaged "
                "runs groups of a multiple of 32 columns that divide a layer's input"
            )
        layer.group = group
        words = torch.empty(out, cols * s.bits // 32, dtype=torch.int32)
        layer.qweight = keep_dtype(nn.Parameter(words, requires_grad=False))
        layer.scales = keep_dtype(nn.Parameter(torch.empty(cols // group, out), requires_grad=False))
        layer.zeros = None
        if s.zero_points:
            zeros = torch.empty(cols // group, out, dtype=torch.uint8)
            layer.zeros = keep_dtype(nn.Parameter(zeros, requires_grad=False))
        layer.mins = None
        layer.cpu_packed = None  # set by pack_for_cpu (not `cpu`: that would hide nn.Module.cpu())
        if s.mins:
            layer.mins = keep_dtype(nn.Parameter(torch.empty(cols // group, out), requires_grad=False))

    def tensors(self) -> dict[str, TensorLayout]:
        s = self.scheme
        per, g = 32 // s.bits, s.group
        if s.format == "online":
            return {"weight": TensorLayout()}
        if s.format == "gguf":  # the layout itself (weights/gguf_quant.py)
            found = {"qweight": TensorLayout(0, 1, 1, per), "scales": TensorLayout(1, 0, 1, s.group or 1)}
            found |= {"zeros": found["scales"]} if s.zero_points else {}  # uint8, not packed
            return found | ({"mins": found["scales"]} if s.mins else {})
        if s.format == "pack-quantized":  # [out, in] as a Linear's weight; zero points packed along out
            found = {
                "weight_packed": TensorLayout(0, 1, 1, per),
                "weight_scale": TensorLayout(0, 1, 1, g) if g else TensorLayout(0, None),
                "weight_shape": TensorLayout(None, None, fixed=(2,)),
            }
            if s.zero_points:
                found["weight_zero_point"] = TensorLayout(0, 1, per, g) if g else TensorLayout(0, None, per)
            return found
        # GPTQ and AWQ: [in, out] (transposed); zero points packed along out
        found = {
            "qweight": TensorLayout(1, 0, 1, per) if s.format != "awq" else TensorLayout(1, 0, per, 1),
            "qzeros": TensorLayout(1, 0, per, g) if g else TensorLayout(1, None, per),
            "scales": TensorLayout(1, 0, 1, g) if g else TensorLayout(1, None),
        }
        if s.format != "awq":
            found["g_idx"] = TensorLayout(None, 0)
        return found

    def load(self, layer: Linear, suffix: str, src: torch.Tensor, rows: tuple[int, int] | None) -> None:
        s = self.scheme
        part = slice(None) if rows is None else slice(*rows)
        n = layer.out_features if rows is None else rows[1] - rows[0]
        if suffix == "weight":  # rounded where the layer lives (a GPU does an 8B model in seconds)
            w = lowbit.quantize_rtn(src.to(layer.qweight.device), s.bits, layer.group, not s.zero_points)
            layer.qweight[part].copy_(w.qweight)
            layer.scales[:, part].copy_(w.scales)
            if w.zeros is not None:
                layer.zeros[:, part].copy_(w.zeros)
            return
        expect = (
            torch.int32 if suffix in ("weight_packed", "qweight", "qzeros", "weight_zero_point") else None
        )
        if expect is not None and src.dtype != expect:
            raise ConfigError(f"{layer.name}.{suffix} is {src.dtype}, expected {expect} for {s}")
        if suffix == "weight_packed" or (suffix == "qweight" and s.format == "gguf"):  # the layout as it is
            layer.qweight[part].copy_(src)
        elif suffix in ("weight_scale", "scales", "mins") and not torch.isfinite(src).all():
            bad = int((~torch.isfinite(src)).sum())
            raise ConfigError(
                f"{layer.name}.{suffix}: {bad} of {src.numel()} values are not finite (NaN or inf)"
            )
        elif suffix == "mins":
            layer.mins[:, part].copy_(src.float())
        elif suffix == "zeros":  # a GGUF conversion's, one byte each (weights/gguf_convert.py)
            if src.dtype != torch.uint8:
                raise ConfigError(f"{layer.name}.zeros is {src.dtype}, expected torch.uint8 for {s}")
            layer.zeros[:, part].copy_(src)
        elif suffix == "qweight":
            layer.qweight[part].copy_(lowbit.from_gptq(src) if s.format != "awq" else lowbit.from_awq(src))
        elif suffix in ("weight_scale", "scales"):
            layer.scales[:, part].copy_((src.t() if suffix == "weight_scale" else src).float())
        elif suffix == "weight_zero_point":
            layer.zeros[:, part].copy_(lowbit.unpack(src.t(), s.bits)[:, :n])
        elif suffix == "qzeros":
            zeros = lowbit.unpack(src, s.bits) if s.format != "awq" else lowbit.awq_columns(src)
            if s.format == "gptq":  # GPTQ's first format stores zero points less one
                zeros = zeros + 1
            if zeros.max() > 255:
                raise ConfigError(f"{layer.name}.qzeros: a zero point of {zeros.max()} does not fit a byte")
            layer.zeros[:, part].copy_(zeros)
        elif suffix == "g_idx":
            if src.dtype.is_floating_point or src.dtype == torch.bool:
                raise ConfigError(f"{layer.name}.g_idx is {src.dtype}, expected integer group indices")
            k = src.shape[0]
            in_order = torch.arange(k) // layer.group
            if not torch.equal(src.long() - src[0].long(), in_order):
                raise ConfigError(
                    f"{layer.name}.g_idx: the groups are not runs of {layer.group} consecutive input columns "
                    "(act-order / desc_act), which tinypaged does not run; quantize with desc_act false"
                )
        elif suffix == "weight_shape" and src.numel() != 2:
            raise ConfigError(f"{layer.name}.weight_shape has {src.numel()} values, expected 2")

    def pack_for_cpu(self, layer: Linear) -> None:
        """On the CPU, pack the weight for torch's kernels where they take it (model/quant/cpu.py) and free
        the layout's tensors: the packed ones are the layer's weight from then on."""
        s = self.scheme
        zeros, mins = layer.zeros is not None, layer.mins is not None
        on_cpu = layer.qweight.device.type == "cpu"
        if not on_cpu or not cpu.packable(
            s.bits, layer.group, layer.out_features, layer.in_features, zeros, mins
        ):
            return
        codes = lowbit.unpack(layer.qweight, s.bits)
        packed = cpu.pack(codes, layer.scales, layer.zeros, layer.mins, s.bits, layer.group)
        if packed is None:
            return
        layer.cpu_packed = packed
        for name in ("qweight", "scales", "zeros", "mins"):
            if getattr(layer, name) is not None:
                setattr(layer, name, keep_dtype(nn.Parameter(getattr(layer, name)[:0], requires_grad=False)))
        layer.packed_codes = nn.Parameter(layer.cpu_packed.codes, requires_grad=False)  # counted as weights
        layer.packed_scales = nn.Parameter(layer.cpu_packed.scales, requires_grad=False)

    def weight(self, layer: Linear) -> lowbit.IntWeight:
        """The layer's weight as the kernels take it."""
        return lowbit.IntWeight(
            layer.qweight,
            layer.scales,
            layer.zeros,
            self.scheme.bits,
            layer.group,
            layer.mins,
            layer.cpu_packed,
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed = layer.cpu_packed
        # The CPU's hot path: wint_linear's own packed branch, without building an IntWeight every call.
        if packed is not None and x.dim() == 2:
            return cpu.packed_linear(x, packed, layer.bias)
        return lowbit.wint_linear(x, self.weight(layer), layer.bias)

    def __str__(self) -> str:
        return str(self.scheme)


UNQUANTIZED = LinearMethod()


def cpu_reference_layers(model: nn.Module) -> list[str]:
    """The weight-only layers of a model on the CPU that torch's packed kernels did not take (`pack_for_cpu`):
    they run the reference, which dequantizes the whole weight every call (lowbit.ref_wint_linear)."""
    return [
        m.name
        for m in model.modules()
        if isinstance(m, Linear)
        and isinstance(m.method, IntLinearMethod)
        and m.qweight.device.type == "cpu"
        and m.cpu_packed is None
    ]


def linear_method(scheme: Scheme | None) -> LinearMethod:
    """The method that runs a layer of this scheme (None: unquantized)."""
    if scheme is None:
        return UNQUANTIZED
    if isinstance(scheme, Fp8Scheme):
        return Fp8LinearMethod(scheme)
    if isinstance(scheme, IntScheme):
        return IntLinearMethod(scheme)
    raise ConfigError(f"no linear method runs {scheme}")


class Linear(Module):
    """`y = x W^T + b`, W stored as its method says; the output rows may be several fused parts (`parts`:
    their row counts, q/k/v or gate/up), each filled from its own checkpoint tensor. `name` is the layer's
    name for errors."""

    def __init__(
        self,
        in_features: int,
        parts: Sequence[int],
        bias: bool = False,
        method: LinearMethod = UNQUANTIZED,
        name: str = "",
    ) -> None:
        super().__init__()
        self.in_features, self.parts, self.out_features = in_features, tuple(parts), sum(parts)
        self.name = name
        self.method = method
        method.create(self)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor | fp8.Fp8Activation) -> torch.Tensor:
        return self.method.apply(self, x)


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]]
