"""One static-shape decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

A single forward serves both graphs:

    forward(input_ids[B, T], position_ids[B, T], cache_start[1], key_valid[B, W], last_index[B], kv_cache)
        -> logits[B, V] (float32)

* context encoding: T = W = prompt bucket, cache_start = 0;
* token generation: T = 1, W = token-generation bucket, cache_start = the slot the token is written to.

The T new tokens are written at cache slots cache_start .. cache_start + T - 1 of the preallocated cache
`kv_cache[layers, 2 (k/v), B, kv_heads, S, head_dim]`, all layers with one in-place write after the last layer;
each layer's attention reads slots 0 .. W - 1 of its cache as they were before the step, and its new tokens'
K and V beside them (`window_attention`). Query t may see slot k when `key_valid[b, k]` and
`k <= cache_start + t` (causal). The layers' weights are stacked along a leading
layer axis and run as one loop (`torch._higher_order_ops.scan`), so the compiler sees one layer: compile time
and code size do not grow with the layer count. Only the hidden state at `last_index` goes through the final
norm and the LM head.

How projections and decode attention are computed is the backend's choice (`Lowering`): bfloat16 and float32
projections over a handful of rows (decode) as the custom op `rows_matvec` (ops.py), which the inductor backend
compiles to its own dot-product kernel; other projections over a handful of rows as multiply + sum, which Inductor fuses
into one streaming reduction over the weight with one accumulator per row; otherwise F.linear, or oneDNN's
linear, whose weights the runtime may reorder at load into oneDNN's blocked layout (`packed_rows`) - faster at a
few rows than both of the latter (docs/performance.md). Projection weights may be stored in tiles (`weight_tile`,
ops.py), which the dot kernel streams faster at decode and `tiled_linear` reads at prefill. Packed weights are
per-layer tensors that cannot be stacked: an export that packs keeps one `DecoderLayer` per layer and unrolls them
(`Lowering.stacked_layers`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.scan import scan

from .ops import (ROWS_MATVEC_DTYPES, decode_attention, onednn_linear, rows_matvec, tile_weight, tiled_linear,
                  weight_outputs)

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
        """Shape of the KV cache, every layer's in one tensor."""
        return (self.num_layers, 2, batch_size, self.num_kv_heads, sequence_length, self.head_dim)


@dataclass(frozen=True)
class Lowering:
    """How the decoder's projections and decode attention are computed; chosen by the backend for each export.

    dot_rows: bfloat16 or float32 projections over at most `dot_rows` rows are `rows_matvec` (ops.py), for which
        the backend compiles its own kernel (`uses_dot_kernel`), of any input width (but see dot_one_row_width):
        the kernel cuts wide input rows into pieces that stay in cache.
    dot_isa: the instruction set that kernel is compiled for (the backend's name, e.g. "avx512"; "" without it).
    dot_one_row_width: when > 0, a single row wider than this many inputs is not `rows_matvec` but the multiply +
        sum below (the backend measured that loop faster there; `uses_dot_kernel`).
    matvec_rows: other projections over at most this many rows are one multiply + sum per row (`project`).
    gemm_dtype: dtype the other projections compute in (None: the input's).
    onednn: the other projections go through oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`).
    packed_rows: when > 0 (with onednn), the projection weights (layers, untied LM head) that the dot kernel
        does not read at this many rows may be reordered at load into oneDNN's blocked layout for this many rows
        (`StaticDecoder.packable_weight_names`); the graphs then never read those as plain tensors.
    attention_tokens: attention for at most this many new tokens per sequence (decode) is multiply + sum
        reductions over the cache, which Inductor fuses (`reduced_attention`); longer queries use SDPA.
    attention_kernel: that decode attention is instead `decode_attention` (ops.py), for which the backend
        compiles its own kernel (variant `dot_isa`).
    causal_block: when > 0, context attention runs SDPA per block of this many query tokens, each against only
        the keys up to its last token (`attention_masks`): the blocks above the diagonal are never computed.
    weight_tile: when > 0, the projection weights (layers, untied LM head) whose outputs are a multiple of it are
        stored tiled, [N / T, K, T] (ops.py, `StaticDecoder.tiled_weight_names`): decode reads them through the dot
        kernel (which must then take every decode row: dot_rows at least the batch), prefill through
        `tiled_linear`.
    """

    dot_rows: int = 0
    dot_isa: str = ""
    dot_one_row_width: int = 0
    matvec_rows: int = 0
    gemm_dtype: torch.dtype | None = None
    onednn: bool = False
    packed_rows: int = 0
    attention_tokens: int = 0
    attention_kernel: bool = False
    causal_block: int = 0
    weight_tile: int = 0

    @property
    def stacked_layers(self) -> bool:
        """The layers' weights stacked along a layer axis and run as one loop; not when the layers' weights are
        packed (past the dot kernel's rows), which happens per layer: a packed weight cannot be stacked or sliced."""
        return self.packed_rows <= self.dot_rows

    def uses_dot_kernel(self, rows: int, dtype: torch.dtype, width: int = 0) -> bool:
        """Whether a projection of `rows` rows of `width` inputs (0: any) is `rows_matvec`."""
        if rows == 1 and 0 < self.dot_one_row_width < width:
            return False
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
        return {"dot_rows": self.dot_rows, "dot_isa": self.dot_isa, "dot_one_row_width": self.dot_one_row_width,
                "matvec_rows": self.matvec_rows,
                "gemm_dtype": str(self.gemm_dtype).removeprefix("torch."), "onednn": self.onednn,
                "packed_rows": self.packed_rows, "attention_tokens": self.attention_tokens,
                "attention_kernel": self.attention_kernel, "causal_block": self.causal_block,
                "weight_tile": self.weight_tile}

    def tiles(self, outputs: int) -> int:
        """The tile a projection weight of `outputs` outputs is stored in (0: plain)."""
        return self.weight_tile if self.weight_tile and outputs % self.weight_tile == 0 else 0


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
    if lowering.uses_dot_kernel(rows, x.dtype, x.shape[-1]) and weight.dtype == x.dtype:
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
            # add into oneDNN's binary linear, which costs ~12 us more per call (docs/performance.md).
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


