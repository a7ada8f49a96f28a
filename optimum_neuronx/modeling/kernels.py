"""The extension points of the decoder's math: how projections, attention and the cache write are computed. A backend
passes its own subclass (backends/inductor/lowering.py, backends/neuron/stablehlo.py); every other backend gets plain
PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import DecoderSpec

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
