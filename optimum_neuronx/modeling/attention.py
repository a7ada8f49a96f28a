"""What a graph's new tokens read and write in the KV cache: the additive attention masks (per group of rows, per kind
of layer: plain, sliding window over the token window, ring), attention over them, and the write of the new K and V
after the last layer (modeling/layers.py runs the layers between)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowGroup:
    """A group of a graph's rows: `rows` sequences of `tokens` new tokens each, with their inputs (a fused graph has
    two groups; every other graph one)."""

    rows: int
    tokens: int
    position_ids: torch.Tensor
    cache_start: torch.Tensor
    key_valid: torch.Tensor
    last_index: torch.Tensor
    seq_ids: torch.Tensor | None
    targeted: bool  # the rows are the cache rows seq_ids names (else row b is cache row b)


@dataclass(frozen=True)
class CacheLayout:
    """Where each layer keeps its K and V in the cache tensor (DecoderSpec.cache_places)."""

    places: tuple[tuple[int, int, int], ...]  # each layer's (row, first slot, slots) in the cache tensor
    ring: int  # the slots a sliding layer keeps (0: every one)
    stores_ring: tuple[bool, ...]  # per layer: its K/V kept in a ring
    packed: bool  # rings side by side in a row


@dataclass
class AttentionPlan:
    """A group's attention inputs: its cache rows and masks per kind of layer ("plain", "window", "ring")."""

    rows: int
    tokens: int
    cache_rows: torch.Tensor
    sets: dict
    kinds: list

    def layer_masks(self, flag, mixed: bool):
        """(masks, new_mask) of the layer whose sliding flag is `flag` (a 0-d tensor, in the loop) of a model whose
        layers mix windowed and plain attention (`mixed`); else every layer's."""
        if not mixed:
            return self.sets[self.kinds[0]]
        pick = lambda a, b: torch.where(flag > 0, a, b)  # noqa: E731
        (window_masks, window_new), (plain_masks, plain_new) = self.sets["window"], self.sets["plain"]
        return ([pick(w, f) for w, f in zip(window_masks, plain_masks)],
                None if plain_new is None else pick(window_new, plain_new))


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-group cos or sin [..., B, T, 1, D] as one row of all their tokens [..., 1, sum B * T, 1, D]."""
    return torch.cat([p.reshape(*p.shape[:-4], 1, p.shape[-4] * p.shape[-3], *p.shape[-2:]) for p in parts], dim=-3)


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


def attention(kernels, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              masks: list[torch.Tensor], scale: float, tokens: int) -> torch.Tensor:
    """Attention of folded queries q [B, kv_heads, T * n_rep, D] over keys/values [B, kv_heads, W, D].

    Each piece of `masks` (from `attention_masks`) takes the next rows of q and the keys its width covers: a
    context graph's query blocks skip the keys after them.
    """
    out, start = [], 0
    for mask in masks:
        rows, width = mask.shape[-2:]
        out.append(kernels.attention(q[:, :, start:start + rows], keys[:, :, :width], values[:, :, :width], mask,
                                     scale, tokens))
        start += rows
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A finite minimum, not -inf: rows with nothing to attend to (padding) must not produce NaN.
    return torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _mask_pieces(kernels, allowed, fresh, dtype, n_rep):
    """The additive attention masks (pieces, `attention_masks`) of `allowed` [B, 1, T, W] and of the new tokens
    among themselves, `fresh` [B, 1, T, T] (None in a context graph)."""
    if fresh is None:
        return attention_masks(additive_mask(allowed, dtype), n_rep, kernels.causal_block), None
    return attention_masks(additive_mask(allowed, dtype), n_rep), attention_masks(additive_mask(fresh, dtype), n_rep)[0]


def cache_layout(spec, kv_cache: torch.Tensor) -> CacheLayout:
    """Where the decoder `spec`'s layers keep their K/V in `kv_cache`."""
    s, L = spec, spec.num_layers
    places = s.cache_places or tuple((layer, 0, kv_cache.shape[4]) for layer in range(L))
    ring = s.sliding_window if s.cache_places else 0  # the slots a sliding layer keeps (0: every one)
    return CacheLayout(places, ring, tuple(bool(ring) and layer in s.sliding_layers for layer in range(L)),
                        any(place[:2] != (layer, 0) for layer, place in enumerate(places)))


