"""Quantized linear layers: the methods that store and run a layer's weight (linear.py) and the FP8 numerics
they and the GPU kernels share (fp8.py). Which scheme each layer runs is read in tinypaged/quantization.py."""

from tinypaged.model.quant.linear import (
    Linear,
    LinearMethod,
    TensorLayout,
    cpu_reference_layers,
    linear_method,
)

__all__ = ["Linear", "LinearMethod", "TensorLayout", "cpu_reference_layers", "linear_method"]
