"""Bucket defaults and selection: pure functions of lengths and bucket lists."""

from __future__ import annotations

from typing import Iterable, Sequence

# Smallest default bucket: below this, compiling one more graph costs more than the cache reads it saves.
MIN_DEFAULT_BUCKET = 128


def default_buckets(sequence_length: int) -> tuple[int, ...]:
    """Powers of two from 128 up to `sequence_length`, plus `sequence_length` itself."""
    buckets = []
    size = min(MIN_DEFAULT_BUCKET, sequence_length)
    while size < sequence_length:
        buckets.append(size)
        size *= 2
    buckets.append(sequence_length)
    return tuple(buckets)


def normalize_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(int(b) for b in buckets)))


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
