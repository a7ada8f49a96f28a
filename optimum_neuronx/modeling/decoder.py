"""One static-shape decoder for every supported family (DecoderSpec holds what they differ on), in plain PyTorch.

A single forward serves both graphs:

    forward(input_ids[B, T], position_ids[B, T], cache_start[B], key_valid[B, W], last_index[B], kv_cache,
            seq_ids[B]) -> logits[B, V] (float32)
    (with on-device sampling, a last input sampling[B, 4] and the picked tokens [B] returned after the logits)

* context encoding: T = W = prompt bucket, cache_start = 0;
* token generation: T = 1, W = token-generation bucket, cache_start = the slot each row's token is written to;
* verification (speculative decoding): T = drafted tokens + 1 over a token bucket, last_index [B, T]: logits
  [B, T, V] at every new token;
* prefill (continuous batching): B = 1 row of the cache, the row `seq_ids` names, T = a chunk of its prompt
  written from slot cache_start (> 0: a later chunk, attending to what the row holds), W = the whole cache;
* fused (continuous batching): input_ids [1, B + C] holds one token for each of the cache's B rows, then a chunk of
  C for the row seq_ids[B]; the other inputs have B + 1 rows (the rows', then the chunk's), logits [B + 1, V]. Both
  are projected together (the weights read once) and attend apart.

Row b's T new tokens are written at cache slots cache_start[b] .. cache_start[b] + T - 1 of the preallocated cache
`kv_cache[layers, 2 (k/v), B, kv_heads, S, head_dim]`, all layers with one in-place write after the last layer;
each layer's attention reads slots 0 .. W - 1 of its cache as they were before the step, and its new tokens'
K and V beside them (sliding layers may keep only their window, `DecoderSpec.cache_places`: a ring, slot s at s
mod the window). Query t may see slot k when `key_valid[b, k]` and `k <= cache_start + t` (causal). The
layers' weights are stacked along a leading layer axis and run as one loop (`torch._higher_order_ops.scan`), so a
compiler sees one layer. Only the hidden state at `last_index` goes through the final norm and the LM head.

How projections, attention and the cache write are computed are the extension points of `Kernels`; a backend
passes its own subclass (backends/inductor/lowering.py), and every other backend gets plain PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.scan import scan

from .attention import (AttentionPlan, CacheLayout, RowGroup, attention, attention_plan, cache_layout, group_tokens,
                        joined_rows, write_new_kv)
from .layout import tile_weight
from .sampling import SAMPLING_FIELDS, sample_tokens

_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # gpt2's name for the same tanh approximation
}
NORMS = ("rms", "layer", "gemma")  # RMSNorm; LayerNorm with a bias; RMSNorm scaled by 1 + weight, in float32
POSITIONS = ("rope", "learned")  # rotary; a learned table added to the token embeddings
MLPS = ("gated", "plain", "moe")  # act(gate) * up -> down; act(up) -> down; a mixture of gated experts


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
    # LongRoPE (phi3): these frequencies replace rope_inv_freq in a call whose largest position reaches past
    # `rope_long_after` (the pretraining length), as Transformers switches them.
    rope_long_inv_freq: tuple[float, ...] = ()
    rope_long_after: int = 0
    # Scalar multipliers (granite): the embeddings, each residual branch and the attention scores are multiplied,
    # the logits divided; None: the attention scale is head_dim ** -0.5.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Layers that use no position encoding (smollm3's NoPE layers): their queries and keys are not rotated.
    nope_layers: tuple[int, ...] = ()
    # Layers rotated with other frequencies (gemma3's local, sliding-window layers) and those frequencies' scaling.
    rope_local_layers: tuple[int, ...] = ()
    rope_local_inv_freq: tuple[float, ...] = ()
    rope_local_attention_scaling: float = 1.0
    # Norms around each branch's output too (gemma3): attention output and MLP output normalized before the residual.
    sandwich_norms: bool = False
    # Final logits soft-capped: cap * tanh(logits / cap) (0: not).
    final_logit_softcapping: float = 0.0
    # Sliding-window attention: the layers in `sliding_layers` attend only to keys fewer than `sliding_window`
    # positions before the query (0: no window).
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # Where each layer's K/V live in the cache tensor, (row, first slot, slots) per layer, where sliding layers keep
    # only their window (`window_cache_places`): slot s of such a layer at first slot + s mod sliding_window (a
    # ring). (): one row per layer holding every slot.
    cache_places: tuple[tuple[int, int, int], ...] = ()
    # The block's kinds (NORMS, POSITIONS, MLPS); `max_positions`: the learned position table's size.
    norm: str = "rms"
    positions: str = "rope"
    max_positions: int = 0
    mlp: str = "gated"
    # Mixture of experts (mlp "moe"): `num_experts` gated MLPs of intermediate_size, each token routed to the top
    # `experts_per_token` by a softmax router, their weights renormalized to sum to 1 where `normalize_expert_weights`.
    num_experts: int = 0
    experts_per_token: int = 0
    normalize_expert_weights: bool = True

    def kv_cache_shape(self, batch_size: int, sequence_length: int) -> tuple[int, ...]:
        """Shape of the KV cache, every layer's in one tensor (packed as `cache_places` says, if it says)."""
        rows, slots = self.num_layers, sequence_length
        if self.cache_places:
            rows, slots = 1 + max(row for row, _, _ in self.cache_places), max(n for _, _, n in self.cache_places)
        return (rows, 2, batch_size, self.num_kv_heads, slots, self.head_dim)


