"""One static-shape decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

A single forward serves both graphs:

    forward(input_ids[B, T], position_ids[B, T], cache_start[1], key_valid[B, W], last_index[B], kv_caches)
        -> logits[B, V] (float32)

* context encoding: T = W = prompt bucket, cache_start = 0;
* token generation: T = 1, W = token-generation bucket, cache_start = the slot the token is written to.

The T new tokens are written at cache slots cache_start .. cache_start + T - 1 of the preallocated
per-layer caches `kv_caches[layer][2 (k/v), B, kv_heads, S, head_dim]`, then attention reads slots
0 .. W - 1. One tensor per layer (not one stacked tensor) keeps every layer's generated kernels
identical, so the compiler emits them once: compile time no longer grows with the layer count.
Query t may see slot k when `key_valid[b, k]` and `k <= cache_start + t` (causal). Only the hidden
state at `last_index` goes through the final norm and the LM head.

How projections and decode attention are computed is the backend's choice (`Lowering`): bfloat16 and float32
projections over a handful of rows (decode) as the custom op `rows_matvec` (ops.py), which the inductor backend
compiles to its own dot-product kernel; other projections over a handful of rows as multiply + sum, which Inductor fuses
into one streaming reduction over the weight with one accumulator per row; otherwise F.linear, or oneDNN's
linear, whose weights the runtime may reorder at load into oneDNN's blocked layout (`packed_rows`) - faster at a
few rows than both of the latter (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .ops import ROWS_MATVEC_DTYPES, rows_matvec

_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float

    def kv_cache_shape(self, batch_size: int, sequence_length: int) -> tuple[int, ...]:
        """Shape of one layer's cache."""
        return (2, batch_size, self.num_kv_heads, sequence_length, self.head_dim)


@dataclass(frozen=True)
class Lowering:
    """How the decoder's projections and decode attention are computed; chosen by the backend for each export.

    dot_rows: bfloat16 or float32 projections over at most `dot_rows` rows are `rows_matvec` (ops.py), for which
        the backend compiles its own kernel (`uses_dot_kernel`), of any input width: the kernel cuts wide input
        rows into pieces that stay in cache.
    dot_isa: the instruction set that kernel is compiled for (the backend's name, e.g. "avx512"; "" without it).
    matvec_rows: other projections over at most this many rows are one multiply + sum per row (`project`).
    gemm_dtype: dtype the other projections compute in (None: the input's).
    onednn: the other projections go through oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`).
    packed_rows: when > 0 (with onednn), the projection weights (layers, untied LM head) that the dot kernel
        does not read at this many rows may be reordered at load into oneDNN's blocked layout for this many rows
        (`StaticDecoder.packable_weight_names`); the graphs then never read those as plain tensors.
    attention_tokens: attention for at most this many new tokens per sequence (decode) is multiply + sum
        reductions over the cache, which Inductor fuses (`reduced_attention`); longer queries use SDPA.
    causal_block: when > 0, context attention runs SDPA per block of this many query tokens, each against only
        the keys up to its last token (`attention_masks`): the blocks above the diagonal are never computed.
    """

    dot_rows: int = 0
    dot_isa: str = ""
    matvec_rows: int = 0
    gemm_dtype: torch.dtype | None = None
    onednn: bool = False
    packed_rows: int = 0
    attention_tokens: int = 0
    causal_block: int = 0

    def uses_dot_kernel(self, rows: int, dtype: torch.dtype) -> bool:
        return dtype in ROWS_MATVEC_DTYPES and rows <= self.dot_rows

    def for_layers(self) -> "Lowering":
        # Packed weights are opaque to the multiply + sum: every layer projection that the dot kernel does not take
        # goes through oneDNN. (The dot kernel's weights are never packed.)
        return replace(self, matvec_rows=0) if self.packed_rows else self

    def for_lm_head(self, tied: bool) -> "Lowering":
        # A tied LM head is the embedding table, which the embedding lookup reads plainly: never packed. (A
        # packed copy of its own measured no faster: SmolLM2, batch 4.)
        return replace(self, packed_rows=0) if tied else self.for_layers()

    def describe(self) -> dict:
        return {"dot_rows": self.dot_rows, "dot_isa": self.dot_isa, "matvec_rows": self.matvec_rows,
                "gemm_dtype": str(self.gemm_dtype).removeprefix("torch."), "onednn": self.onednn,
                "packed_rows": self.packed_rows, "attention_tokens": self.attention_tokens,
                "causal_block": self.causal_block}


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lowering: Lowering) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `lowering` says.

    Within the dot kernel's limits (`Lowering.uses_dot_kernel`): `rows_matvec`. Otherwise, with at most
    `matvec_rows` rows: one multiply + sum per row. The per-row reductions share their loop over the weight, so
    the compiled kernel reads each weight row once and keeps one accumulator per input row; results are stacked
    row-major. (A single [out, rows, in] product instead leaves its result column-major,
    and the layout then spreads to the residual stream and turns the next reductions into strided ones: 30x
    slower at 4 rows.) Matrix multiplications compute in `gemm_dtype` and round back to x's dtype.
    """
    rows = x.numel() // x.shape[-1]
    if lowering.uses_dot_kernel(rows, x.dtype) and weight.dtype == x.dtype:
        out = rows_matvec(x.reshape(rows, x.shape[-1]), weight)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if rows > lowering.matvec_rows:
        gemm_dtype = lowering.gemm_dtype or x.dtype
        if gemm_dtype != x.dtype:
            cast = [t if t is None else t.to(gemm_dtype) for t in (x, weight, bias)]
            return F.linear(*cast).to(x.dtype)
        if lowering.onednn:
            # Rows flattened, the result viewed back: the view keeps Inductor from fusing a following residual
            # add into oneDNN's binary linear, which costs ~12 us more per call (docs/performance.md).
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), weight, bias, "none", [], "")
            return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, weight, bias)
    flat = _materialized(x.reshape(rows, x.shape[-1]))
    out = torch.stack([(weight * row).sum(-1) for row in flat.unbind(0)])
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def reduced_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for a few query rows (q [B, H, R, D]), as float32 multiply + sum.

    Inductor fuses each product with its reduction and the softmax into a few loops over the cache; the CPU
    flash-attention kernel, tiled for long queries, costs up to 2x more at decode (docs/performance.md). The
    query (after RoPE) and the mask are stored first, or Inductor recomputes them inside those loops.
    """
    query, mask = _materialized(q.float()), _materialized(mask.float())
    scores = (query[:, :, :, None, :] * keys.float()[:, :, None, :, :]).sum(-1) * scale + mask
    probs = scores.softmax(-1)
    return (probs[..., None] * values.float()[:, :, None, :, :]).sum(-2).to(q.dtype)


