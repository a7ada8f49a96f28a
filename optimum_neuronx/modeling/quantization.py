"""Weight-only quantization of the decoder's projections: int8, symmetric, one float32 scale per output channel.

A quantized projection stores `<name>.weight` as int8 [..., out, in] and `<name>.scale` as float32 [..., out]; the
projection computes `(x @ weight.T) * scale` (`Kernels.linear`), the weight widened inside the product. The embedding,
the norms and the LM head keep the export dtype.
"""

from __future__ import annotations

import torch

from .spec import LAYER_PROJECTIONS

# The layer projections quantized (MoE experts and the router are not).
QUANTIZED_PROJECTIONS = LAYER_PROJECTIONS
INT8_MAX = 127


def is_quantized_weight(name: str) -> bool:
    """Whether the decoder weight `name` is quantized in a quantized export."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_PROJECTIONS


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] -> (int8 [..., out, in], float32 scales [..., out]): each output channel divided by its
    largest magnitude / 127 and rounded (an all-zero channel gets scale 1)."""
    w = weight.float()
    peak = w.abs().amax(-1)
    scale = torch.where(peak > 0, peak / INT8_MAX, torch.ones_like(peak))
    q = torch.round(w / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an int8 weight and its scales stand for."""
    return weight.float() * scale[..., None]


def quantize_weights(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Float weights (decoder names) with the projections quantized to int8 (+ their scales) and the rest in `dtype`
    (a quantized export being rebuilt is dequantized first: `dequantize_weights`)."""
    out = {}
    for name, weight in weights.items():
        if is_quantized_weight(name):
            out[name], out[scale_name(name)] = quantize_int8(weight)
        else:
            out[name] = weight.to(dtype)
    return out


def dequantize_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Int8 weights (with their scales) back to float32: a quantized export's weights as a plain decoder's."""
    out = {}
    for name, weight in weights.items():
        if name.endswith(".scale"):
            continue
        scale = weights.get(scale_name(name)) if name.endswith(".weight") else None
        out[name] = dequantize(weight, scale) if weight.dtype == torch.int8 and scale is not None else weight
    return out
