"""The inductor backend's custom ops: an eager definition (what torch.export traces) and a fake one for shapes.

AOTInductor compiles `rows_matvec`, `tiled_linear`, `int8_matvec` and `decode_attention` into the graphs as our own C++ kernels
(custom_kernels.py); `onednn_linear` is oneDNN's linear behind the dispatcher. Weights are plain [N, K] or tiled
[N / T, K, T] (modeling/layout.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...modeling.layout import untile_weight, weight_outputs

ROWS_MATVEC_DTYPES = (torch.bfloat16, torch.float32)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x [R, K] @ each tile [K, T] -> [N / T, R, T] -> [R, N]
    return torch.matmul(x, weight).transpose(0, 1).reshape(x.shape[0], weight_outputs(weight))


@torch.library.custom_op("optimum_neuronx::rows_matvec", mutates_args=())
def rows_matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for a few rows x [R, K] and a dense weight, plain [N, K] or tiled [N / T, K, T] -> [R, N],
    both bfloat16 or both float32.

    Sums in float32 (bfloat16: rounded once). Meant for decode, where R is the batch: the compiled kernel reads
    each weight row (or tile) once for all rows of x.
    """
    return _tiled_linear(x, weight) if weight.dim() == 3 else F.linear(x, weight)


# Tiled weights up to this many bytes are copied back to rows for one oneDNN call (faster for small weights);
# larger ones take one call per tile.
TILED_LINEAR_COPY_BYTES = 16 << 20


@torch.library.custom_op("optimum_neuronx::tiled_linear", mutates_args=())
def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`F.linear` of x [R, K] with a weight in tiles [N / T, K, T] -> [R, N], for many rows (prefill).

    The inductor backend compiles its own kernel for it (backends/kernels/rows_matvec.cpp, `tiled_gemm`: each tile
    stays in cache while every row of x passes over it), as fast as oneDNN's linear on the plain weight. Eager (and
    where a graph calls it through the dispatcher): oneDNN's linear on the weight copied back to rows when small
    (TILED_LINEAR_COPY_BYTES), else once per tile, which reads the tile [K, T] as the transposed weight [T, K] it is;
    without oneDNN (or its bfloat16), one batched matrix product over the tiles.
    """
    if not torch.backends.mkldnn.is_available() or not (
            x.dtype == torch.float32 or x.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        out = _tiled_linear(x, weight)
        return out if bias is None else out + bias
    if weight.numel() * weight.element_size() <= TILED_LINEAR_COPY_BYTES:
        return _onednn(x, untile_weight(weight), bias)
    tile = weight.shape[2]
    out = x.new_empty(x.shape[0], weight_outputs(weight))
    for i in range(weight.shape[0]):
        part = None if bias is None else bias[i * tile:(i + 1) * tile]
        out[:, i * tile:(i + 1) * tile] = _onednn(x, weight[i].t(), part)
    return out


@tiled_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    outputs = weight_outputs(weight) if weight.dim() == 3 else -1
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype or (
            bias is not None and (tuple(bias.shape) != (outputs,) or bias.dtype != x.dtype)):
        raise ValueError(f"tiled_linear takes x [R, K], tiles [N / T, K, T] and a bias [N] or None, of one dtype; got "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype} and "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}")
    return x.new_empty(x.shape[0], outputs)


# The most rows of x our projection kernels (rows_matvec, int8_matvec) take in one pass over the weight.
KERNEL_ROWS = 4


@torch.library.custom_op("optimum_neuronx::int8_matvec", mutates_args=())
def int8_matvec(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight * scale[:, None])` for a few rows x [R, K] (bfloat16 or float32) and an int8 weight
    [N, K] with float32 scales [N] (symmetric, per output channel) -> [R, N] in x's dtype, float32 sums.

    The compiled kernel (kernels/int8_matvec.cpp) reads each int8 weight row once for all rows of x and widens it
    in registers; this eager definition (what torch.export traces, and the portable reference) dequantizes.
    """
    return (F.linear(x.float(), weight.float()) * scale).to(x.dtype)


