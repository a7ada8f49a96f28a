"""Continuous batching over the engine's slots: requests join as slots free up, long prompts are encoded in chunks
between decode steps, and each request stops on its own (EOS, a stop string, max_tokens, cancellation).

`Scheduler.step()` runs one iteration - admit, prefill within the token budget, one decode step for every decoding
slot - and returns what each request produced. It knows no server: server/worker.py drives it in the engine's
process, and tests drive it directly.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Optional, Sequence

import torch

from .engine import Engine
from .modeling.sampling import MAX_TOP_K, sample_tokens


def _pick(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each row's next token from its logits on the host (greedy rows: argmax, without sampling's sorts)."""
    if bool((rows[:, 2] <= 0).all()):
        return logits.argmax(-1)
    return sample_tokens(logits, rows)


MAX_SEED = (1 << 63) - 1  # torch generators take 64-bit seeds


class InvalidRequest(ValueError):
    """A request no export of these shapes can serve: `field` is the request field at fault (OpenAI's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class QueueFull(Exception):
    """More requests than the slots and the waiting queue hold."""


@dataclasses.dataclass
class Request:
    """A generation request: prompt token ids and how to pick and stop."""

    prompt: Sequence[int]
    max_tokens: int
    request_id: str = ""
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()  # EOS and the like: stop, not part of the text
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one

    def sampling_row(self, generator: Optional[torch.Generator], vocab_size: int) -> torch.Tensor:
        """The request as the sampling function's row (modeling/sampling.py), with a fresh uniform draw."""
        top_k = self.top_k if 0 < self.top_k < vocab_size else 0
        if top_k == 0 and self.top_p < 1.0:  # nucleus sampling among the most likely MAX_TOP_K tokens
            top_k = min(MAX_TOP_K, vocab_size)
        uniform = float(torch.rand((), generator=generator)) if self.temperature > 0 else 0.0
        return torch.tensor([[float(top_k), float(self.top_p), float(self.temperature), uniform]])


