"""How the decoder's weights and KV cache are cut across `shards` devices (tensor parallelism), as data.

Every shard holds whole attention heads and whole MLP columns: the fused projections are stored shard-major (shard
0's q, k, v rows, then shard 1's, ...; gate_up likewise), and the decoder splits them per shard
(`Kernels.shards`). With more shards than KV heads, each KV head is repeated so that every shard holds one: the math
is unchanged (query head h still reads the KV head of its group) and the cache grows by the repeat.

The saved weights keep the plain layout of one device; `ShardLayout.arrange` turns them into the sharded layout at
load, so one neuronx_weights.safetensors serves every tp degree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .spec import COLUMN_PARALLEL_PROJECTIONS, ROW_PARALLEL_PROJECTIONS, DecoderSpec

# Weight name suffix -> the axis (counted from the end) split across shards; every other weight is replicated.
# Column-parallel projections split their outputs (and their int8 scales), row-parallel ones their inputs (their bias
# and scales are applied whole).
SHARDED_AXES = {
    **{f"{name}.{part}": axis for name in COLUMN_PARALLEL_PROJECTIONS
       for part, axis in (("weight", -2), ("bias", -1), ("scale", -1))},
    **{f"{name}.weight": -1 for name in ROW_PARALLEL_PROJECTIONS},
    "lm_head.weight": -2,
    # every expert cut like a gated MLP: [experts, 2 I, H] by its outputs, [experts, H, I] by its inputs
    "experts_gate_up.weight": -2, "experts_down.weight": -1,
}
# The KV cache [layers, 2, batch, kv_heads, sequence, head_dim] is split by KV head.
KV_CACHE_AXIS = 3


def kv_heads_fit(num_kv_heads: int, shards: int) -> bool:
    """Whether KV heads can be split `shards` ways, or, when fewer than the shards, repeated evenly."""
    return (num_kv_heads % shards if shards <= num_kv_heads else shards % num_kv_heads) == 0


@dataclass(frozen=True)
class ShardLayout:
    shards: int
    num_heads: int
    num_kv_heads: int  # of the checkpoint
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def for_spec(cls, spec: DecoderSpec, shards: int) -> "ShardLayout":
        """The layout of `spec` over `shards` devices; ValueError naming the value and the fix when it cannot be cut."""
        def fix(what: str, count: int) -> str:
            fitting = [d for d in range(1, count + 1) if count % d == 0]
            return (f"tp_degree (num_cores) {shards} does not divide the {what} ({count}); use a tp_degree that "
                    f"does: {', '.join(map(str, fitting))}")

        if spec.num_heads % shards:
            raise ValueError(fix("attention heads (num_attention_heads)", spec.num_heads))
        kv = spec.num_kv_heads
        if not kv_heads_fit(kv, shards):
            raise ValueError(f"tp_degree (num_cores) {shards} and the {kv} KV heads (num_key_value_heads) do not "
                             f"divide each other, so KV heads can be neither split nor repeated evenly; use a "
                             f"divisor or a multiple of {kv}")
        if spec.intermediate_size % shards:
            raise ValueError(fix("MLP width (intermediate_size)", spec.intermediate_size))
        return cls(shards, spec.num_heads, kv, spec.head_dim, spec.intermediate_size, spec.vocab_size)

    @property
    def kv_repeats(self) -> int:
        """How many copies of each KV head the sharded layout holds (1 unless shards > KV heads)."""
        return max(1, self.shards // self.num_kv_heads)

    def sharded_spec(self, spec: DecoderSpec) -> DecoderSpec:
        """`spec` with its KV heads repeated for the shards (what the sharded graphs and cache are built for)."""
        return dataclasses.replace(spec, num_kv_heads=self.num_kv_heads * self.kv_repeats)

    def axis(self, name: str) -> int | None:
        """The axis of weight `name` split across shards, counted from the end; None: replicated."""
        if self.shards == 1:
            return None
        axis = next((a for suffix, a in SHARDED_AXES.items() if name.endswith(suffix)), None)
        if name.endswith("lm_head.weight") and self.vocab_size % self.shards:
            return None  # a vocabulary the shards do not divide stays whole
        return axis

    def arrange(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain weights (one device's layout) in the sharded layout: KV heads repeated, fused projections shard-major."""
        if self.shards == 1:
            return dict(weights)
        q, kv, ffn = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        out = {}
        for name, weight in weights.items():
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "qkv_proj.scale")):
                axis = SHARDED_AXES[f"qkv_proj.{name.rsplit('.', 1)[1]}"]
                wq, wk, wv = weight.split([q, kv, kv], dim=axis)
                wk, wv = (self._repeat_heads(w, axis) for w in (wk, wv))
                weight = self._shard_major(torch.cat((wq, wk, wv), dim=axis), [q, wk.shape[axis], wv.shape[axis]], axis)
            elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias", "gate_up_proj.scale",
                                "experts_gate_up.weight")):
                weight = self._shard_major(weight, [ffn, ffn], -2 if name.endswith("weight") else -1)
            out[name] = weight
        return out

    def _repeat_heads(self, weight: torch.Tensor, axis: int) -> torch.Tensor:
        if self.kv_repeats == 1:
            return weight
        shape = list(weight.shape)
        heads = weight.unflatten(axis, (self.num_kv_heads, self.head_dim))
        repeated = heads.repeat_interleave(self.kv_repeats, dim=axis - 1 if axis < 0 else axis)
        shape[axis] *= self.kv_repeats
        return repeated.reshape(shape)

    def _shard_major(self, weight: torch.Tensor, sizes: list[int], axis: int) -> torch.Tensor:
        """Parts of `sizes` along `axis`, each cut in `shards` pieces, regrouped piece-major: shard i's pieces side
        by side."""
        moved = weight.movedim(axis, 0)
        pieces = [part.reshape(self.shards, part.shape[0] // self.shards, *part.shape[1:])
                  for part in moved.split(sizes)]
        return torch.cat(pieces, dim=1).reshape(moved.shape).movedim(0, axis).contiguous()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