def attention_plan(spec, kernels, group: RowGroup, kv_cache: torch.Tensor, layout: CacheLayout,
                   dtype: torch.dtype) -> AttentionPlan:
    """`group`'s cache rows and its masks for each kind of layer of the decoder `spec` (a DecoderSpec)."""
    s, L = spec, spec.num_layers
    B, T, dev = group.rows, group.tokens, kv_cache.device
    position_ids, cache_start, key_valid = group.position_ids, group.cache_start, group.key_valid
    W = key_valid.shape[1]
    n_rep = s.num_heads // s.num_kv_heads
    ring = layout.ring
    cache_rows = kv_cache.index_select(2, group.seq_ids) if group.targeted else kv_cache
    slots = cache_start[:, None] + torch.arange(T, device=dev)  # [B, T]: each row's slots for its new tokens
    context = cached = fresh = None
    if T == W and not group.targeted:  # a context graph: the window is its tokens, from slot 0
        key_slots = torch.arange(W, device=dev)
        context = key_valid[:, None, None, :] & (key_slots[None, None, None, :] <= slots[:, None, :, None])
    else:
        # The cache's slots from cache_start on hold stale K/V until the write after the layers: the new tokens
        # are attended to from new_kv instead, causally among themselves. (A row a step does not serve may sit
        # past the window: its slots are clamped into it, its outputs unread.)
        cached = key_valid & (torch.arange(W, device=dev)[None, :] < cache_start[:, None])  # [B, W]
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        fresh = key_valid.gather(1, slots.clamp(max=W - 1))[:, None, None, :] & causal  # [B, 1, T, T]

    def mask_set(cached, positions, window: bool):
        """(masks, new_mask) over the keys `cached` [B, K] at `positions` [B, K] (None: a context graph), within
        the sliding window where `window`."""
        allowed = context if cached is None else cached[:, None, None, :].expand(B, 1, T, cached.shape[1])
        new = fresh
        if window:
            allowed = allowed & ((position_ids[:, None, :, None] - positions[:, None, None, :]) < s.sliding_window)
            if fresh is not None:
                new = fresh & ((position_ids[:, None, :, None] - position_ids[:, None, None, :]) < s.sliding_window)
        return _mask_pieces(kernels, allowed, new, dtype, n_rep)

    # Each layer's masks: "plain", "window" (sliding, over the token window W), or "ring" (sliding, a token graph
    # over a ring narrower than W: ring slot j holds the latest slot before cache_start that is j modulo the ring).
    kinds = ["plain" if layer not in s.sliding_layers or not s.sliding_window
             else "ring" if layout.stores_ring[layer] and cached is not None and ring < W else "window"
             for layer in range(L)]
    # A key's position is its rank among the row's real slots (positions count real tokens only); windows only.
    key_positions = key_valid.long().cumsum(1) - 1 if s.sliding_window else None  # [B, W]
    sets = {}
    for kind in dict.fromkeys(kinds):  # in layer order: the traced graph is the same in every process
        if kind == "ring":  # per row: ring slot j holds the latest slot before cache_start that is j mod ring
            # (dividends kept >= 0: some lowerings compute remainder with the dividend's sign)
            last = cache_start[:, None] - 1
            held = last - torch.remainder(last + ring - torch.arange(ring, device=dev), ring)  # [B, ring]
            at = held.clamp(min=0, max=W - 1)
            sets[kind] = mask_set(key_valid.gather(1, at) & (held >= 0), key_positions.gather(1, at), True)
        else:
            sets[kind] = mask_set(cached, key_positions, kind == "window")
    return AttentionPlan(B, T, cache_rows, sets, kinds)