@int8_matvec.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] > KERNEL_ROWS
            or weight.dtype != torch.int8 or scale.dtype != torch.float32 or tuple(scale.shape) != (weight.shape[0],)
            or x.dtype not in ROWS_MATVEC_DTYPES):
        raise ValueError(f"int8_matvec takes x [R <= {KERNEL_ROWS}, K] bfloat16 or float32, weight [N, K] int8 "
                         f"and scale [N] float32; got {tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} "
                         f"{weight.dtype}, {tuple(scale.shape)} {scale.dtype}")
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("optimum_neuronx::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, cache_mask: torch.Tensor,
                     new_k: torch.Tensor, new_v: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
    """Attention of a few query rows per (sequence, KV head) over a cache window and the new tokens, one softmax.

    q [B, KV, R, D] float32, already multiplied by the softmax scale; cache_k / cache_v [B, KV, W, D] and new_k /
    new_v [B, KV, T, D], bfloat16 or float32; additive masks cache_mask [B, 1, R, W] and new_mask [B, 1, R, T] of
    that dtype. Float32 throughout; returns [B, KV, R, D] in the keys' dtype (rounded once).
    """
    scores = torch.cat((q @ cache_k.float().transpose(-1, -2) + cache_mask.float(),
                        q @ new_k.float().transpose(-1, -2) + new_mask.float()), dim=-1)
    weights = scores.softmax(-1)
    window = cache_k.shape[2]
    out = weights[..., :window] @ cache_v.float() + weights[..., window:] @ new_v.float()
    return out.to(cache_k.dtype)


@torch.library.custom_op("optimum_neuronx::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`) on x [R, K] and a plain weight [N, K] -> [R, N].

    Opaque to Inductor, which lowers oneDNN's linear only on a weight that is a graph constant: inside the layer
    loop a weight is one layer's slice of the stacked weights. AOTInductor calls it through the dispatcher (this
    module registers it wherever a graph is loaded); at prefill sizes that costs nothing next to the GEMM.
    """
    return _onednn(x, weight, bias)


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@rows_matvec.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() not in (2, 3) or x.shape[1] != weight.shape[1]:
        raise ValueError(f"rows_matvec takes x [R, K] and weight [N, K] or tiles [N / T, K, T]; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in ROWS_MATVEC_DTYPES:
        raise ValueError(f"rows_matvec takes two bfloat16 or two float32 tensors; got {x.dtype} and {weight.dtype}")
    return x.new_empty(x.shape[0], weight_outputs(weight))


@decode_attention.register_fake
def _(q, cache_k, cache_v, cache_mask, new_k, new_v, new_mask):
    B, KV, R, D = q.shape
    if q.dtype != torch.float32 or cache_k.dtype not in ROWS_MATVEC_DTYPES:
        raise ValueError(f"decode_attention takes a float32 query and bfloat16 or float32 keys; got {q.dtype} and "
                         f"{cache_k.dtype}")
    for name, t, rows in (("cache_k", cache_k, None), ("cache_v", cache_v, cache_k.shape[2]),
                          ("new_k", new_k, None), ("new_v", new_v, new_k.shape[2])):
        if t.dtype != cache_k.dtype or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, KV, D) or (
                rows is not None and t.shape[2] != rows):
            raise ValueError(f"decode_attention: {name} {tuple(t.shape)} {t.dtype} does not match q {tuple(q.shape)} "
                             f"and cache_k {tuple(cache_k.shape)} {cache_k.dtype}")
    for name, mask, keys in (("cache_mask", cache_mask, cache_k), ("new_mask", new_mask, new_k)):
        if mask.dtype != cache_k.dtype or tuple(mask.shape) != (B, 1, R, keys.shape[2]):
            raise ValueError(f"decode_attention: {name} must be [{B}, 1, {R}, {keys.shape[2]}] {cache_k.dtype}; "
                             f"got {tuple(mask.shape)} {mask.dtype}")
    return q.new_empty(q.shape, dtype=cache_k.dtype)