def attention_masks(mask: torch.Tensor, n_rep: int, causal_block: int = 0) -> list[torch.Tensor]:
    """The additive mask [B, 1, T, W] in the layers' folded layout, one piece per block of query tokens.

    Rows are folded like the queries (`attention`): token-major, the `n_rep` query heads of one KV group after
    each other. A context graph (T == W, from slot 0) is cut into blocks of `causal_block` tokens, each with only
    the keys up to its last token: the keys it drops are masked for all of its rows (softmax weight exactly 0).
    Otherwise (decode, or blocks off) one piece covers every query and the whole window. Built once per graph,
    stored (not left as a stride-0 expand) for all layers to read.
    """
    B, _, T, W = mask.shape
    blocks = [(0, T, W)]
    if 0 < causal_block < T and T == W:
        ends = [min(start + causal_block, T) for start in range(0, T, causal_block)]
        blocks = [(start, end, end) for start, end in zip(range(0, T, causal_block), ends)]  # keys up to the end
    return [mask[:, :, start:end, :keys, None].transpose(-1, -2).expand(B, 1, end - start, n_rep, keys)
            .reshape(B, 1, (end - start) * n_rep, keys).contiguous() for start, end, keys in blocks]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, masks: list[torch.Tensor], scale: float,
              reduced: bool) -> torch.Tensor:
    """Attention of folded queries q [B, kv_heads, T * n_rep, D] over keys/values [B, kv_heads, W, D].

    Each piece of `masks` (from `attention_masks`) takes the next rows of q and the keys its width covers: a
    context graph's query blocks skip the keys after them, which the CPU flash-attention kernel would compute
    under an explicit mask (its `is_causal` path is no faster here): 512 tokens in 128-token blocks, a third
    less time. `reduced`: multiply + sum reductions (`reduced_attention`) instead of SDPA.
    """
    out, start = [], 0
    for mask in masks:
        rows, width = mask.shape[-2:]
        args = (q[:, :, start:start + rows], keys[:, :, :width], values[:, :, :width])
        if reduced:
            out.append(reduced_attention(*args, mask, scale))
        else:
            out.append(F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale))
        start += rows
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


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
    return x if force is None else force(x, x.stride())


