"""The KV cache the runtime owns, the per-step graph inputs, and the handle generate passes back to us."""

from __future__ import annotations

import torch

from .modeling.spec import DecoderSpec


class StaticKVCache:
    """Preallocated K/V for every layer in one tensor (`DecoderSpec.kv_cache_shape`), written in place by the
    compiled graphs, plus slot validity.

    `key_valid[b, s]` says whether cache slot s of sequence b holds a real token (left padding does not).
    """

    def __init__(self, spec: DecoderSpec, batch_size: int, sequence_length: int, kv, reorder_kv):
        # `kv`: the backend's (Backend.new_kv_cache: zeros, not empty, since masked slots are still multiplied by 0
        # in attention and 0 * NaN is NaN), e.g. a cache kept on a device; `reorder_kv(kv, rows)` its reorder.
        self.kv, self._reorder_kv = kv, reorder_kv
        self.key_valid = torch.zeros(batch_size, sequence_length, dtype=torch.bool)
        # Sliding layers that keep only their window (DecoderSpec.cache_places): slot s at s mod kv_slots.
        self.ring = bool(spec.cache_places)
        self.num_layers = spec.num_layers
        self.kv_slots = spec.sliding_window if self.ring else sequence_length

    def valid_window(self, width: int) -> torch.Tensor:
        """`key_valid[:, :width]` as a fresh tensor with the strides a graph was compiled for (`contiguous()` keeps a
        one-row slice's row stride of the whole cache, which the graphs' input checks refuse)."""
        window = torch.empty(self.key_valid.shape[0], width, dtype=torch.bool)
        return window.copy_(self.key_valid[:, :width])

    def reorder(self, rows: torch.Tensor) -> None:
        self._reorder_kv(self.kv, rows)
        self.key_valid[:rows.numel()] = self.key_valid[rows]


class DecodeStepInputs:
    """A token graph's small inputs, allocated once and refilled in place every decode step."""

    def __init__(self, batch_size: int):
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long)
        self.positions = torch.zeros(batch_size, 1, dtype=torch.long)
        self.slot = torch.zeros(batch_size, dtype=torch.long)  # each row's write slot (cache_start)
        self.last = torch.zeros(batch_size, dtype=torch.long)  # logits of the only (last) position
        self.batch = torch.zeros(batch_size, dtype=torch.long)  # seq_ids of a static batch: one group
        self.slots = torch.arange(batch_size)  # seq_ids of slots: each row on its own


class CacheHandle:
    """Stands for the on-device cache in `CausalLMOutputWithPast.cache` (`past_key_values` before Transformers 5.24).

    generate hands it back on every step: "the cache passed is the handle returned last" means continue,
    anything else (None, a fresh DynamicCache) means encode a new context. Deliberately not a
    `transformers.Cache` subclass: an empty one claims to be compileable and generate then builds 4D masks.
    """

    is_compileable = False

    def __init__(self, cache: StaticKVCache, length: int):
        self._cache = cache
        self.length = length

    @property
    def is_croppable(self) -> bool:
        """Whether crop() can roll tokens back (assisted generation): not where the cache is a window ring, whose
        older slots are overwritten (as Transformers' StaticSlidingWindowLayer)."""
        return not self._cache.ring

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it keeps a recurrent state (none here): generate reads it when it continues from a
        cache, as a draft model does on every call."""
        return [False] * self._cache.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self._cache.key_valid.shape[1]

    def crop(self, max_length: int) -> None:
        """Drop the last `-max_length` tokens when it is zero or negative (Transformers 5: `crop(-n)`, and `crop(0)`
        keeps everything), else keep the first `max_length` (the older absolute form). A static cache only moves its
        end."""
        if max_length <= 0:
            max_length = self.length + max_length
        if self._cache.ring and self.length > self._cache.kv_slots and max_length < self.length - 1:
            raise ValueError(f"cannot roll the cache back from {self.length} to {max_length} tokens: this model's "
                             f"cache keeps only the last {self._cache.kv_slots} (its sliding window), and the tokens "
                             f"before were overwritten. Generate without assisted decoding, or export with "
                             f"sequence_length <= sliding_window.")
        self.length = max(0, min(self.length, max_length))
        self._cache.key_valid[:, self.length:] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache.reorder(beam_idx.to(torch.long))

    def __len__(self) -> int:
        return self._cache.num_layers  # layers, as a Transformers cache counts (packed rings share rows)
