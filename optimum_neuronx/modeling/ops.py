"""Custom ops the decoder calls where a backend may bring its own kernel.

Each op is defined by its eager implementation (what every backend without a kernel of its own computes,
and what torch.export traces through) and a fake one for shapes. The inductor backend compiles
`rows_matvec_bf16` into its graphs as a hand-written C++ kernel (backends/inductor_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("optimum_neuronx::rows_matvec_bf16", mutates_args=())
def rows_matvec_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for a few bfloat16 rows x [R, K] and a dense weight [N, K] -> [R, N] bfloat16.

    Sums in float32, rounded once to bfloat16. Meant for decode, where R is the batch: the compiled kernel reads
    each weight row once for all rows of x.
    """
    return F.linear(x, weight)


@rows_matvec_bf16.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"rows_matvec_bf16 takes x [R, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"rows_matvec_bf16 takes bfloat16 tensors; got {x.dtype} and {weight.dtype}")
    return x.new_empty(x.shape[0], weight.shape[0])