class Projection(nn.Linear):
    """nn.Linear (same parameter names) computed by `project` as `lowering` says."""

    def __init__(self, in_features: int, out_features: int, bias: bool, lowering: Lowering):
        super().__init__(in_features, out_features, bias=bias)
        self.lowering = lowering

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.lowering)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like Transformers, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, lowering: Lowering):
        super().__init__()
        self.spec = spec
        s = spec
        self.attention_tokens = lowering.attention_tokens
        lowering = dict(lowering=lowering)
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.qkv_proj = Projection(s.hidden_size, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.qkv_bias,
                                   **lowering)
        self.o_proj = Projection(s.num_heads * s.head_dim, s.hidden_size, s.o_bias, **lowering)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.post_attention_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.gate_up_proj = Projection(s.hidden_size, 2 * s.intermediate_size, s.mlp_bias, **lowering)
        self.down_proj = Projection(s.intermediate_size, s.hidden_size, s.mlp_bias, **lowering)
        self.act = _ACTIVATIONS[s.hidden_act]

    def forward(self, h, cos, sin, masks, slots, kv_cache):
        s = self.spec
        B, T, _ = h.shape
        n_rep = s.num_heads // s.num_kv_heads

        qkv = self.qkv_proj(self.input_norm(h))
        q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], -1)
        q = q.view(B, T, s.num_heads, s.head_dim)
        k = k.view(B, T, s.num_kv_heads, s.head_dim)
        v = v.view(B, T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        # One index_put_ on the whole (layer's) cache tensor writes K and V in place; writing through
        # views would make AOTInductor copy the whole cache every layer.
        new_kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4)  # [2, B, kv_heads, T, D]
        dev = kv_cache.device
        index = (
            torch.arange(2, device=dev).view(2, 1, 1, 1),
            torch.arange(B, device=dev).view(1, B, 1, 1),
            torch.arange(s.num_kv_heads, device=dev).view(1, 1, s.num_kv_heads, 1),
            slots.view(1, 1, 1, T),
        )
        kv_cache.index_put_(index, new_kv.to(kv_cache.dtype))

        # GQA without repeating K/V: fold the query heads of one KV group into the query axis, token-major.
        q = q.view(B, T, s.num_kv_heads, n_rep, s.head_dim).transpose(1, 2).reshape(B, s.num_kv_heads, T * n_rep,
                                                                                     s.head_dim)
        attn = attention(q, kv_cache[0], kv_cache[1], masks, s.head_dim**-0.5, reduced=T <= self.attention_tokens)
        attn = attn.view(B, s.num_kv_heads, T, n_rep, s.head_dim).transpose(1, 2)
        h = h + self.o_proj(attn.reshape(B, T, s.num_heads * s.head_dim))

        gate, up = self.gate_up_proj(self.post_attention_norm(h)).chunk(2, dim=-1)
        return h + self.down_proj(self.act(gate) * up)


class StaticDecoder(nn.Module):
    def __init__(self, spec: DecoderSpec, lowering: Lowering = Lowering()):
        super().__init__()
        self.spec = spec
        self.lowering = lowering
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, lowering.for_layers()) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Explicit device: the decoder is built on the meta device at export and only this buffer is real.
        self.register_buffer("rope_inv_freq", torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device="cpu"))

    def parameter_names(self) -> list[str]:
        """Names filled from the checkpoint (the RoPE buffer is derived from the config)."""
        return [name for name, _ in self.named_parameters()]

    def packable_weight_names(self) -> list[str]:
        """Weights read only by oneDNN's linear, which the runtime may reorder for it (`Lowering.packed_rows`).

        None when the dot kernel runs the token graphs' rows (`packed_rows`, the batch): it reads them plain.
        """
        rows, dtype = self.lowering.packed_rows, self.embed_tokens.weight.dtype
        if not rows or self.lowering.uses_dot_kernel(rows, dtype):
            return []
        names = [f"layers.{i}.{name}.weight" for i, layer in enumerate(self.layers)
                 for name, module in layer.named_children() if isinstance(module, Projection)]
        return names if self.spec.tie_word_embeddings else [*names, "lm_head.weight"]

    def forward(self, input_ids, position_ids, cache_start, key_valid, last_index, kv_caches):
        B, T = input_ids.shape
        W = key_valid.shape[1]
        dtype = self.embed_tokens.weight.dtype
        h = self.embed_tokens(input_ids)

        freqs = position_ids[..., None].float() * self.rope_inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.spec.rope_attention_scaling).to(dtype)[:, :, None, :]
        sin = (emb.sin() * self.spec.rope_attention_scaling).to(dtype)[:, :, None, :]

        slots = cache_start + torch.arange(T, device=input_ids.device)  # [T]
        key_slots = torch.arange(W, device=input_ids.device)
        allowed = key_valid[:, None, None, :] & (key_slots[None, None, None, :] <= slots[None, None, :, None])
        # A finite minimum, not -inf: rows with nothing to attend to (padding) must not produce NaN.
        mask = torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)  # [B, 1, T, W]

        masks = attention_masks(mask, self.spec.num_heads // self.spec.num_kv_heads, self.lowering.causal_block)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, masks, slots, kv_cache)

        h = h[torch.arange(B, device=h.device), last_index]  # [B, hidden]
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return project(h, weight, None, self.lowering.for_lm_head(self.spec.tie_word_embeddings)).float()
