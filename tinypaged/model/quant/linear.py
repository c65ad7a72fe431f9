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
from tinypaged.model.quant import fp8
from tinypaged.quantization import Fp8Scheme, Scheme


@dataclass(frozen=True)
class TensorLayout:
    """How a checkpoint tensor lies over its layer's `[out_features, in_features]` weight: the dim that runs
    along the output rows and the one along the input columns (None: the tensor does not), and how many rows
    (columns) one stored element covers (a block's size, several values packed in one element)."""

    out_dim: int | None = 0
    in_dim: int | None = 1
    out_per: int = 1
    in_per: int = 1

    def shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The stored shape for a weight of `rows` x `cols` (size-1 dims aside: a scalar is `()`)."""
        dims = {self.out_dim: math.ceil(rows / self.out_per), self.in_dim: math.ceil(cols / self.in_per)}
        dims.pop(None, None)
        return tuple(dims[d] for d in sorted(dims))  # type: ignore[type-var]

    def fits(self, shape: tuple[int, ...], rows: int, cols: int) -> bool:
        """Whether a checkpoint tensor of `shape` is this layout of a `rows` x `cols` weight (size-1 dims are
        ignored: a per-channel scale is written `[out]` or `[out, 1]`, a per-tensor one `[]` or `[1]`)."""
        return [d for d in shape if d != 1] == [d for d in self.shape(rows, cols) if d != 1]

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


UNQUANTIZED = LinearMethod()


def linear_method(scheme: Scheme | None) -> LinearMethod:
    """The method that runs a layer of this scheme (None: unquantized)."""
    if scheme is None:
        return UNQUANTIZED
    if isinstance(scheme, Fp8Scheme):
        return Fp8LinearMethod(scheme)
    raise ConfigError(f"no linear method runs {scheme}")


class Linear(nn.Module):
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
