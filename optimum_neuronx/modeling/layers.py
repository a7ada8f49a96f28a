"""One decoder layer (attention and MLP or mixture of experts, with its norms and rotary embedding) over the
layers' stacked weights, and the pieces it is built of."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention, group_tokens
from .kernels import Kernels
from .spec import DecoderSpec

_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # gpt2's name for the same tanh approximation
}


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


def rotation(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """RoPE's cos and sin [B, T, 1, D] at `position_ids` for `inv_freq`."""
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * scaling).to(dtype)[:, :, None, :], (emb.sin() * scaling).to(dtype)[:, :, None, :])


def residual(x: torch.Tensor, multiplier: float) -> torch.Tensor:
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
        h = h + residual(self._branch_out(proj(attn, "o_proj"), w,
                                           "attn_out_norm"), s.residual_multiplier)

        x = block_norm(h, "post_attention_norm")
        if s.mlp == "moe":
            out = mixture_of_experts(x, w, s, shards)
        elif s.mlp == "plain":
            out = proj(_ACTIVATIONS[s.hidden_act](proj(x, "up_proj")), "down_proj")
        else:
            gate, up = split_gate_up(proj(x, "gate_up_proj"), shards)
            out = proj(_ACTIVATIONS[s.hidden_act](gate) * up, "down_proj")
        return h + residual(self._branch_out(out, w, "mlp_out_norm"), s.residual_multiplier), new_kv

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
