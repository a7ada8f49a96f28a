"""The stepping engine: the compiled graphs over a KV cache whose rows are slots.

Two ways to drive it:

* a static batch (Transformers' generate through `NeuronModelForCausalLM.forward`): `encode` every row's prompt, then
  `decode` / `verify` new tokens for all rows at one shared length (`handle.length`), rows left-padded;
* slots (continuous batching, scheduler.py): `prefill` one row's prompt chunk by chunk from slot 0, `step` one token
  for any set of rows, each at its own length, `fused_step` both at once (a step and one chunk, the weights read
  once), `free` a row for the next request. Exports with continuous_batching have the one-row prefill and fused
  graphs this needs; their token graphs serve both ways.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends.base import host_logits
from .buckets import context_bucket, token_bucket
from .configuration import NeuronConfig
from .kv_cache import CacheHandle, DecodeStepInputs, StaticKVCache
from .modeling.spec import DecoderSpec
from .modeling.sampling import SAMPLING_FIELDS


class Engine:
    """The graphs, the KV cache and every graph call. One caller at a time (the runtime's lock, or the scheduler's
    process): calls write the cache in place."""

    def __init__(self, graphs: dict, neuron_config: NeuronConfig, spec: DecoderSpec, kv, reorder_kv):
        """`kv`: the KV cache the graphs take (Backend.new_kv_cache), `reorder_kv(kv, rows)`: its reorder."""
        nc = self.neuron_config = neuron_config
        self.graphs = graphs
        self.cache = StaticKVCache(spec, nc.batch_size, nc.sequence_length, kv, reorder_kv)
        self.vocab_size = spec.vocab_size
        self.rope_long_after = spec.rope_long_after  # LongRoPE: a sequence past this is encoded with other freqs
        self.handle: Optional[CacheHandle] = None  # the static batch's cache, as generate holds it
        self.sampler = None  # (top_k, top_p, temperature) while a generate is served by on-device sampling
        self._step = DecodeStepInputs(nc.batch_size)
        specs = nc.graphs()
        self.prefill_sizes = tuple(g.tokens for g in specs if g.kind == "prefill")
        fused = [g for g in specs if g.kind == "fused"]
        self.fused_chunk = fused[0].tokens if fused else 0  # the most tokens a chunk fused into a step takes
        self._fused_windows = tuple(g.window for g in fused)
        self.lengths = [0] * nc.batch_size  # tokens each slot holds (slots)

    @property
    def slots(self) -> int:
        return self.neuron_config.batch_size

    # ---- a static batch ----

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The prompts [b, n] (left or right padded as `attention_mask` says) written into rows 0 .. b - 1 from slot
        0: logits [b, 1, vocab] of each row's last real token. A new context: `handle` restarts at n."""
        b, n = input_ids.shape
        nc, cache = self.neuron_config, self.cache
        mask = attention_mask if attention_mask is not None else torch.ones(b, n, dtype=torch.bool)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        # each row's last real token (right padding leaves padding after it: the row continues from that token)
        last = torch.full((b,), n - 1, dtype=torch.long) - mask.flip(-1).to(torch.uint8).argmax(-1)
        cache.key_valid.zero_()
        cache.key_valid[:b, :n] = mask
        if nc.continuous_batching:
            rows = [self._prefill_row(row, input_ids[row], positions[row], int(last[row]), self._sampling_input(1))
                    for row in range(b)]
            logits = torch.cat([self._picked(out) for out in rows])
        else:
            bucket = context_bucket(n, nc.context_buckets)
            ids = torch.zeros(nc.batch_size, bucket, dtype=torch.long)
            ids[:b, :n] = input_ids
            padded_positions = torch.zeros(nc.batch_size, bucket, dtype=torch.long)
            padded_positions[:b, :n] = positions
            last_index = torch.full((nc.batch_size,), n - 1, dtype=torch.long)
            last_index[:b] = last
            logits = self._picked(self.graphs[f"context_{bucket}"](
                [ids, padded_positions, torch.zeros(nc.batch_size, dtype=torch.long), cache.valid_window(bucket),
                 last_index, cache.kv, self._step.batch, *self._sampling_input()]))[:b]
        self.handle = CacheHandle(cache, n)
        return logits[:, None, :]

    def decode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits [b, n, vocab] of n new tokens: several (drafted tokens, a rollback) in verification passes of up to
        speculation_length + 1 tokens where the export has them and they fit the cache, else one decode step each."""
        n, width = input_ids.shape[1], self.neuron_config.speculation_length + 1
        if attention_mask is not None and attention_mask.shape[1] < self.handle.length + n:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens but the cache holds "
                             f"{self.handle.length} + {n} new ones.")
        out, j = [], 0
        while j < n:
            count = min(n - j, width)
            if count > 1 and self.handle.length + width <= self.neuron_config.sequence_length:
                out.append(self._verify(input_ids[:, j:j + count], attention_mask))
            else:
                count = 1
                out.append(self._decode_step(input_ids[:, j], attention_mask))
            j += count
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def _valid_slots(self, rows: int, attention_mask, end: int) -> torch.Tensor:
        """key_valid's slots up to `end` of the first `rows` rows, from the mask (None: every slot real)."""
        valid = self.cache.key_valid[:rows, :end]
        if attention_mask is not None:
            valid.copy_(attention_mask[:, :end])
        else:
            valid.fill_(True)
        return valid

    def _verify(self, input_ids, attention_mask) -> torch.Tensor:
        """n <= speculation_length + 1 new tokens scored in one pass of a verification graph (their K/V written at
        the next slots; the padding after them is written too, at slots left invalid). Logits [b, n, vocab]."""
        b, n = input_ids.shape
        nc, cache, handle = self.neuron_config, self.cache, self.handle
        slot, width = handle.length, nc.speculation_length + 1
        window = token_bucket(slot + width - 1, nc.token_buckets)
        self._valid_slots(b, attention_mask, slot + n)
        cache.key_valid[:, slot + n: slot + width] = False
        cache.key_valid[b:, : slot + width] = False
        ids = torch.zeros(nc.batch_size, width, dtype=torch.long)
        ids[:b, :n] = input_ids
        # Fresh tensors, not slices: a one-row slice keeps the whole row's stride, which the graphs' checks refuse.
        positions = torch.empty(nc.batch_size, width, dtype=torch.long)
        positions.copy_((cache.key_valid[:, : slot + width].long().cumsum(-1) - 1).clamp(min=0)[:, slot:])
        last = torch.arange(width).repeat(nc.batch_size, 1)
        logits = self.graphs[f"verify_{window}"](
            [ids, positions, torch.full((nc.batch_size,), slot), cache.valid_window(window), last, cache.kv,
             self._step.batch])
        handle.length = slot + n
        return logits[:b, :n]

    def _decode_step(self, token_ids, attention_mask) -> torch.Tensor:
        """One token per row (token_ids [b]) through a token graph. Logits [b, 1, vocab]."""
        b = token_ids.shape[0]
        nc, cache, handle, step = self.neuron_config, self.cache, self.handle, self._step
        slot = handle.length
        window = token_bucket(slot, nc.token_buckets)
        valid = self._valid_slots(b, attention_mask, slot + 1)
        # The small inputs are refilled in place, not allocated per step (the key mask's window is still copied
        # out contiguous below). Rows past b are never read back.
        step.ids[:b, 0] = token_ids
        torch.sum(valid, dim=-1, out=step.positions[:b, 0])
        step.positions[:b].sub_(1).clamp_(min=0)
        step.slot.fill_(slot)
        logits = self._picked(self.graphs[f"token_{window}"](
            [step.ids, step.positions, step.slot, cache.valid_window(window), step.last, cache.kv, step.batch,
             *self._sampling_input()]))
        handle.length = slot + 1
        return logits[:b, None]

    def _sampling_input(self, rows: Optional[int] = None) -> tuple:
        """The sampling graphs' last input, [rows, 4] (modeling/sampling.py): this generate's request with a fresh
        uniform draw per row from torch's generator, or greedy; () where the graphs do not sample."""
        if not self.neuron_config.on_device_sampling:
            return ()
        rows = rows or self.neuron_config.batch_size
        if self.sampler is None:
            return (torch.zeros(rows, len(SAMPLING_FIELDS)),)
        return (torch.cat([torch.tensor(self.sampler).expand(rows, 3), torch.rand(rows, 1)], dim=1),)

    def _picked(self, outputs) -> torch.Tensor:
        """A graph's logits; during a generate served by on-device sampling, logits that put every row's picked
        token first (0, every other token the float32 minimum): generate's greedy search then takes that token."""
        if not isinstance(outputs, tuple):
            return outputs
        logits, tokens = outputs
        if self.sampler is None:
            return host_logits(logits)
        picked = torch.full((tokens.shape[0], self.vocab_size), torch.finfo(torch.float32).min)
        return picked.scatter_(1, tokens.long()[:, None], 0.0)

    @staticmethod
    def _logits_or_tokens(outputs, rows=None) -> tuple:
        """(logits, None) of a graph that returns logits, (None, tokens) of one that sampled (its logits unread)."""
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])
        if isinstance(outputs, tuple):
            return None, pick(outputs[1])
        return pick(outputs), None

    # ---- slots ----

    def chunk(self, remaining: int, limit: Optional[int] = None, total: int = 0) -> int:
        """The tokens the next prefill chunk of a sequence of `total` tokens, `remaining` of them left, takes: as many
        as the largest prefill graph takes, or with `limit` the largest that takes no more than `limit` (the smallest
        if none). LongRoPE: a sequence past the switch is encoded in one pass with the long frequencies (no limit)."""
        if not self.prefill_sizes:
            raise ValueError("this export has no prefill graphs: re-export with continuous_batching=True to serve "
                             "requests in slots.")
        if self.rope_long_after and total > self.rope_long_after:
            if total > self.prefill_sizes[-1]:
                raise ValueError(f"a sequence of {total} tokens passes this model's LongRoPE switch "
                                 f"({self.rope_long_after}) and must be encoded in one pass with the long "
                                 f"frequencies, but the largest prefill graph takes {self.prefill_sizes[-1]}: "
                                 f"re-export with context_buckets including {total}.")
            limit = None
        fitting = [size for size in self.prefill_sizes if limit is None or size <= limit]
        return min(remaining, fitting[-1] if fitting else self.prefill_sizes[0])

    def prefill(self, slot: int, token_ids: torch.Tensor, sampling: Optional[torch.Tensor] = None):
        """A chunk of slot `slot`'s prompt (token_ids [k], k <= `chunk(...)`), written after the `lengths[slot]`
        tokens the slot holds (0: a new request; the slot's earlier chunks otherwise). Returns (logits [1, vocab],
        None) for the chunk's last token, or (None, token [1]) where the graphs sample (`sampling` [1, 4], greedy if
        None)."""
        start, k = self.lengths[slot], token_ids.shape[0]
        if k > self.prefill_sizes[-1] or start + k > self.neuron_config.sequence_length:
            raise ValueError(f"a prefill chunk of {k} tokens after {start} does not fit: chunks take at most "
                             f"{self.prefill_sizes[-1]} tokens and the cache {self.neuron_config.sequence_length}.")
        self._mark_chunk(slot, start, k)
        out = self._prefill_chunk(slot, token_ids, torch.arange(start, start + k), start, k - 1, sampling)
        self.lengths[slot] = start + k
        return self._logits_or_tokens(out)

    def _mark_chunk(self, slot: int, start: int, k: int) -> None:
        """key_valid of a chunk of k tokens written into `slot` from `start` (0: the row starts afresh)."""
        valid = self.cache.key_valid[slot]
        if start == 0:
            valid.zero_()
        valid[start:start + k] = True

    def _prefill_row(self, row: int, ids: torch.Tensor, positions: torch.Tensor, last: int, sampling: tuple):
        """A static batch's row (its padding where key_valid says), in chunks: the outputs at its token `last`."""
        n, start, outputs = ids.shape[0], 0, None
        while start < n:
            k = self.chunk(n - start, total=n)
            out = self._prefill_chunk(row, ids[start:start + k], positions[start:start + k], start,
                                      min(max(last - start, 0), k - 1), *sampling)
            if start <= last < start + k:
                outputs = out
            start += k
        return outputs

    def prefill_size(self, k: int) -> int:
        """The tokens the prefill graph that takes a chunk of `k` computes (the chunk padded to its size)."""
        return next(s for s in self.prefill_sizes if s >= k)

    def _prefill_chunk(self, row: int, ids: torch.Tensor, positions: torch.Tensor, start: int, last: int,
                       sampling: Optional[torch.Tensor] = None):
        size = self.prefill_size(ids.shape[0])
        return self.graphs[f"prefill_{size}"](self._chunk_inputs(row, ids, positions, start, last, sampling, size,
                                                                 self.neuron_config.sequence_length))

    def _chunk_inputs(self, row: int, ids: torch.Tensor, positions: torch.Tensor, start: int, last: int,
                      sampling: Optional[torch.Tensor], size: int, window: int) -> list:
        """A one-row graph's inputs for a chunk of `row` (ids [k], padded to `size`) over `window` cache slots."""
        k = ids.shape[0]
        padded_ids = torch.zeros(1, size, dtype=torch.long)
        padded_ids[0, :k] = ids
        padded_positions = torch.arange(size)[None] + int(positions[-1]) - (k - 1)
        padded_positions[0, :k] = positions
        inputs = [padded_ids, padded_positions, torch.tensor([start]), self.cache.key_valid[row, :window][None].clone(),
                  torch.tensor([last]), self.cache.kv, torch.tensor([row])]
        if self.neuron_config.on_device_sampling:
            inputs.append(sampling if sampling is not None else torch.zeros(1, len(SAMPLING_FIELDS)))
        return inputs

    def step(self, slots: list[int], token_ids: list[int], sampling: Optional[torch.Tensor] = None):
        """One new token for each of `slots` (token_ids, in the same order), each written after what its slot holds;
        the other rows write only their own next slot, which they rewrite before reading. Returns (logits
        [len(slots), vocab], None), or (None, tokens [len(slots)]) where the graph samples (`sampling` [len, 4],
        greedy where None): then no logits leave the device."""
        window = token_bucket(max(self.lengths[s] for s in slots), self.neuron_config.token_buckets)
        out = self.graphs[f"token_{window}"](self._step_inputs(slots, token_ids, sampling, window))
        for s in slots:
            self.lengths[s] += 1
        return self._logits_or_tokens(out, torch.tensor(slots))

    def fused_window(self, slots: list[int], chunk_slot: int, k: int) -> Optional[int]:
        """The window of the fused graph that can step `slots` and take a chunk of k tokens for `chunk_slot` in one
        call, or None (no fused graphs, a chunk wider than theirs, or positions past their windows)."""
        if not self.fused_chunk or k > self.fused_chunk:
            return None
        end = max(max(self.lengths[s] for s in slots), self.lengths[chunk_slot] + k - 1)
        return next((window for window in self._fused_windows if window > end), None)

    def fused_step(self, slots: list[int], token_ids: list[int], sampling: Optional[torch.Tensor],
                   chunk_slot: int, chunk_ids: torch.Tensor, chunk_sampling: Optional[torch.Tensor] = None):
        """`step(slots, token_ids, sampling)` and `prefill(chunk_slot, chunk_ids, chunk_sampling)` in one call of a
        fused graph (`fused_window` must give one): the weights are read once for both. Returns the step's result
        and the chunk's, each as those methods return them."""
        start, k = self.lengths[chunk_slot], chunk_ids.shape[0]
        window = self.fused_window(slots, chunk_slot, k)
        if window is None:
            raise ValueError(f"no fused graph steps slots {slots} with a chunk of {k} tokens after {start} in slot "
                             f"{chunk_slot}: run step and prefill apart.")
        self._mark_chunk(chunk_slot, start, k)
        rows = self._step_inputs(slots, token_ids, sampling, window)
        chunk = self._chunk_inputs(chunk_slot, chunk_ids, torch.arange(start, start + k), start, k - 1,
                                   chunk_sampling, self.fused_chunk, window)
        inputs = [torch.cat((rows[0].view(1, -1), chunk[0]), dim=1), torch.cat((rows[1].view(1, -1), chunk[1]), dim=1),
                  *(torch.cat((a, b)) for a, b in zip(rows[2:5], chunk[2:5])), self.cache.kv,
                  *(torch.cat((a, b)) for a, b in zip(rows[6:], chunk[6:]))]
        out = self.graphs[f"fused_{window}"](inputs)
        for s in slots:
            self.lengths[s] += 1
        self.lengths[chunk_slot] = start + k
        return self._logits_or_tokens(out, torch.tensor(slots)), self._logits_or_tokens(out, torch.tensor([self.slots]))

    def _step_inputs(self, slots: list[int], token_ids: list[int], sampling: Optional[torch.Tensor],
                     window: int) -> list:
        """A token graph's inputs stepping `slots` over `window` cache slots (key_valid set for their new tokens)."""
        nc, cache, step = self.neuron_config, self.cache, self._step
        # every row writes at its own next slot: idle ones too (the cache's last if full), which they rewrite
        step.slot.copy_(torch.tensor(self.lengths).clamp(max=nc.sequence_length - 1))
        index = torch.tensor(slots)
        step.ids[index, 0] = torch.tensor(token_ids)
        step.positions[:, 0] = step.slot
        cache.key_valid[index, step.slot[index]] = True
        inputs = [step.ids, step.positions, step.slot, cache.valid_window(window), step.last, cache.kv, step.slots]
        if nc.on_device_sampling:
            rows = torch.zeros(nc.batch_size, len(SAMPLING_FIELDS))
            if sampling is not None:
                rows[index] = sampling
            inputs.append(rows)
        return inputs

    def free(self, slot: int) -> None:
        """Slot `slot` holds nothing: the next prefill starts it from slot 0."""
        self.lengths[slot] = 0
        self.cache.key_valid[slot] = False
