"""Custom ops the decoder calls where a backend may bring its own kernel.

Each op is defined by its eager implementation (what every backend without a kernel of its own computes,
and what torch.export traces through) and a fake one for shapes. The inductor backend compiles
`rows_matvec` into its graphs as a hand-written C++ kernel (backends/inductor_kernels.py).
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