def group_tokens(kv: torch.Tensor, offset: int, rows: int, tokens: int) -> torch.Tensor:
    """One group's K and V [..., 2, rows, kv_heads, tokens, D] out of a fused graph's [..., 2, 1, kv_heads, N, D],
    whose tokens run group after group from `offset`, each group's row after row."""
    part = kv[..., offset:offset + rows * tokens, :]
    shape = part.shape  # [..., 2, 1, kv_heads, n, D]: the one-row axis dropped by the reshape
    return part.reshape(*shape[:-4], shape[-3], rows, tokens, shape[-1]).transpose(-4, -3)


def write_new_kv(spec, kernels, kv_cache: torch.Tensor, new_kv, group: RowGroup, layout: CacheLayout,
                 offset: int | None) -> None:
    """`group`'s new K and V (at `offset` among a fused graph's tokens; None: the graph's only group) written
    into `kv_cache` in place, by one write per kind of place (all slots, or a ring): writes through views would
    copy the cache. A row-targeted group writes nothing after a row's last real token (last_index): such entries
    repeat the last token's write (same slot, same values), so a chunk's padding never lands on slots the row
    holds."""
    s, L = spec, spec.num_layers
    B, T, dev = group.rows, group.tokens, kv_cache.device
    cache_start, last_index, ring = group.cache_start, group.last_index, layout.ring
    steps = torch.arange(T, device=dev)
    source = torch.minimum(steps, last_index[:, None]) if group.targeted else steps.expand(B, T)  # [B, T]
    for ring_group in (False, True):
        layers = [i for i in range(L) if layout.stores_ring[i] == ring_group]
        if not layers:
            continue
        if isinstance(new_kv, torch.Tensor):  # the loop's, stacked: every layer stored alike
            kv = new_kv
        else:
            kv = torch.stack([new_kv[i] for i in layers])
        if offset is not None:
            kv = group_tokens(kv, offset, B, T)
        picked = source
        token_slots = cache_start[:, None] + source  # [B, entries]
        if ring_group and T > ring:
            # More new tokens than the ring holds: ring slot j gets the latest real token that is j modulo the
            # ring; a slot no new token reaches keeps what it holds (its entry repeats the last token's write).
            end = cache_start + last_index if last_index.dim() == 1 else cache_start + T - 1  # [B]
            latest = end[:, None] - torch.remainder(end[:, None] + ring - torch.arange(ring, device=dev), ring)
            reached = latest >= cache_start[:, None]
            picked = torch.where(reached, latest - cache_start[:, None], (end - cache_start)[:, None])
            token_slots = torch.where(reached, torch.arange(ring, device=dev), torch.remainder(end, ring)[:, None])
        elif ring_group:
            token_slots = torch.remainder(token_slots, ring)
        count = picked.shape[1]
        if group.targeted or count != T:
            kv = kv.gather(4, picked.view(1, 1, B, 1, count, 1).expand(*kv.shape[:4], count, kv.shape[5]))
        n, rows = len(layers), torch.arange(len(layers), device=dev)
        slot_index = token_slots.view(1, 1, B, 1, count)
        if layout.packed and ring_group:  # the rings side by side after the full layers' rows (window_cache_places)
            per_row, full_rows = kv_cache.shape[4] // ring, L - n
            slot_index = (rows % per_row * ring).view(n, 1, 1, 1, 1) + slot_index
            rows = full_rows + rows // per_row
        index = (
            rows.view(n, 1, 1, 1, 1),
            torch.arange(2, device=dev).view(1, 2, 1, 1, 1),
            (group.seq_ids if group.targeted else torch.arange(B, device=dev)).view(1, 1, B, 1, 1),
            torch.arange(s.num_kv_heads, device=dev).view(1, 1, 1, s.num_kv_heads, 1),
            slot_index,
        )
        kernels.write_cache(kv_cache, index, kv)