def reduced_attention(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      scale: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for a few query rows (q [B, H, R, D]), as float32 multiply + sum, over
    the keys of every (keys, values, mask) in `parts` together (one softmax).

    Inductor fuses each product with its reduction and the softmax into a few loops over the cache; the CPU
    flash-attention kernel, tiled for long queries, costs up to 2x more at decode (docs/performance.md). The
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
            out.append(reduced_attention(args[0], [(*args[1:], mask)], scale))
        else:
            out.append(F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale))
        start += rows
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def window_attention(q: torch.Tensor, cache_kv: torch.Tensor, new_kv: torch.Tensor, cache_mask: torch.Tensor,
                     new_mask: torch.Tensor, scale: float, reduced: bool, kernel: bool = False) -> torch.Tensor:
    """Attention of folded queries q [B, kv_heads, T * n_rep, D] over a cache window and the T new tokens.

    cache_kv [2, B, kv_heads, W, D]: the window as the cache holds it, before this step's write; `cache_mask`
    [B, 1, T * n_rep, W] hides the slots the new tokens are about to fill. new_kv [2, B, kv_heads, T, D], under
    `new_mask` [B, 1, T * n_rep, T]. The two meet only in the softmax: the new K and V are never selected into a
    copy of the window, which Inductor did element by element inside the attention's loops (bf16 batch 4: the
    layer loop's decode step 6-8% slower than unrolled layers writing the cache first; now on par). `kernel`
    (with `reduced`): the same attention as the custom op `decode_attention`, which the backend compiles itself.
    """
    if reduced and kernel:
        query = _materialized((q.float() * scale).contiguous())
        dtype = cache_kv.dtype
        return decode_attention(query, cache_kv[0], cache_kv[1], cache_mask.to(dtype), new_kv[0], new_kv[1],
                                new_mask.to(dtype))
    if reduced:
        return reduced_attention(q, [(cache_kv[0], cache_kv[1], cache_mask), (new_kv[0], new_kv[1], new_mask)], scale)
    keys, values = (torch.cat((cached, new), dim=2) for cached, new in zip(cache_kv, new_kv))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=torch.cat((cache_mask, new_mask), dim=-1),
                                          scale=scale)


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


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A finite minimum, not -inf: rows with nothing to attend to (padding) must not produce NaN.
    return torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like Transformers, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Weights(nn.Module):
    """The parameters of one projection (weight [out, in], or with `tile` > 0 its tiles [out / tile, in, tile],
    ops.py; optional bias [out]) or norm (weight [size]), named as Transformers names them, each with the leading
    axes `lead` (the layer axis of stacked layers)."""

    def __init__(self, shape: tuple[int, ...], bias: bool = False, lead: tuple[int, ...] = (),
                 fill: float | None = None, tile: int = 0):
        super().__init__()
        self.tile = tile
        weight = torch.empty(*lead, *((shape[0] // tile, shape[1], tile) if tile else shape))
        self.weight = nn.Parameter(weight.fill_(fill) if fill is not None else nn.init.normal_(weight, std=0.02))
        self.bias = nn.Parameter(torch.zeros(*lead, shape[0])) if bias else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    """The weights of one decoder layer or, with `layers` > 0, of that many stacked along a leading axis (what
    `StaticDecoder` runs as one loop); `step` is one layer's math over one layer's weights."""

    def __init__(self, spec: DecoderSpec, lowering: Lowering, layers: int = 0):
        super().__init__()
        s, lead = spec, ((layers,) if layers else ())
        self.spec, self.lowering, self.stacked = spec, lowering, bool(layers)
        kv_width = s.num_kv_heads * s.head_dim
        qkv_width, tiles = s.num_heads * s.head_dim + 2 * kv_width, lowering.tiles
        self.input_norm = Weights((s.hidden_size,), lead=lead, fill=1.0)
        self.qkv_proj = Weights((qkv_width, s.hidden_size), s.qkv_bias, lead, tile=tiles(qkv_width))
        self.o_proj = Weights((s.hidden_size, s.num_heads * s.head_dim), s.o_bias, lead, tile=tiles(s.hidden_size))
        if s.qk_norm:
            self.q_norm = Weights((s.head_dim,), lead=lead, fill=1.0)
            self.k_norm = Weights((s.head_dim,), lead=lead, fill=1.0)
        self.post_attention_norm = Weights((s.hidden_size,), lead=lead, fill=1.0)
        self.gate_up_proj = Weights((2 * s.intermediate_size, s.hidden_size), s.mlp_bias, lead,
                                    tile=tiles(2 * s.intermediate_size))
        self.down_proj = Weights((s.hidden_size, s.intermediate_size), s.mlp_bias, lead, tile=tiles(s.hidden_size))

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def step(self, w: dict[str, torch.Tensor], h, cos, sin, masks, new_mask, kv_cache):
        """One layer over hidden states h [B, T, hidden] with weights `w` (names as `weights()`, one layer's):
        (h after the layer, the T new tokens' K and V [2, B, kv_heads, T, D]).

        `new_mask` None (a context graph): the T new tokens are the whole window, under `masks`. Otherwise
        attention reads slots 0 .. W - 1 of `kv_cache` [2, B, kv_heads, S, D], the layer's cache before this step,
        under `masks` ([one piece], which hides the slots the new tokens go to), and the new tokens under
        `new_mask` (`window_attention`). The caller writes the new K and V, for every layer at once: the layers
        only read the cache, which lets them run as one loop.
        """
        s, lowering = self.spec, self.lowering
        B, T, _ = h.shape
        n_rep = s.num_heads // s.num_kv_heads

        def proj(x, name):
            return project(x, w[f"{name}.weight"], w.get(f"{name}.bias"), lowering, constant_weight=not self.stacked)

        qkv = proj(rms_norm(h, w["input_norm.weight"], s.rms_norm_eps), "qkv_proj")
        q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], -1)
        q = q.view(B, T, s.num_heads, s.head_dim)
        k = k.view(B, T, s.num_kv_heads, s.head_dim)
        v = v.view(B, T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = rms_norm(q, w["q_norm.weight"], s.rms_norm_eps), rms_norm(k, w["k_norm.weight"], s.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        new_kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4).to(kv_cache.dtype)  # [2, B, kv_heads, T, D]

        # GQA without repeating K/V: fold the query heads of one KV group into the query axis, token-major.
        q = q.view(B, T, s.num_kv_heads, n_rep, s.head_dim).transpose(1, 2).reshape(B, s.num_kv_heads, T * n_rep,
                                                                                     s.head_dim)
        scale, reduced = s.head_dim**-0.5, T <= lowering.attention_tokens
        if new_mask is None:
            attn = attention(q, new_kv[0], new_kv[1], masks, scale, reduced)
        else:
            window = kv_cache[:, :, :, :masks[0].shape[-1]]
            attn = window_attention(q, window, new_kv, masks[0], new_mask, scale, reduced, lowering.attention_kernel)
        attn = attn.view(B, s.num_kv_heads, T, n_rep, s.head_dim).transpose(1, 2)
        h = h + proj(attn.reshape(B, T, s.num_heads * s.head_dim), "o_proj")

        gate, up = proj(rms_norm(h, w["post_attention_norm.weight"], s.rms_norm_eps), "gate_up_proj").chunk(2, dim=-1)
        return h + proj(_ACTIVATIONS[s.hidden_act](gate) * up, "down_proj"), new_kv


class StaticDecoder(nn.Module):
    """Inference only: parameters never require grad (a layer loop cannot be exported through autograd)."""

    def __init__(self, spec: DecoderSpec, lowering: Lowering = Lowering()):
        super().__init__()
        self.spec = spec
        self.lowering = lowering
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        layers = lowering.for_layers()
        if lowering.stacked_layers:
            self.layers = DecoderLayer(spec, layers, layers=spec.num_layers)
        else:
            self.layers = nn.ModuleList(DecoderLayer(spec, layers) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings:
            self.lm_head = Weights((spec.vocab_size, spec.hidden_size), tile=lowering.tiles(spec.vocab_size))
        # Explicit device: the decoder is built on the meta device at export and only this buffer is real.
        self.register_buffer("rope_inv_freq", torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device="cpu"))
        self.requires_grad_(False)

    def parameter_names(self) -> list[str]:
        """Names filled from the checkpoint (the RoPE buffer is derived from the config)."""
        return [name for name, _ in self.named_parameters()]

    def tiled_weight_names(self) -> list[str]:
        """The parameters stored tiled (`Lowering.weight_tile`): what `arrange_weights` tiles."""
        return [f"{name}.weight" for name, module in self.named_modules()
                if isinstance(module, Weights) and module.tile]

    def arrange_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain checkpoint weights (names as `parameter_names`) in this decoder's layout: tiled where it tiles."""
        tiled = set(self.tiled_weight_names())
        return {name: tile_weight(w, self.lowering.weight_tile) if name in tiled else w for name, w in weights.items()}

    def packable_weight_names(self) -> list[str]:
        """Weights read only by oneDNN's linear, which the runtime may reorder for it (`Lowering.packed_rows`).

        None when the dot kernel runs the token graphs' rows (`packed_rows`, the batch): it reads them plain.
        """
        rows, dtype = self.lowering.packed_rows, self.embed_tokens.weight.dtype
        if not rows or self.lowering.uses_dot_kernel(rows, dtype) or self.lowering.stacked_layers:
            return []  # (stacked layers are never packed)
        names = [f"layers.{i}.{name}.weight" for i in range(self.spec.num_layers)
                 for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        return names if self.spec.tie_word_embeddings else [*names, "lm_head.weight"]

    def forward(self, input_ids, position_ids, cache_start, key_valid, last_index, kv_cache):
        B, T = input_ids.shape
        W = key_valid.shape[1]
        dtype = self.embed_tokens.weight.dtype
        h = self.embed_tokens(input_ids)

        freqs = position_ids[..., None].float() * self.rope_inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.spec.rope_attention_scaling).to(dtype)[:, :, None, :]
        sin = (emb.sin() * self.spec.rope_attention_scaling).to(dtype)[:, :, None, :]

        slots = cache_start + torch.arange(T, device=input_ids.device)  # [T]
        n_rep = self.spec.num_heads // self.spec.num_kv_heads
        if T == W:  # a context graph: the window is its tokens, from slot 0
            key_slots = torch.arange(W, device=input_ids.device)
            allowed = key_valid[:, None, None, :] & (key_slots[None, None, None, :] <= slots[None, None, :, None])
            masks, new_mask = attention_masks(_additive(allowed, dtype), n_rep, self.lowering.causal_block), None
        else:
            # The cache's slots from cache_start on hold stale K/V until the write after the layers: the new tokens
            # are attended to from new_kv instead, causally among themselves.
            cached = key_valid & (torch.arange(W, device=input_ids.device) < cache_start)  # [B, W]
            masks = attention_masks(_additive(cached[:, None, None, :].expand(B, 1, T, W), dtype), n_rep)
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
            fresh = key_valid.index_select(1, slots)[:, None, None, :] & causal  # [B, 1, T, T]
            new_mask = attention_masks(_additive(fresh, dtype), n_rep)[0]

        if isinstance(self.layers, DecoderLayer):
            # One loop over the stacked layers: the compiler traces, lowers and compiles one layer, not
            # num_layers copies of it (SmolLM2's token graph: 1 MB of C++ and ~60 s less to compile).
            layer = self.layers

            def body(h, xs):
                weights, layer_cache = xs
                return layer.step(weights, h, cos, sin, masks, new_mask, layer_cache)

            h, new_kv = scan(body, h, (layer.weights(), kv_cache))
        else:  # weights packed per layer (oneDNN's blocked layout) cannot be stacked: the layers unrolled
            new_kv = []
            for i, layer in enumerate(self.layers):
                h, layer_kv = layer.step(layer.weights(), h, cos, sin, masks, new_mask, kv_cache[i])
                new_kv.append(layer_kv)
            new_kv = torch.stack(new_kv)

        # ONE index_put_ on the whole cache writes every layer's K and V in place; writing through views would
        # make AOTInductor copy the whole cache every layer.
        L, dev = kv_cache.shape[0], kv_cache.device
        index = (
            torch.arange(L, device=dev).view(L, 1, 1, 1, 1),
            torch.arange(2, device=dev).view(1, 2, 1, 1, 1),
            torch.arange(B, device=dev).view(1, 1, B, 1, 1),
            torch.arange(self.spec.num_kv_heads, device=dev).view(1, 1, 1, self.spec.num_kv_heads, 1),
            slots.view(1, 1, 1, 1, T),
        )
        kv_cache.index_put_(index, new_kv)

        h = h[torch.arange(B, device=h.device), last_index]  # [B, hidden]
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return project(h, weight, None, self.lowering.for_lm_head(self.spec.tie_word_embeddings)).float()
