"""Layouts a backend may store projection weights in: plain [N, K], or tiled [N / T, K, T].

Tile i holds outputs i * T .. i * T + T - 1, input by input: one pass over a tile is one contiguous stream, and
each input's T weights sit side by side.
"""

from __future__ import annotations

import torch


def tile_weight(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """A plain weight [..., N, K] (N a multiple of `tile`) as tiles [..., N / tile, K, tile]."""
    *lead, n, k = weight.shape
    if n % tile:
        raise ValueError(f"a weight of {n} outputs cannot be cut into tiles of {tile}")
    return weight.reshape(*lead, n // tile, tile, k).transpose(-1, -2).contiguous()


def untile_weight(weight: torch.Tensor) -> torch.Tensor:
    """The plain weight [..., N, K] of tiles [..., N / T, K, T] (`tile_weight`'s inverse)."""
    *lead, tiles, k, tile = weight.shape
    return weight.transpose(-1, -2).reshape(*lead, tiles * tile, k)


def weight_outputs(weight: torch.Tensor) -> int:
    """N, the outputs of a projection weight, plain [N, K] or tiled [N / T, K, T]."""
    return weight.shape[0] * weight.shape[2] if weight.dim() == 3 else weight.shape[0]