def window_cache_places(num_layers: int, sliding_layers: tuple[int, ...], window: int,
                        sequence_length: int) -> tuple[tuple[int, int, int], ...]:
    """`DecoderSpec.cache_places` for layers sliding a window shorter than the sequence, where that saves memory.

    Every layer sliding: one ring of `window` slots per layer. Some: the full layers one row of every slot each, and
    the sliding layers' rings side by side in rows of the same length (sequence_length // window rings a row), which
    must then take fewer rows than one per layer. () where nothing is saved.
    """
    if not sliding_layers or window >= sequence_length:
        return ()
    if len(sliding_layers) == num_layers:
        return tuple((layer, 0, window) for layer in range(num_layers))
    per_row = sequence_length // window
    full = [layer for layer in range(num_layers) if layer not in sliding_layers]
    if len(full) + -(-len(sliding_layers) // per_row) >= num_layers:
        return ()
    places = {layer: (row, 0, sequence_length) for row, layer in enumerate(full)}
    for n, layer in enumerate(sorted(sliding_layers)):
        places[layer] = (len(full) + n // per_row, (n % per_row) * window, window)
    return tuple(places[layer] for layer in range(num_layers))


class Kernels:
    """The decoder's extension points: how a projection, attention and the cache write are computed.

    This base class is plain PyTorch (F.linear, SDPA, index_put_), which every backend can lower. A backend that
    brings kernels of its own subclasses it; the decoder calls nothing else of the backend.
    """

    # > 0: context attention runs per block of this many query tokens, each against the keys up to its last token
    # only, so the blocks above the diagonal are never computed (`attention_masks`).
    causal_block: int = 0
    # The layers' weights stacked along a layer axis; False: one module per layer, unrolled.
    stacked_layers: bool = True
    # Stacked layers run as one `scan` loop (a compiler sees one layer); False: unrolled over the stacked weights'
    # slices, for compilers that cannot lower `scan` (torch-mlir).
    scan_layers: bool = True
    # Devices the graphs are cut across (tensor parallelism): the fused projections' outputs are stored shard-major
    # (modeling/sharding.py) and split per shard, so that each shard holds whole heads and whole MLP columns.
    shards: int = 1

    def scans(self, spec: "DecoderSpec") -> bool:
        """Whether the stacked layers of the decoder `spec` describes run as one `scan` loop (`scan_layers`)."""
        return self.scan_layers

    def weight_tile_for(self, outputs: int) -> int:
        """The tile a projection weight of `outputs` outputs is stored in (modeling/layout.py); 0: plain."""
        return 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stacked: bool,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's projection; `stacked`: `weight` is one layer's slice of stacked weights. With `scale`, `weight`
        is int8 with a float32 scale per output (modeling/quantization.py): widened inside the product."""
        if scale is not None:
            out = (F.linear(x, weight.to(x.dtype)).float() * scale).to(x.dtype)
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    def lm_head(self, h: torch.Tensor, weight: torch.Tensor, tied: bool) -> torch.Tensor:
        """The LM head over the final hidden states; `tied`: `weight` is the embedding table."""
        return F.linear(h, weight)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  scale: float, tokens: int) -> torch.Tensor:
        """Attention of folded queries q [B, KV, R, D] over keys/values [B, KV, W, D] under an additive mask
        [B, 1, R, W] (one block of `attention_masks`); `tokens` new tokens per sequence."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

    def window_attention(self, q: torch.Tensor, cache_kv: torch.Tensor, new_kv: torch.Tensor,
                         cache_mask: torch.Tensor, new_mask: torch.Tensor, scale: float, tokens: int) -> torch.Tensor:
        """Attention of folded queries q [B, KV, T * n_rep, D] over a cache window and the T new tokens, one softmax.

        cache_kv [2, B, KV, W, D] is the window as the cache holds it before this step's write, under `cache_mask`
        [B, 1, T * n_rep, W] (which hides the slots the new tokens go to); new_kv [2, B, KV, T, D] under `new_mask`
        [B, 1, T * n_rep, T].
        """
        # Indexed, not iterated: iterating a tensor traces to squeeze ops some lowerings (torch-mlir) lack.
        keys = torch.cat((cache_kv[0], new_kv[0]), dim=2)
        values = torch.cat((cache_kv[1], new_kv[1]), dim=2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=torch.cat((cache_mask, new_mask), dim=-1),
                                              scale=scale)

    def write_cache(self, kv_cache: torch.Tensor, index: tuple[torch.Tensor, ...], new_kv: torch.Tensor) -> None:
        """Write every layer's new K and V into `kv_cache` in place (one `index_put_` on the whole cache)."""
        kv_cache.index_put_(index, new_kv)

    def describe(self) -> dict:
        """The choices that change the compiled graphs (stamped into every export)."""
        return {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like Transformers, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float) -> torch.Tensor:
    """The block's norm (`DecoderSpec.norm`): RMSNorm, or LayerNorm with its bias (in float32, rounded once to the
    model dtype, as PyTorch's CPU kernel computes a half-precision nn.LayerNorm; compilers that lower it op by op
    would otherwise take the mean and variance in half precision)."""
    if kind == "layer":
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)
    if kind == "gemma":
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    return rms_norm(x, weight, eps)


class Norm(nn.Module):
    def __init__(self, size: int, eps: float, kind: str = "rms"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if kind == "layer" else None
        self.eps, self.kind = eps, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.weight, self.bias, self.kind, self.eps)


class Weights(nn.Module):
    """The parameters of one projection (weight [out, in], or with `tile` > 0 its tiles [out / tile, in, tile],
    layout.py; optional bias [out]) or norm (weight [size]), named as Transformers names them, each with the leading
    axes `lead` (the layer axis of stacked layers)."""

    def __init__(self, shape: tuple[int, ...], bias: bool = False, lead: tuple[int, ...] = (),
                 fill: float | None = None, tile: int = 0, quantized: bool = False):
        super().__init__()
        self.tile = 0 if quantized else tile
        if quantized:  # int8 [out, in] and a float32 scale per output (modeling/quantization.py)
            self.weight = nn.Parameter(torch.zeros(*lead, *shape, dtype=torch.int8), requires_grad=False)
            self.scale = nn.Parameter(torch.ones(*lead, shape[0]), requires_grad=False)
        else:
            weight = torch.empty(*lead, *((shape[0] // tile, shape[1], tile) if tile else shape))
            self.weight = nn.Parameter(weight.fill_(fill) if fill is not None else nn.init.normal_(weight, std=0.02))
        self.bias = nn.Parameter(torch.zeros(*lead, shape[0])) if bias else None


def _rotation(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """RoPE's cos and sin [B, T, 1, D] at `position_ids` for `inv_freq`."""
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * scaling).to(dtype)[:, :, None, :], (emb.sin() * scaling).to(dtype)[:, :, None, :])


def _residual(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    """The weights of one decoder layer or, with `layers` > 0, of that many stacked along a leading axis (what
    `StaticDecoder` runs as one loop); `step` is one layer's math over one layer's weights."""

    def __init__(self, spec: DecoderSpec, kernels: Kernels, layers: int = 0, quantized: bool = False):
        super().__init__()
        s, lead = spec, ((layers,) if layers else ())
        self.spec, self.kernels, self.stacked = spec, kernels, bool(layers)
        kv_width = s.num_kv_heads * s.head_dim
        qkv_width = s.num_heads * s.head_dim + 2 * kv_width

        def projection(outputs: int, inputs: int, bias: bool) -> Weights:  # quantized where the export is
            return Weights((outputs, inputs), bias, lead, tile=kernels.weight_tile_for(outputs), quantized=quantized)

        norm_bias = s.norm == "layer"
        self.input_norm = Weights((s.hidden_size,), norm_bias, lead=lead, fill=1.0)
        self.qkv_proj = projection(qkv_width, s.hidden_size, s.qkv_bias)
        self.o_proj = projection(s.hidden_size, s.num_heads * s.head_dim, s.o_bias)
        if s.qk_norm:
            self.q_norm = Weights((s.head_dim,), lead=lead, fill=1.0)
            self.k_norm = Weights((s.head_dim,), lead=lead, fill=1.0)
        self.post_attention_norm = Weights((s.hidden_size,), norm_bias, lead=lead, fill=1.0)
        if s.sandwich_norms:
            self.attn_out_norm = Weights((s.hidden_size,), norm_bias, lead=lead, fill=1.0)
            self.mlp_out_norm = Weights((s.hidden_size,), norm_bias, lead=lead, fill=1.0)
        if s.mlp == "moe":  # every expert stored once, stacked: [experts, out, in]
            self.router = Weights((s.num_experts, s.hidden_size), lead=lead)
            self.experts_gate_up = Weights((s.num_experts, 2 * s.intermediate_size, s.hidden_size), lead=lead)
            self.experts_down = Weights((s.num_experts, s.hidden_size, s.intermediate_size), lead=lead)
        elif s.mlp == "gated":
            self.gate_up_proj = projection(2 * s.intermediate_size, s.hidden_size, s.mlp_bias)
        else:
            self.up_proj = projection(s.intermediate_size, s.hidden_size, s.mlp_bias)
        if s.mlp != "moe":
            self.down_proj = projection(s.hidden_size, s.intermediate_size, s.mlp_bias)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def step(self, w: dict[str, torch.Tensor], h, cos, sin, groups):
        """One layer over hidden states h with weights `w` (names as `weights()`, one layer's): (h after the layer,
        the new tokens' K and V [2, B, kv_heads, T, D] for h [B, T, hidden]).

        `groups`: the attention inputs of each group of rows, (rows, tokens, masks, new_mask, layer_cache), in h's
        token order: one group with h [rows, tokens, hidden], or a fused graph's two with h [1, all their tokens,
        hidden] (each group's tokens row after row), attending apart but projected together. `new_mask` None (a
        context graph): the new tokens are the whole window, under `masks`. Otherwise attention reads slots
        0 .. W - 1 of `layer_cache` [2, rows, kv_heads, S, D], the layer's cache before this step, under `masks`
        ([one piece], which hides the slots the new tokens go to), and the new tokens under `new_mask`
        (`Kernels.window_attention`). The caller writes the new K and V, for every layer at once: the layers only
        read the cache, which lets them run as one loop.
        """
        s, kernels = self.spec, self.kernels
        B, T, _ = h.shape
        n_rep = s.num_heads // s.num_kv_heads

        def proj(x, name):
            return kernels.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"), self.stacked, w.get(f"{name}.scale"))

        def block_norm(x, name):
            return norm(x, w[f"{name}.weight"], w.get(f"{name}.bias"), s.norm, s.rms_norm_eps)

        shards = kernels.shards
        qkv = proj(block_norm(h, "input_norm"), "qkv_proj").view(B, T, shards, -1)
        q, k, v = qkv.split([s.num_heads * s.head_dim // shards, s.num_kv_heads * s.head_dim // shards,
                             s.num_kv_heads * s.head_dim // shards], -1)
        q = q.reshape(B, T, s.num_heads, s.head_dim)
        k = k.reshape(B, T, s.num_kv_heads, s.head_dim)
        v = v.reshape(B, T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = block_norm(q, "q_norm"), block_norm(k, "k_norm")
        if cos is not None:  # rotary positions (learned ones were added to the embeddings)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        new_kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4).to(groups[0][4].dtype)  # [2, B, kv_heads, T, D]

        scale = s.head_dim**-0.5 if s.attention_multiplier is None else s.attention_multiplier
        outs, offset = [], 0
        for rows, tokens, masks, new_mask, layer_cache in groups:
            group_q, group_kv = q, new_kv
            if len(groups) > 1:
                group_q = q[:, offset:offset + rows * tokens].reshape(rows, tokens, s.num_heads, s.head_dim)
                group_kv = group_tokens(new_kv, offset, rows, tokens)
            offset += rows * tokens
            # GQA without repeating K/V: fold the query heads of one KV group into the query axis, token-major.
            group_q = group_q.view(rows, tokens, s.num_kv_heads, n_rep, s.head_dim).transpose(1, 2).reshape(
                rows, s.num_kv_heads, tokens * n_rep, s.head_dim)
            if new_mask is None:
                attn = attention(kernels, group_q, group_kv[0], group_kv[1], masks, scale, tokens)
            else:
                window = layer_cache[:, :, :, :masks[0].shape[-1]]
                attn = kernels.window_attention(group_q, window, group_kv, masks[0], new_mask, scale, tokens)
            outs.append(attn.view(rows, s.num_kv_heads, tokens, n_rep, s.head_dim).transpose(1, 2)
                        .reshape(B, rows * tokens // B, s.num_heads * s.head_dim))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        h = h + _residual(self._branch_out(proj(attn, "o_proj"), w,
                                           "attn_out_norm"), s.residual_multiplier)

        x = block_norm(h, "post_attention_norm")
        if s.mlp == "moe":
            out = mixture_of_experts(x, w, s, shards)
        elif s.mlp == "plain":
            out = proj(_ACTIVATIONS[s.hidden_act](proj(x, "up_proj")), "down_proj")
        else:
            gate, up = split_gate_up(proj(x, "gate_up_proj"), shards)
            out = proj(_ACTIVATIONS[s.hidden_act](gate) * up, "down_proj")
        return h + _residual(self._branch_out(out, w, "mlp_out_norm"), s.residual_multiplier), new_kv

    def _branch_out(self, x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """A branch's output, normalized where the block has sandwich norms (gemma3)."""
        s = self.spec
        return norm(x, w[f"{name}.weight"], w.get(f"{name}.bias"), s.norm, s.rms_norm_eps) if s.sandwich_norms else x


def split_gate_up(gate_up: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up of a fused projection's outputs [..., 2 I], stored shard-major over `shards` devices (each shard's
    gate slice, then its up slice: modeling/sharding.py)."""
    if shards == 1:
        return gate_up.chunk(2, dim=-1)
    parts = gate_up.unflatten(-1, (shards, 2, -1))
    return parts[..., 0, :].flatten(-2), parts[..., 1, :].flatten(-2)


def mixture_of_experts(x: torch.Tensor, w: dict[str, torch.Tensor], s: DecoderSpec, shards: int = 1) -> torch.Tensor:
    """Top-k routed gated experts with static shapes, so no shape depends on the routing. Where the graph's tokens
    pick fewer experts than there are (decode), each token's top k experts' weights are gathered and run: a step
    reads k experts per token, not all. Otherwise (prompts) every expert runs on every token and the router's
    weights (zero outside a token's top k) mix their outputs."""
    probs = F.softmax(F.linear(x, w["router.weight"]).float(), dim=-1)  # [B, T, E]
    top, index = probs.topk(s.experts_per_token, dim=-1)
    if s.normalize_expert_weights:
        top = top / top.sum(-1, keepdim=True)
    B, T, k = index.shape
    if B * T * k < s.num_experts:
        gate_up = w["experts_gate_up.weight"].index_select(0, index.flatten())  # [B * T * k, 2 I, H]
        gate, up = split_gate_up(torch.einsum(
            "nh,noh->no", x.reshape(B * T, 1, -1).expand(B * T, k, -1).reshape(B * T * k, -1), gate_up), shards)
        down = w["experts_down.weight"].index_select(0, index.flatten())  # [B * T * k, H, I]
        out = torch.einsum("ni,nhi->nh", _ACTIVATIONS[s.hidden_act](gate) * up, down).view(B, T, k, -1)
        return (out.float() * top[..., None]).sum(2).to(x.dtype)
    experts = torch.arange(s.num_experts, device=x.device)
    mix = ((index[..., None] == experts).to(top.dtype) * top[..., None]).sum(-2)  # [B, T, E], k non-zeros a row
    gate, up = split_gate_up(torch.einsum("bth,eoh->bteo", x, w["experts_gate_up.weight"]), shards)
    out = torch.einsum("btei,ehi->bteh", _ACTIVATIONS[s.hidden_act](gate) * up, w["experts_down.weight"])
    return (out.float() * mix[..., None]).sum(2).to(x.dtype)


class StaticDecoder(nn.Module):
    """Inference only: parameters never require grad (a layer loop cannot be exported through autograd)."""

    def __init__(self, spec: DecoderSpec, kernels: Kernels | None = None, quantization: str | None = None):
        super().__init__()
        self.spec, self.quantization = spec, quantization
        self.kernels = kernels = Kernels() if kernels is None else kernels
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        quantized = quantization is not None  # the layers' projections int8 (modeling/quantization.py)
        if kernels.stacked_layers:
            self.layers = DecoderLayer(spec, kernels, layers=spec.num_layers, quantized=quantized)
        else:
            self.layers = nn.ModuleList(DecoderLayer(spec, kernels, quantized=quantized)
                                        for _ in range(spec.num_layers))
        if spec.positions == "learned":
            self.embed_positions = nn.Embedding(spec.max_positions, spec.hidden_size)
        self.norm = Norm(spec.hidden_size, spec.rms_norm_eps, spec.norm)
        if not spec.tie_word_embeddings:
            self.lm_head = Weights((spec.vocab_size, spec.hidden_size), tile=kernels.weight_tile_for(spec.vocab_size))
        # Explicit device: the decoder is built on the meta device at export and only this buffer is real.
        self.register_buffer("rope_inv_freq", torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device="cpu"))
        if spec.rope_long_inv_freq:
            self.register_buffer("rope_long_inv_freq", torch.tensor(spec.rope_long_inv_freq, dtype=torch.float32,
                                                                    device="cpu"))
        if spec.rope_local_inv_freq:
            self.register_buffer("rope_local_inv_freq", torch.tensor(spec.rope_local_inv_freq, dtype=torch.float32,
                                                                     device="cpu"))
        if self._mixed_windows:  # 1 where a layer attends through the sliding window, 0 where to every key
            sliding = [1.0 if i in spec.sliding_layers else 0.0 for i in range(spec.num_layers)]
            self.register_buffer("sliding_layer_flags", torch.tensor(sliding, dtype=torch.float32, device="cpu"))
        self.requires_grad_(False)

    @property
    def _mixed_windows(self) -> bool:
        """Some layers slide their window and others do not: each layer picks its masks in the loop."""
        return bool(self.spec.sliding_window) and 0 < len(self.spec.sliding_layers) < self.spec.num_layers

    def parameter_names(self) -> list[str]:
        """Names filled from the checkpoint (the RoPE buffer is derived from the config, quantization scales from
        the weights)."""
        return [name for name, _ in self.named_parameters() if not name.endswith(".scale")]

    def tiled_weights(self) -> dict[str, int]:
        """The parameters stored tiled (`Kernels.weight_tile_for`), with their tile: what `arrange_weights` tiles."""
        return {f"{name}.weight": module.tile for name, module in self.named_modules()
                if isinstance(module, Weights) and module.tile}

    def arrange_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain checkpoint weights (names as `parameter_names`) in this decoder's layout: tiled where it tiles."""
        tiled = self.tiled_weights()
        return {name: tile_weight(w, tiled[name]) if name in tiled else w for name, w in weights.items()}

    # forward's inputs, in order: every graph takes them so. seq_ids [B]: the cache rows a row-targeted graph (fewer
    # rows than the cache) serves; in a full-batch graph, rows of one static batch share an id (LongRoPE picks its
    # frequencies per batch, as Transformers does), slots have their own. (on-device sampling graphs take "sampling"
    # too: modeling/sampling.py)
    INPUT_NAMES = ("input_ids", "position_ids", "cache_start", "key_valid", "last_index", "kv_cache", "seq_ids",
                   "sampling")

    @staticmethod
    def example_inputs(batch_size: int, tokens: int, window: int, kv_cache: torch.Tensor,
                       logits_positions: int = 1, sampling: bool = False) -> tuple:
        """Inputs of the graph for `tokens` new tokens of `batch_size` sequences over a `window` of the cache
        (INPUT_NAMES); `logits_positions` > 1: last_index [B, positions], logits at each (a verification graph);
        `sampling`: the graph picks each row's next token too (on-device sampling)."""
        last_index = torch.zeros(batch_size, *((logits_positions,) if logits_positions > 1 else ()), dtype=torch.long)
        inputs = (
            torch.zeros(batch_size, tokens, dtype=torch.long),  # input_ids
            torch.zeros(batch_size, tokens, dtype=torch.long),  # position_ids
            torch.zeros(batch_size, dtype=torch.long),  # cache_start
            torch.ones(batch_size, window, dtype=torch.bool),  # key_valid
            last_index,
            kv_cache,
            torch.zeros(batch_size, dtype=torch.long),  # seq_ids
        )
        return (*inputs, torch.zeros(batch_size, len(SAMPLING_FIELDS))) if sampling else inputs

    @classmethod
    def graph_inputs(cls, graph, batch_size: int, kv_cache: torch.Tensor, on_device_sampling: bool) -> tuple:
        """`example_inputs` of the graph a configuration.GraphSpec describes, in an export of `batch_size` rows that
        samples on the device or not."""
        if graph.kind == "fused":  # one row of batch_size tokens and the chunk; the rest per row and for the chunk
            rows = batch_size + 1
            inputs = cls.example_inputs(rows, 1, graph.window, kv_cache, sampling=graph.samples(on_device_sampling))
            flat = torch.zeros(1, batch_size + graph.tokens, dtype=torch.long)
            return (flat, flat.clone(), *inputs[2:])
        return cls.example_inputs(graph.rows(batch_size), graph.tokens, graph.window, kv_cache,
                                  graph.logits_positions, graph.samples(on_device_sampling))

    def forward(self, input_ids, position_ids, cache_start, key_valid, last_index, kv_cache, seq_ids=None,
                sampling=None):
        rows, width = input_ids.shape
        if rows == 1 and cache_start.shape[0] > 1:
            # A fused graph: one new token for each of the cache's B rows (their write slots cache_start[:B]), then
            # a chunk of width - B tokens for the row seq_ids[B] from cache_start[B]. Their K and V are written in
            # that order: the chunk's write wins where the row's own token slot lies in it.
            B = cache_start.shape[0] - 1
            groups = [RowGroup(B, 1, position_ids[:, :B].reshape(B, 1), cache_start[:B], key_valid[:B], last_index[:B],
                            seq_ids[:B], targeted=False),
                      RowGroup(1, width - B, position_ids[:, B:], cache_start[B:], key_valid[B:], last_index[B:],
                            seq_ids[B:], targeted=True)]
        else:
            if cache_start.shape[0] != rows:  # one start for every row (eager callers)
                cache_start = cache_start.expand(rows)
            # Fewer rows than the cache holds: a row-targeted graph, its rows the cache rows `seq_ids` (read as a
            # copy, written in place); otherwise row b is cache row b and seq_ids is not read.
            targeted = rows != kv_cache.shape[2]
            if targeted and seq_ids is None:
                raise ValueError(f"{rows} rows for a cache of {kv_cache.shape[2]}: pass seq_ids, the cache rows they "
                                 f"are")
            groups = [RowGroup(rows, width, position_ids, cache_start, key_valid, last_index, seq_ids, targeted)]
        dtype = self.embed_tokens.weight.dtype
        h = _residual(self.embed_tokens(input_ids), self.spec.embedding_multiplier)
        cos = sin = None
        if self.spec.positions == "learned":  # padding slots' positions may be anything: clamped into the table
            h = h + self.embed_positions(position_ids.clamp(0, self.spec.max_positions - 1))
        else:
            rotations = [self._rotations(group, dtype) for group in groups]
            cos, sin = rotations[0] if len(groups) == 1 else (joined_rows([r[0] for r in rotations]),
                                                              joined_rows([r[1] for r in rotations]))
        layout = cache_layout(self.spec, kv_cache)
        plans = [attention_plan(self.spec, self.kernels, group, kv_cache, layout, dtype) for group in groups]
        h, new_kv = self._layers(h, cos, sin, plans, layout)
        offset = 0
        for group in groups:  # in order: the chunk's write after the rows' own
            write_new_kv(self.spec, self.kernels, kv_cache, new_kv, group, layout, offset if len(groups) > 1 else None)
            offset += group.rows * group.tokens

        if len(groups) > 1:  # each row's token, then the chunk's last
            h = h[0, torch.cat((torch.arange(B, device=h.device), B + last_index[B:]))]
        else:
            index = torch.arange(rows, device=h.device)
            h = h[index[:, None] if last_index.dim() == 2 else index, last_index]  # [B, hidden], or [B, P, hidden]
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        logits = self.kernels.lm_head(h, weight, self.spec.tie_word_embeddings)
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_logit_softcapping
        logits = (torch.tanh(logits / cap) * cap if cap else logits).float()
        return logits if sampling is None else (logits, sample_tokens(logits, sampling))

    def _rotations(self, group: RowGroup, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin for `group`'s tokens, [B, T, 1, D] (per layer [L, B, T, 1, D] where layers differ)."""
        s, position_ids = self.spec, group.position_ids
        inv_freq = self.rope_inv_freq
        if s.rope_long_inv_freq:
            # One set per group of rows with equal seq_ids (a static batch: all of them, as Transformers picks it
            # for a batch; slots: each row alone), picked by the group's largest position.
            ids = group.seq_ids if group.seq_ids is not None else torch.zeros(group.rows, dtype=torch.long,
                                                                               device=position_ids.device)
            past = position_ids.max(dim=1).values + 1 > s.rope_long_after  # [B]
            long = ((ids[:, None] == ids[None, :]) & past[None, :]).any(dim=1)[:, None, None]  # [B, 1, 1]
            inv_freq = torch.where(long, self.rope_long_inv_freq, inv_freq)
        cos, sin = _rotation(position_ids, inv_freq, s.rope_attention_scaling, dtype)
        if not (s.nope_layers or s.rope_local_layers):
            return cos, sin
        # per layer: NoPE layers the identity (cos 1, sin 0), local ones their own frequencies
        rotations = {"global": (cos, sin), "none": (torch.ones_like(cos), torch.zeros_like(sin))}
        if s.rope_local_layers:
            rotations["local"] = _rotation(position_ids, self.rope_local_inv_freq, s.rope_local_attention_scaling,
                                           dtype)
        kinds = ["none" if i in s.nope_layers else "local" if i in s.rope_local_layers else "global"
                 for i in range(s.num_layers)]
        return (torch.stack([rotations[kind][0] for kind in kinds]),
                torch.stack([rotations[kind][1] for kind in kinds]))

    def _layers(self, h, cos, sin, plans: list[AttentionPlan], layout: CacheLayout):
        """Every layer over h: (h, the new K and V, stacked [L, ...] from the loop or a list per layer)."""
        s, L = self.spec, self.spec.num_layers
        mixed = self._mixed_windows
        per_layer = bool(s.nope_layers or s.rope_local_layers)

        def groups(layer_masks, caches):
            return [(plan.rows, plan.tokens, *masks, cache) for plan, masks, cache in zip(plans, layer_masks, caches)]

        stacked = isinstance(self.layers, DecoderLayer)
        caches = tuple(plan.cache_rows for plan in plans)
        if stacked and self.kernels.scans(s) and not layout.packed:
            # One loop over the stacked layers: the compiler traces, lowers and compiles one layer, not num_layers.
            layer = self.layers
            if per_layer or mixed:  # per-layer inputs ride along with the weights
                extra = {"cos": cos, "sin": sin} if per_layer else {}
                if mixed:
                    extra["sliding"] = self.sliding_layer_flags

                def body(h, xs):
                    weights, layer_caches, x = xs
                    masks = [plan.layer_masks(x.get("sliding"), mixed) for plan in plans]
                    return layer.step(weights, h, x.get("cos", cos), x.get("sin", sin), groups(masks, layer_caches))

                return scan(body, h, (layer.weights(), caches, extra))
            masks = [plan.sets[plan.kinds[0]] for plan in plans]  # every layer alike

            def body(h, xs):
                weights, layer_caches = xs
                return layer.step(weights, h, cos, sin, groups(masks, layer_caches))

            return scan(body, h, (layer.weights(), caches))
        # unrolled: one module per layer, or the stacked weights' slices (Kernels.scans False, packed caches)
        weights = self.layers.weights() if stacked else None
        new_kv = []
        for i in range(L):
            layer = self.layers if stacked else self.layers[i]
            layer_weights = {name: w[i] for name, w in weights.items()} if stacked else layer.weights()
            layer_cos, layer_sin = (cos[i], sin[i]) if per_layer else (cos, sin)
            row, first, n = layout.places[i]
            layer_caches = [cache[row, :, :, :, first:first + n] for cache in caches]
            h, layer_kv = layer.step(layer_weights, h, layer_cos, layer_sin,
                                     groups([plan.sets[plan.kinds[i]] for plan in plans], layer_caches))
            new_kv.append(layer_kv)
        return h, new_kv