@dataclasses.dataclass
class Output:
    """What one request produced in one step: new token ids, the text they complete (held back while it may be the
    start of a stop string or of a multi-byte character), and the finish reason once it is done."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None  # "stop", "length", "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass
class _Running:
    request: Request
    slot: int
    generator: Optional[torch.Generator]
    encoding: list[int] = dataclasses.field(default_factory=list)  # what prefill writes into the slot
    prefilled: int = 0  # tokens of `encoding` in the cache
    generated: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # the text sent so far
    next_token: Optional[int] = None  # the last token picked, fed in the next decode step
    long_rope: bool = False  # the slot was encoded with LongRoPE's long frequencies

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.encoding)


def check_request(request: Request, sequence_length: int, vocab_size: int) -> None:
    """Raise InvalidRequest naming the field and the limit where `request` cannot be served by an export of
    `sequence_length` and `vocab_size`."""
    prompt = len(request.prompt)
    if not prompt:
        raise InvalidRequest("prompt", "prompt: empty; a request needs at least one token.")
    if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise InvalidRequest("max_tokens", f"max_tokens: {request.max_tokens!r}; it must be an integer >= 1.")
    if prompt + request.max_tokens > sequence_length:
        raise InvalidRequest("max_tokens", f"max_tokens: {request.max_tokens} after a prompt of {prompt} tokens "
                             f"makes {prompt + request.max_tokens}, more than this model's sequence_length "
                             f"({sequence_length}): use max_tokens <= {max(sequence_length - prompt, 0)} or a "
                             f"shorter prompt.")
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"prompt: token id {bad[0]} is outside the vocabulary (0 to "
                                       f"{vocab_size - 1}).")
    if request.top_k < 0 or MAX_TOP_K < request.top_k < vocab_size:
        raise InvalidRequest("top_k", f"top_k: {request.top_k}; this server samples among at most {MAX_TOP_K} "
                                      f"tokens (0 or -1: no top-k).")
    if not 0.0 < request.top_p <= 1.0:
        raise InvalidRequest("top_p", f"top_p: {request.top_p}; it must be in (0, 1].")
    if not 0 <= request.temperature < float("inf"):
        raise InvalidRequest("temperature", f"temperature: {request.temperature}; it must be a finite number >= 0 "
                                            f"(0: greedy).")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise InvalidRequest("seed", f"seed: {request.seed}; it must be between 0 and 2**63 - 1.")


class Scheduler:
    """One engine's requests. `max_waiting`: requests that may wait for a slot (beyond that `add` raises QueueFull);
    `prefill_budget`: while other slots decode, the most prompt tokens the graphs compute between two of their steps
    (a chunk counts as the size of the graph that takes it, padding included; at least one chunk; default: the
    smallest context bucket), so a long prompt is spread over several steps instead of stalling them. With no slot
    decoding, prompts are encoded in the largest chunks."""

    def __init__(self, engine: Engine, tokenizer=None, max_waiting: int = 16, prefill_budget: Optional[int] = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_waiting = max_waiting
        self.prefill_budget = prefill_budget or engine.chunk(engine.neuron_config.sequence_length, limit=1)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, _Running] = {}
        self._free = list(range(engine.slots))
        self._cancelled: set[str] = set()
        self._ids = itertools.count()

    @property
    def capacity(self) -> int:
        return self.engine.slots + self.max_waiting

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> str:
        """Queue `request` (checked); its id (given, or a new one). QueueFull when the slots and queue are full."""
        check_request(request, self.engine.neuron_config.sequence_length, self.engine.vocab_size)
        if len(self) >= self.capacity:
            raise QueueFull(f"{len(self)} requests running or waiting: the limit is {self.capacity} "
                            f"({self.engine.slots} slots + {self.max_waiting} waiting).")
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        self.waiting.append(request)
        return request.request_id

    def cancel(self, request_id: str) -> None:
        """Stop `request_id` at the next step (its slot is freed; it gets a last Output, finish_reason "cancelled")."""
        self._cancelled.add(request_id)

    def step(self) -> list[Output]:
        """One iteration: cancellations, admissions into free slots, prefill chunks within the budget, then one
        decode step for every slot that is decoding. Returns each request's output of this step."""
        outputs = self._cancel()
        while self.waiting and self._free:
            request = self.waiting.popleft()
            slot = self._free.pop(0)
            generator = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
            self.running[request.request_id] = _Running(request, slot, generator, list(request.prompt))
            self.engine.free(slot)
        after = self.engine.rope_long_after
        for run in self.running.values():
            if after and run.decoding and not run.long_rope and self.engine.lengths[run.slot] >= after:
                # LongRoPE: the sequence passes the switch, so it is encoded again with the long frequencies (as
                # generate does alone); the next token comes from that prefill
                run.encoding, run.prefilled = list(run.request.prompt) + run.generated, 0
                self.engine.free(run.slot)
        # while slots decode, their next step waits for the prefill: within the budget; else nothing waits. One chunk
        # that a fused graph takes rides along with the decode step (one call: the weights read once for both).
        # The budget counts the tokens the graphs compute: a chunk alone its prefill graph's size, a fused one the
        # fused graphs' chunk. A chunk past what is left waits for the next step, unless it is the step's first.
        limit = self.prefill_budget if any(run.decoding for run in self.running.values()) else None
        spent, fused = 0, None  # fused: (run, chunk ids, sampling row)
        encoding = [run for run in self.running.values() if not run.decoding]
        while encoding and (limit is None or spent < limit):
            run = encoding[0]
            ids, row = self._chunk(run, None if limit is None else limit - spent)
            fusable = fused is None and limit is not None and len(ids) <= self.engine.fused_chunk
            cost = self.engine.fused_chunk if fusable else self.engine.prefill_size(len(ids))
            if limit is not None and spent and spent + cost > limit:
                break
            spent += cost
            if fusable:
                fused = (run, ids, row)
            else:
                self._prefilled(run, ids, row, self.engine.prefill(run.slot, ids, row), outputs)
            if fusable or run.decoding:
                encoding.pop(0)
        decoding = [run for run in self.running.values() if run.decoding and run.next_token is not None]
        if decoding:
            rows = torch.cat([run.request.sampling_row(run.generator, self.engine.vocab_size) for run in decoding])
            slots, tokens = [run.slot for run in decoding], [run.next_token for run in decoding]
            if fused is not None and self.engine.fused_window(slots, fused[0].slot, len(fused[1])):
                (logits, picked), chunk = self.engine.fused_step(slots, tokens, rows, fused[0].slot, fused[1],
                                                                  fused[2])
                self._prefilled(*fused, chunk, outputs)
                fused = None
            else:
                logits, picked = self.engine.step(slots, tokens, rows)
            picked = picked if picked is not None else _pick(logits, rows)
            for run, token in zip(decoding, picked.tolist()):
                self._emit(run, token, outputs)
        if fused is not None:  # no fused graph takes it: the chunk alone
            self._prefilled(*fused, self.engine.prefill(fused[0].slot, fused[1], fused[2]), outputs)
        return outputs

    def _chunk(self, run: _Running, limit: Optional[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The next prefill chunk of `run` (ids) and, where it is the sequence's last, the sampling row of the token
        it gives."""
        sequence = run.encoding
        k = self.engine.chunk(len(sequence) - run.prefilled, limit, total=len(sequence))
        ids = torch.tensor(sequence[run.prefilled:run.prefilled + k], dtype=torch.long)
        last = run.prefilled + k == len(sequence)
        return ids, run.request.sampling_row(run.generator, self.engine.vocab_size) if last else None

    def _prefilled(self, run: _Running, ids: torch.Tensor, row: Optional[torch.Tensor], result: tuple,
                   outputs: list[Output]) -> None:
        """Record the chunk `ids` of `run` as encoded, with the engine's (logits, tokens) `result` of it."""
        logits, tokens = result
        after = self.engine.rope_long_after
        run.prefilled += len(ids)
        run.long_rope = bool(after) and len(run.encoding) > after
        if row is not None:
            token = tokens if tokens is not None else _pick(logits, row)
            self._emit(run, int(token[0]), outputs)

    def _emit(self, run: _Running, token: int, outputs: list[Output]) -> None:
        """Record `token` for `run`: its output of this step, and its end where it stops."""
        request = run.request
        finish = None
        if token in request.stop_token_ids:
            finish, new_ids = "stop", []
        else:
            run.generated.append(token)
            new_ids = [token]
        if finish is None and (len(run.generated) >= request.max_tokens
                               or self.engine.lengths[run.slot] >= self.engine.neuron_config.sequence_length):
            finish = "length"
        text, stopped = self._text(run, finish is not None)
        if stopped:
            finish = "stop"
        run.next_token = token
        outputs.append(Output(request.request_id, new_ids, text, finish, len(request.prompt), len(run.generated)))
        if finish is not None:
            self._release(run)

    def _text(self, run: _Running, final: bool) -> tuple[str, bool]:
        """The text new since the last output, and whether a stop string ended it."""
        if self.tokenizer is None:
            return "", False
        full = self.tokenizer.decode(run.generated, skip_special_tokens=True)
        stop = run.request.stop
        hits = [i for i in (full.find(s, max(len(run.text) - len(s) + 1, 0)) for s in stop) if i >= 0]
        if hits:
            full, final, stopped = full[:min(hits)], True, True
        else:
            stopped = False
        end = len(full)
        if not final:
            if full.endswith("\ufffd"):  # a character whose bytes are not all decoded yet
                end = len(full.rstrip("\ufffd"))
            for s in stop:  # hold back what may be the start of a stop string
                for n in range(min(len(s) - 1, end), 0, -1):
                    if full[:end].endswith(s[:n]):
                        end -= n
                        break
        end = max(end, len(run.text))
        delta, run.text = full[len(run.text):end], full[:end]
        return delta, stopped

    def _cancel(self) -> list[Output]:
        outputs = []
        for request_id in self._cancelled:
            run = self.running.get(request_id)
            if run is not None:
                self._release(run)
            else:
                kept = [r for r in self.waiting if r.request_id != request_id]
                if len(kept) == len(self.waiting):
                    continue
                self.waiting = deque(kept)
            outputs.append(Output(request_id, [], "", "cancelled"))
        self._cancelled.clear()
        return outputs

    def _release(self, run: _Running) -> None:
        del self.running[run.request.request_id]
        self.engine.free(run.slot)
        self._free.append(run.slot)

    def generate(self, requests: list[Request]) -> dict[str, list[Output]]:
        """Serve `requests` to the end (all queued at once, beyond the slots too): each request's outputs in order."""
        results: dict[str, list[Output]] = {}
        pending = deque(requests)
        while pending or self.running or self.waiting:
            while pending and len(self) < self.capacity:
                results[self.add(pending.popleft())] = []
            for output in self.step():
                results[output.request_id].append(output)
        return results

