"""Bucket selection: which compiled graph serves a prompt or a decode step (defaults: configuration.py)."""

from __future__ import annotations

from typing import Sequence


def context_bucket(prompt_length: int, buckets: Sequence[int]) -> int:
    """Smallest context-encoding bucket that holds a prompt of `prompt_length` tokens."""
    for size in buckets:
        if size >= prompt_length:
            return size
    raise ValueError(
        f"The prompt has {prompt_length} tokens but the largest compiled context-encoding bucket is "
        f"{buckets[-1]}. Shorten the prompt, or re-export with a larger context bucket, e.g. "
        f"NeuronModelForCausalLM.from_pretrained(model_id, export=True, sequence_length=..., "
        f"context_buckets=[..., {prompt_length}])."
    )


def token_bucket(position: int, buckets: Sequence[int]) -> int:
    """Smallest token-generation bucket that can hold a token written at cache slot `position`."""
    for size in buckets:
        if size > position:
            return size
    raise ValueError(
        f"Cannot write token at position {position}: the compiled sequence_length (KV cache size) is "
        f"{buckets[-1]}. Generate fewer tokens, or re-export with a larger sequence_length."
    )
