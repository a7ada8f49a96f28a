"""The inductor backend's kernels for the decoder: `Lowering`, its choice of how each projection and attention is
computed for one export (`InductorBackend.kernels`), stamped into the export as `lowering`.

Decode projections over a few rows go through our dot kernel (`rows_matvec`) or one fused multiply + sum per row;
prefill through oneDNN's linear (or `tiled_linear` over tiled weights); decode attention through fused reductions
or our `decode_attention` kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ...modeling.kernels import Kernels
from ...modeling.layout import weight_outputs
from ...modeling.spec import LAYER_PROJECTIONS
from .ops import (KERNEL_ROWS, ROWS_MATVEC_DTYPES, decode_attention, int8_matvec, onednn_linear, rows_matvec,
                  tiled_linear)


@dataclass(frozen=True)
class Lowering(Kernels):
    """The inductor backend's kernels for the decoder (modeling/kernels.py `Kernels`), chosen per export.

    dot_rows: bfloat16 or float32 projections over at most `dot_rows` rows are `rows_matvec` (ops.py), for which
        the backend compiles its own kernel (`uses_dot_kernel`), of any input width: the kernel cuts wide input rows
        into pieces that stay in cache.
    dot_isa: the instruction set that kernel is compiled for (the backend's name, e.g. "avx512"; "" without it).
    matvec_rows: other projections over at most this many rows are one multiply + sum per row (`project`).
    gemm_dtype: dtype the other projections compute in (None: the input's).
    onednn: the other projections go through oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`).
    packed_rows: when > 0 (with onednn), the projection weights (layers, untied LM head) that the dot kernel
        does not read at this many rows may be reordered at load into oneDNN's blocked layout for this many rows
        (`packable_weight_names`); the graphs then never read those as plain tensors.
    attention_tokens: attention for at most this many new tokens per sequence (decode) is multiply + sum
        reductions over the cache, which Inductor fuses (`reduced_attention`); longer queries use SDPA.
    attention_kernel: that decode attention is instead `decode_attention` (ops.py), for which the backend
        compiles its own kernel (variant `dot_isa`).
    causal_block: when > 0, context attention runs SDPA per block of this many query tokens, each against only
        the keys up to its last token (`attention_masks`): the blocks above the diagonal are never computed.
    weight_tile: when > 0, the projection weights (layers, untied LM head) whose outputs are a multiple of it are
        stored tiled, [N / T, K, T] (modeling/layout.py): decode reads them through the dot
        kernel (which must then take every decode row: dot_rows at least the batch), prefill through
        `tiled_linear`.
    int8_kernel: int8 projections (quantized exports) over at most KERNEL_ROWS rows are `int8_matvec` (ops.py),
        for which the backend compiles its own kernel (variant `dot_isa`); otherwise one fused multiply + sum per
        row reading the int8 weight (`matvec_rows`), and past those rows the weight widened one projection at a time
        for oneDNN's linear.
    """

    dot_rows: int = 0
    dot_isa: str = ""
    matvec_rows: int = 0
    gemm_dtype: torch.dtype | None = None
    onednn: bool = False
    packed_rows: int = 0
    attention_tokens: int = 0
    attention_kernel: bool = False
    causal_block: int = 0
    weight_tile: int = 0
    int8_kernel: bool = False

    @property
    def stacked_layers(self) -> bool:
        """The layers' weights stacked along a layer axis and run as one loop; not when the layers' weights are
        packed (past the dot kernel's rows), which happens per layer: a packed weight cannot be stacked or sliced."""
        return self.packed_rows <= self.dot_rows

    def scans(self, spec) -> bool:
        # AOTInductor (torch 2.14) builds token graphs of models without grouped KV heads (as many KV heads as query
        # heads) whose layer loop corrupts the heap in bfloat16: their layers are unrolled instead (same math; compile
        # time grows with the layers).
        return self.scan_layers and spec.num_kv_heads < spec.num_heads

    def uses_dot_kernel(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a projection of `rows` rows of `dtype` is `rows_matvec`."""
        return dtype in ROWS_MATVEC_DTYPES and rows <= self.dot_rows

    def for_layers(self) -> "Lowering":
        # Packed weights are opaque to the multiply + sum: every layer projection that the dot kernel does not take
        # goes through oneDNN. (The dot kernel's weights are never packed.)
        return replace(self, matvec_rows=0) if self.packed_rows else self

    def for_lm_head(self, tied: bool) -> "Lowering":
        # A tied LM head is the embedding table, which the embedding lookup reads plainly: never packed.
        return replace(self, packed_rows=0) if tied else self.for_layers()

    def describe(self) -> dict:
        return {"dot_rows": self.dot_rows, "dot_isa": self.dot_isa,
                "matvec_rows": self.matvec_rows,
                "gemm_dtype": str(self.gemm_dtype).removeprefix("torch."), "onednn": self.onednn,
                "packed_rows": self.packed_rows, "attention_tokens": self.attention_tokens,
                "attention_kernel": self.attention_kernel, "causal_block": self.causal_block,
                "weight_tile": self.weight_tile, "int8_kernel": self.int8_kernel}

    def weight_tile_for(self, outputs: int) -> int:
        return self.weight_tile if self.weight_tile and outputs % self.weight_tile == 0 else 0

    def linear(self, x, weight, bias, stacked, scale=None):
        if scale is not None:
            return project_int8(x, weight, scale, bias, self.for_layers(), constant_weight=not stacked)
        return project(x, weight, bias, self.for_layers(), constant_weight=not stacked)

    def lm_head(self, h, weight, tied):
        return project(h, weight, None, self.for_lm_head(tied))

    def attention(self, q, keys, values, mask, scale, tokens):
        if tokens <= self.attention_tokens:
            return reduced_attention(q, [(keys, values, mask)], scale)
        return super().attention(q, keys, values, mask, scale, tokens)

    def window_attention(self, q, cache_kv, new_kv, cache_mask, new_mask, scale, tokens):
        # The window and the new tokens meet only in the softmax: the new K and V are never selected into a copy
        # of the window, which Inductor would do element by element inside the attention's loops.
        if tokens > self.attention_tokens:
            return super().window_attention(q, cache_kv, new_kv, cache_mask, new_mask, scale, tokens)
        if self.attention_kernel:
            query = _materialized((q.float() * scale).contiguous())
            dtype = cache_kv.dtype
            return decode_attention(query, cache_kv[0], cache_kv[1], cache_mask.to(dtype), new_kv[0], new_kv[1],
                                    new_mask.to(dtype))
        return reduced_attention(q, [(cache_kv[0], cache_kv[1], cache_mask), (new_kv[0], new_kv[1], new_mask)],
                                 scale)

    def packable_weight_names(self, decoder) -> list[str]:
        """Weights read only by oneDNN's linear, which the runtime may reorder for it (`packed_rows`); none when the
        dot kernel takes the token graphs' rows (it reads them plain) or the layers are stacked."""
        rows, dtype = self.packed_rows, decoder.embed_tokens.weight.dtype
        if not rows or self.uses_dot_kernel(rows, dtype) or self.stacked_layers:
            return []
        present = set(decoder.parameter_names())
        names = [f"layers.{i}.{name}.weight" for i in range(decoder.spec.num_layers)
                 for name in LAYER_PROJECTIONS
                 if f"layers.{i}.{name}.weight" in present]
        return names if decoder.spec.tie_word_embeddings else [*names, "lm_head.weight"]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lowering: Lowering,
            constant_weight: bool = True) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `lowering` says.

    Within the dot kernel's limits (`Lowering.uses_dot_kernel`): `rows_matvec`. Otherwise, with at most
    `matvec_rows` rows: one multiply + sum per row. The per-row reductions share their loop over the weight, so
    the compiled kernel reads each weight row once and keeps one accumulator per input row; results are stacked
    row-major. (A single [out, rows, in] product instead leaves its result column-major,
    and the layout then spreads to the residual stream and turns the next reductions into strided ones: 30x
    slower at 4 rows.) Matrix multiplications compute in `gemm_dtype` and round back to x's dtype. oneDNN's linear
    on a weight that is not a graph constant (`constant_weight` False: a slice of stacked layers) is the custom op
    `onednn_linear`.
    """
    rows = x.numel() // x.shape[-1]
    tiled = weight.dim() == 3  # Lowering.weight_tile: [N / T, K, T]
    outputs = weight_outputs(weight)
    if lowering.uses_dot_kernel(rows, x.dtype) and weight.dtype == x.dtype:
        out = rows_matvec(x.reshape(rows, x.shape[-1]), weight)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], outputs)
    if tiled:  # past the dot kernel's rows (prefill): tiled_linear, whose kernel reads the tiles as they lie
        if rows <= lowering.matvec_rows:
            raise ValueError(f"a tiled weight needs the dot kernel for {rows} rows (Lowering.dot_rows "
                             f"{lowering.dot_rows}): raise dot_rows or keep the weights plain (weight_tile 0)")
        return tiled_linear(x.reshape(rows, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], outputs)
    if rows > lowering.matvec_rows:
        gemm_dtype = lowering.gemm_dtype or x.dtype
        if gemm_dtype != x.dtype:
            cast = [t if t is None else t.to(gemm_dtype) for t in (x, weight, bias)]
            return F.linear(*cast).to(x.dtype)
        if lowering.onednn:
            # Rows flattened, the result viewed back: the view keeps Inductor from fusing a following residual
            # add into oneDNN's binary linear, which is slower per call.
            flat = x.reshape(rows, x.shape[-1])
            if constant_weight:
                out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
            else:
                out = onednn_linear(flat, weight, bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, weight, bias)
    flat = _materialized(x.reshape(rows, x.shape[-1]))
    out = torch.stack([(weight * row).sum(-1) for row in flat.unbind(0)])
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 lowering: Lowering, constant_weight: bool = True) -> torch.Tensor:
    """`F.linear(x, weight * scale[:, None], bias)` for an int8 weight [N, K] with float32 scales [N], computed as
    `lowering` says: decode rows through `int8_matvec` or a multiply + sum per row that widens each weight element as
    it reads it (never a wider copy of the weight); more rows (prefill) through `project` on the weight widened to
    x's dtype, one projection at a time (a temporary buffer, freed after the product)."""
    rows, outputs = x.numel() // x.shape[-1], weight.shape[0]
    flat = x.reshape(rows, x.shape[-1])
    if lowering.int8_kernel and rows <= KERNEL_ROWS and x.dtype in ROWS_MATVEC_DTYPES:
        out = int8_matvec(flat, weight, scale)
    elif rows <= lowering.matvec_rows:
        flat = _materialized(flat.float())
        out = (torch.stack([(weight.float() * row).sum(-1) for row in flat.unbind(0)]) * scale).to(x.dtype)
    else:
        out = project(flat, weight.to(x.dtype), None, replace(lowering, dot_rows=0, packed_rows=0),
                      constant_weight=False)
        out = (out.float() * scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], outputs)


def reduced_attention(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      scale: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for a few query rows (q [B, H, R, D]), as float32 multiply + sum, over
    the keys of every (keys, values, mask) in `parts` together (one softmax).

    Inductor fuses each product with its reduction and the softmax into a few loops over the cache; the CPU
    flash-attention kernel, tiled for long queries, costs up to 2x more at decode. The
    query (after RoPE) and the masks are stored first, or Inductor recomputes them inside those loops. Several
    parts (decode: the cache window and the new tokens) meet only in the softmax over their scores, so each
    product reads its keys and values as they lie.
    """
    query = _materialized(q.float())
    scores = [(query[:, :, :, None, :] * keys.float()[:, :, None, :, :]).sum(-1) * scale + _materialized(mask.float())
              for keys, _, mask in parts]
    # One softmax over all parts' keys, never concatenated: a shared maximum, and the weighted sums of the values
    # divided by the sum of the weights at the end.
    peak = functools.reduce(torch.maximum, [part.amax(-1, keepdim=True) for part in scores])
    weights = [(part - peak).exp() for part in scores]
    total = functools.reduce(torch.add, [weight.sum(-1, keepdim=True) for weight in weights])
    out = functools.reduce(torch.add, [(weight[..., None] * values.float()[:, :, None, :, :]).sum(-2)
                                       for weight, (_, values, _) in zip(weights, parts)])
    return (out / total).to(q.dtype)



def _materialized(x: torch.Tensor) -> torch.Tensor:
    """`x`, stored to memory by Inductor rather than recomputed inside its consumer's inner loop.

    Without it the RMSNorm producing a projection's input (a division and a square root per row) is
    inlined into every step of the reduction over the weight: 3x slower at 4 rows. Identity in eager
    mode and for compilers that do not know the primitive.
    """
    try:
        from torch._inductor import inductor_prims  # noqa: F401  (registers the primitive)
    except ImportError:
        return x
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    if force is None:
        return x
    # Contiguous strides from the sizes, not x.stride(): Dynamo first traces the layer loop's body, may give it
    # symbolic shapes, and then cannot hand out the strides; int() specializes them to the shapes at hand.
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.insert(0, step)
        step *= int(size)
    return force(x.contiguous(), strides)


