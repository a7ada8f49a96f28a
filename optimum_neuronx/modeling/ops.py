"""Custom ops the decoder calls where a backend may bring its own kernel.

Each op is defined by its eager implementation (what every backend without a kernel of its own computes,
and what torch.export traces through) and a fake one for shapes. The inductor backend compiles
`rows_matvec` and `decode_attention` into its graphs as hand-written C++ kernels (backends/inductor_kernels.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ROWS_MATVEC_DTYPES = (torch.bfloat16, torch.float32)


@torch.library.custom_op("optimum_neuronx::rows_matvec", mutates_args=())
def rows_matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for a few rows x [R, K] and a dense weight [N, K] -> [R, N], both bfloat16 or both
    float32.

    Sums in float32 (bfloat16: rounded once). Meant for decode, where R is the batch: the compiled kernel reads
    each weight row once for all rows of x.
    """
    return F.linear(x, weight)


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
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@rows_matvec.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"rows_matvec takes x [R, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in ROWS_MATVEC_DTYPES:
        raise ValueError(f"rows_matvec takes two bfloat16 or two float32 tensors; got {x.dtype} and {weight.dtype}")
    return x.new_empty(x.shape[0], weight.shape[0])


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
