"""RoPE as a checkpoint's config gives it, derived in this one place: the frequency sets per layer type (Transformers'
own ROPE_INIT_FUNCTIONS), LongRoPE's second set and where it starts, and the checks of what the static decoder can
rotate. The decoder only applies what this derives (DecoderSpec's rope_* fields, modeling/layers.rotation)."""

from __future__ import annotations

import logging

import torch

from ..configuration import NeuronConfig

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_fields(config) -> dict:
    """DecoderSpec's RoPE fields: the global frequencies and their scaling, gemma3's local layers' own, LongRoPE's."""
    sets = rope_sets(config)
    inv_freq, attention_scaling = rope_parameters(config, "full_attention" if "full_attention" in sets else None)
    fields = {"rope_inv_freq": tuple(float(x) for x in inv_freq), "rope_attention_scaling": float(attention_scaling)}
    if "sliding_attention" in sets:  # gemma3: local layers rotate with their own frequencies
        local_freq, local_scaling = rope_parameters(config, "sliding_attention")
        fields.update(rope_local_inv_freq=tuple(float(x) for x in local_freq),
                      rope_local_attention_scaling=float(local_scaling),
                      rope_local_layers=tuple(i for i, t in enumerate(config.layer_types) if t == "sliding_attention"))
    return {**fields, **long_rope_parameters(config)}


def check_rope_types(model_type: str, config) -> None:
    """Every RoPE set's type is one the decoder computes, over the whole head (no partial rotation)."""
    for layer_type, rope in rope_sets(config).items():
        where = f"config.rope_parameters{f'[{layer_type!r}]' if layer_type else ''}"
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{model_type}: {where}['rope_type'] = {rope_type!r} is not supported by the static decoder; "
                f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}.")
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1.0):
            raise ValueError(f"{model_type}: partial_rotary_factor = {partial} is not supported (only 1.0).")


def check_rope_length(model_type: str, config, sequence_length: int) -> None:
    """sequence_length past max_position_embeddings only where the model's RoPE scaling covers it (logged)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or sequence_length <= limit:
        return
    covered, how = limit, ""
    for rope in rope_sets(config).values():
        factor = (rope or {}).get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            original = rope.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None) or limit
            if int(original * factor) > covered:
                covered, how = int(original * factor), rope.get("rope_type", rope.get("type", "?"))
    if sequence_length > covered:
        raise ValueError(f"{model_type}: sequence_length = {sequence_length} is longer than the model's "
                         f"max_position_embeddings = {limit}" + (f" and what its {how} RoPE scaling covers "
                                                                  f"({covered})" if how else "")
                         + f": positions past it were never trained. Export with sequence_length <= {covered}.")
    logger.info("%s: sequence_length %d is past max_position_embeddings %d; its %s RoPE scaling covers %d.",
                model_type, sequence_length, limit, how, covered)


def check_long_rope_buckets(model_type: str, config, neuron_config: NeuronConfig) -> None:
    """LongRoPE re-encodes the sequence when it passes its switch: a context bucket must hold it."""
    after = long_rope_parameters(config).get("rope_long_after", 0)
    if after and after < neuron_config.sequence_length and neuron_config.context_buckets[-1] <= after:
        raise ValueError(
            f"{model_type}: LongRoPE switches to its long frequencies past original_max_position_embeddings "
            f"= {after}, and generation then re-encodes the whole sequence (as Transformers does), which needs a "
            f"context bucket of at least {after + 1} tokens; the largest is {neuron_config.context_buckets[-1]}. "
            f"Add one (e.g. context_buckets=[..., {neuron_config.sequence_length}]) or export with "
            f"sequence_length <= {after}.")


def long_rope_parameters(config) -> dict:
    """LongRoPE's second set of frequencies (for calls past the pretraining length) and where it starts; {} for
    other RoPE types."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type") != "longrope":
        return {}
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    after = int(rope.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=after + 1)
    return {"rope_long_inv_freq": tuple(float(x) for x in long_inv_freq), "rope_long_after": after}


def rope_sets(config) -> dict:
    """The RoPE parameters by layer type ({None: ...} where one set serves every layer)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return rope
    return {None: rope}


def rope_parameters(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and attention scaling of one set (`layer_type`'s, or the only one)."""
    rope = dict(rope_sets(config).get(layer_type) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if layer_type is None:
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
