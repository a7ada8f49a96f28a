"""What the supported families differ on, as plain data: DecoderSpec (sizes, the block's kinds, positions, windows,
scalars) and where each layer's K/V live in the cache tensor (`window_cache_places`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

NORMS = ("rms", "layer", "gemma")  # RMSNorm; LayerNorm with a bias; RMSNorm scaled by 1 + weight, in float32
POSITIONS = ("rope", "learned")  # rotary; a learned table added to the token embeddings
MLPS = ("gated", "plain", "moe")  # act(gate) * up -> down; act(up) -> down; a mixture of gated experts
# A layer's dense projections (DecoderLayer's weight names), by how tensor parallelism cuts them: column-parallel ones
# split their outputs, row-parallel ones their inputs. Quantization, weight packing and sharding read these.
LAYER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "up_proj", "down_proj")
ROW_PARALLEL_PROJECTIONS = ("o_proj", "down_proj")
COLUMN_PARALLEL_PROJECTIONS = tuple(name for name in LAYER_PROJECTIONS if name not in ROW_PARALLEL_PROJECTIONS)


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data) -> "DecoderSpec":
        """The spec an export recorded (`to_dict`), every field checked against its type and the kinds against
        NORMS, POSITIONS and MLPS: ValueError naming the first that is not what a spec holds."""
        if not isinstance(data, dict):
            raise ValueError(f"the decoder spec is {type(data).__name__}, not an object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        missing = sorted(name for name, f in fields.items() if name not in data
                         and f.default is dataclasses.MISSING)
        if unknown or missing:
            raise ValueError(f"the decoder spec has unknown fields {unknown} or lacks {missing}")
        values = {}
        for name, value in data.items():
            parsed = _SPEC_FIELD_TYPES[fields[name].type](value)
            if parsed is _BAD:
                raise ValueError(f"the decoder spec's {name} = {str(value)[:80]} is not of type {fields[name].type}")
            values[name] = parsed
        for name, allowed in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS)):
            if values.get(name, fields[name].default) not in allowed:
                raise ValueError(f"the decoder spec's {name} = {values[name]!r} is none of {allowed}")
        return cls(**values)


# The largest size a config or spec field may give (layers, heads, widths, vocabulary): far past any real model's.
MAX_CONFIG_SIZE = 1 << 24
_BAD = object()  # what a field parser returns for a value that is not of its type


def _size(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_CONFIG_SIZE else _BAD


def _number(value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else _BAD


def _sequence(item, length: int | None = None):
    def parse(value):
        if not isinstance(value, (list, tuple)) or len(value) > MAX_CONFIG_SIZE or length not in (None, len(value)):
            return _BAD
        parsed = tuple(item(v) for v in value)
        return _BAD if any(v is _BAD for v in parsed) else parsed
    return parse


# A DecoderSpec field's annotation -> its parser.
_SPEC_FIELD_TYPES = {
    "int": _size,
    "float": _number,
    "float | None": lambda v: None if v is None else _number(v),
    "str": lambda v: v if isinstance(v, str) and len(v) <= 64 else _BAD,
    "bool": lambda v: v if isinstance(v, bool) else _BAD,
    "tuple[float, ...]": _sequence(_number),
    "tuple[int, ...]": _sequence(_size),
    "tuple[tuple[int, int, int], ...]": _sequence(_sequence(_size, 3)),
}


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
