"""The scheduler and the server's request checks against a scripted engine (no graphs): admission, the prefill
budget between decode steps, stop conditions, cancellation, backpressure; the serve command's flag checks and the
Ray Serve deployment's settings."""

from __future__ import annotations

import types

import pytest
import torch

from optimum_neuronx.scheduler import InvalidRequest, QueueFull, Request, Scheduler, check_request
from serving import byte_tokenizer

VOCAB, SEQUENCE, CHUNK = 256, 64, 8


class ScriptedEngine:
    """The Engine's slot API; each slot's next token is `script[request's first prompt token]`, in order. Records
    every call."""

    def __init__(self, scripts: dict[int, list[int]], slots: int = 2, fused_chunk: int = 0, fused_up_to: int = 0):
        self.slots, self.vocab_size, self.rope_long_after = slots, VOCAB, 0
        self.fused_chunk, self.fused_up_to = fused_chunk, fused_up_to  # fused graphs: chunk size, widest window
        self.neuron_config = types.SimpleNamespace(sequence_length=SEQUENCE)
        self.lengths = [0] * slots
        self.scripts, self.calls, self._next = scripts, [], {}

    def chunk(self, remaining: int, limit=None, total: int = 0) -> int:
        return min(remaining, CHUNK if limit is None else max(min(limit, CHUNK), 4))

    def prefill_size(self, k: int) -> int:  # prefill graphs of 4 and CHUNK tokens
        return 4 if k <= 4 else CHUNK

    def _logits(self, slot: int) -> torch.Tensor:
        logits = torch.zeros(1, VOCAB)
        logits[0, self._next[slot].pop(0)] = 1.0
        return logits

    def prefill(self, slot, token_ids, sampling=None):
        self.calls.append(("prefill", slot, len(token_ids)))
        if self.lengths[slot] == 0:
            self._next[slot] = list(self.scripts[int(token_ids[0])])
        self.lengths[slot] += len(token_ids)
        return self._logits(slot), None

    def step(self, slots, token_ids, sampling=None):
        self.calls.append(("step", tuple(slots)))
        for slot in slots:
            self.lengths[slot] += 1
        return torch.cat([self._logits(slot) for slot in slots]), None

    def fused_window(self, slots, chunk_slot, k):
        end = max(max(self.lengths[s] for s in slots), self.lengths[chunk_slot] + k - 1)
        return self.fused_up_to if k <= self.fused_chunk and end < self.fused_up_to else None

    def fused_step(self, slots, token_ids, sampling, chunk_slot, chunk_ids, chunk_sampling=None):
        calls = len(self.calls)
        stepped, chunk = self.step(slots, token_ids, sampling), self.prefill(chunk_slot, chunk_ids, chunk_sampling)
        self.calls[calls:] = [("fused", tuple(slots), chunk_slot, len(chunk_ids))]
        return stepped, chunk

    def free(self, slot):
        self.calls.append(("free", slot))
        self.lengths[slot] = 0


def _text(outputs) -> str:
    return "".join(o.text for o in outputs)


def test_requests_stop_at_eos_max_tokens_and_stop_strings_each_on_its_own():
    tokenizer = byte_tokenizer()
    script = list(b"Hello STOP world")
    engine = ScriptedEngine({10: [65, 66, 2, 67], 11: [70] * 10, 12: script})
    scheduler = Scheduler(engine, tokenizer, max_waiting=4)
    results = scheduler.generate([Request([10, 3], 9, "eos", stop_token_ids=(2,)),
                                  Request([11, 3, 4], 3, "length"),
                                  Request([12], 20, "stop-string", stop=("STOP",))])
    assert _text(results["eos"]) == "AB" and results["eos"][-1].finish_reason == "stop"
    assert results["eos"][-1].completion_tokens == 2  # EOS is not part of the completion
    assert _text(results["length"]) == "FFF" and results["length"][-1].finish_reason == "length"
    assert _text(results["stop-string"]) == "Hello " and results["stop-string"][-1].finish_reason == "stop"
    # the text streamed never showed a piece of the stop string before it was ruled out or confirmed
    assert all("S" not in o.text for o in results["stop-string"])
    assert len([call for call in engine.calls if call[0] == "free"]) == 6  # each request: admitted, released
    assert not scheduler.running and not scheduler.waiting


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    engine = ScriptedEngine({20: [70] * 8, 21: [71] * 8})
    scheduler = Scheduler(engine, max_waiting=2, prefill_budget=CHUNK)
    scheduler.add(Request([20, 3], 6, "short"))
    scheduler.step()  # short: prefilled (its first token) and one decode step
    scheduler.add(Request([21] + [3] * 30, 2, "long"))  # 31 tokens: four chunks of <= 8
    while scheduler.running:
        scheduler.step()
    calls = [c for c in engine.calls if c[0] != "free"]
    long_chunks = [i for i, c in enumerate(calls) if c == ("prefill", 1, CHUNK) or c[:2] == ("prefill", 1)]
    assert [calls[i][2] for i in long_chunks] == [8, 8, 8, 7]
    # every chunk of the long prompt is followed by a decode step of the short request: it never waits for all four
    assert all(calls[i + 1][0] == "step" and 0 in calls[i + 1][1] for i in long_chunks[:3])


def test_with_fused_graphs_each_chunk_rides_along_with_a_decode_step_in_one_call():
    # The same requests as above: the long prompt's chunks go into the short request's decode steps (one fused call
    # each) while their positions fit the fused graphs (up to slot 30); the last chunk, past them, runs on its own
    # after the step. The texts are those of the unfused schedule.
    def serve(**fused):
        engine = ScriptedEngine({20: list(range(70, 78)), 21: list(range(80, 88))}, **fused)
        scheduler = Scheduler(engine, max_waiting=2, prefill_budget=CHUNK)
        outputs = {"short": [], "long": []}
        scheduler.add(Request([20, 3], 8, "short"))
        for o in scheduler.step():
            outputs[o.request_id].append(o.token_ids)
        scheduler.add(Request([21] + [3] * 30, 2, "long"))
        while scheduler.running:
            for o in scheduler.step():
                outputs[o.request_id].append(o.token_ids)
        return outputs, [c for c in engine.calls if c[0] != "free"]

    alone, _ = serve()
    together, calls = serve(fused_chunk=CHUNK, fused_up_to=30)
    assert together == alone
    assert calls[2:6] == [("fused", (0,), 1, 8), ("fused", (0,), 1, 8), ("fused", (0,), 1, 8), ("step", (0,))]
    assert calls[6] == ("prefill", 1, 7)  # slots 24..30 reach past the fused graphs' window: the chunk alone


def test_the_budget_counts_the_tokens_the_graphs_compute():
    # A 3-token prompt fused into a step costs the fused graphs' whole chunk (8 = the budget): the next prompt's first
    # chunk waits for the next step instead of running alone beside it (a second call holding the decode step back).
    engine = ScriptedEngine({40: [70] * 8, 41: [71] * 8, 42: [72] * 8}, slots=3, fused_chunk=CHUNK, fused_up_to=64)
    scheduler = Scheduler(engine, max_waiting=2, prefill_budget=CHUNK)
    scheduler.add(Request([40, 3], 6, "decoding"))
    scheduler.step()
    scheduler.add(Request([41, 3, 4], 2, "short"))
    scheduler.add(Request([42] + [3] * 12, 2, "long"))
    steps = []
    for _ in range(3):
        engine.calls.clear()
        scheduler.step()
        steps.append([c for c in engine.calls if c[0] != "free"])
    assert steps == [[("fused", (0,), 1, 3)], [("fused", (0, 1), 2, 8)], [("fused", (0,), 2, 5)]]  # short: done


def test_with_no_slot_decoding_a_prompt_is_encoded_in_the_largest_chunks_at_once():
    engine = ScriptedEngine({22: [70] * 4})
    scheduler = Scheduler(engine, prefill_budget=4)
    scheduler.add(Request([22] + [3] * 20, 2, "alone"))
    scheduler.step()
    assert engine.calls[1:4] == [("prefill", 0, 8), ("prefill", 0, 8), ("prefill", 0, 5)]  # nobody waits on it


def test_cancellation_frees_the_slot_and_a_waiting_request_takes_it():
    engine = ScriptedEngine({30: [70] * 40, 31: [71] * 40, 32: [72] * 4}, slots=2)
    scheduler = Scheduler(engine, max_waiting=1)
    for name, first in (("a", 30), ("b", 31), ("c", 32)):
        scheduler.add(Request([first], 30, name))
    with pytest.raises(QueueFull, match=r"3 requests running or waiting: the limit is 3 \(2 slots \+ 1 waiting\)"):
        scheduler.add(Request([30], 5, "d"))
    scheduler.step()
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.cancel("a")
    outputs = scheduler.step()
    assert any(o.request_id == "a" and o.finish_reason == "cancelled" for o in outputs)
    assert scheduler.running["c"].slot == 0  # a's slot, freed and reused in the same step
    assert ("free", 0) in engine.calls


def test_seeded_requests_draw_the_same_tokens():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    request = Request([5], 4, temperature=1.0, top_k=20, top_p=0.9, seed=11)
    rows = [[request.sampling_row(torch.Generator().manual_seed(11), VOCAB) for _ in range(3)] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*rows))
    from optimum_neuronx.modeling.sampling import sample_tokens

    assert sample_tokens(logits, rows[0][0]) == sample_tokens(logits, rows[1][0])
    greedy = Request([5], 4).sampling_row(None, VOCAB)
    assert greedy[0, 2] == 0 and sample_tokens(logits, greedy) == logits.argmax()


@pytest.mark.parametrize("request_, field, message", [
    (Request([5] * 30, 40), "max_tokens", r"max_tokens: 40 after a prompt of 30 tokens makes 70, more than this model's "
                            r"sequence_length \(64\): use max_tokens <= 34"),
    (Request([5, 300], 4), "prompt", r"prompt: token id 300 is outside the vocabulary \(0 to 255\)"),
    (Request([], 4), "prompt", r"prompt: empty"),
    (Request([5], 0), "max_tokens", r"max_tokens: 0; it must be an integer >= 1"),
    (Request([5], 4, top_p=0.0), "top_p", r"top_p: 0.0; it must be in \(0, 1\]"),
])
def test_requests_the_export_cannot_serve_are_refused_naming_the_field(request_, field, message):
    with pytest.raises(InvalidRequest, match=message) as refused:
        check_request(request_, SEQUENCE, VOCAB)
    assert refused.value.field == field  # the server's 400 names it as `param`


def test_protocol_fields():
    from optimum_neuronx.server.protocol import RequestError, check_fields, to_request

    with pytest.raises(RequestError, match=r"n: 2 is not supported; this server takes n=1 only") as refused:
        check_fields({"model": "m", "prompt": "x", "n": 2}, chat=False)
    assert refused.value.param == "n" and refused.value.status == 400
    with pytest.raises(RequestError, match=r"frobnicate: unknown field for chat completions"):
        check_fields({"model": "m", "messages": [], "frobnicate": 1}, chat=True)
    check_fields({"model": "m", "prompt": "x", "n": 1, "logprobs": None, "user": "u"}, chat=False)
    request = to_request({"max_tokens": 5, "stop": "\n", "temperature": 0, "top_k": -1, "seed": 3,
                          "stop_token_ids": [7]}, [1, 2], (2,), 60, "r")
    assert (request.max_tokens, request.stop, request.top_k, request.seed, request.stop_token_ids) == \
        (5, ("\n",), 0, 3, (2, 7))
    assert to_request({"ignore_eos": True}, [1], (2,), 60, "r").stop_token_ids == ()
    assert to_request({}, [1], (2,), 60, "r").max_tokens == 60  # what is left of the sequence
    with pytest.raises(RequestError, match=r"stop: .* up to 4 non-empty strings"):
        to_request({"stop": ["a", ""]}, [1], (2,), 60, "r")
    # what a hostile client might send: each refused naming the field and the limit, before it reaches the engine
    for body, message in (({"stop": "x" * 513}, r"stop: .* of at most 512 characters"),
                          ({"stop_token_ids": list(range(65))}, r"stop_token_ids: .* at most 64 token ids"),
                          ({"seed": 1 << 70}, r"seed: .* it must be between 0 and 9223372036854775807"),
                          ({"seed": -1}, r"seed: -1; it must be between 0"),
                          ({"temperature": float("nan")}, r"temperature: nan is not a finite number"),
                          ({"max_tokens": 2.5}, r"max_tokens: 2.5 is not an integer")):
        with pytest.raises(RequestError, match=message):
            to_request(body, [1], (2,), 60, "r")
    with pytest.raises(ValueError, match=r"temperature: inf; it must be a finite number >= 0"):
        check_request(Request([5], 4, temperature=float("inf")), SEQUENCE, VOCAB)


def test_serve_flags_must_match_the_export():
    from optimum_neuronx import NeuronConfig
    from optimum_neuronx.server.options import check_export_flags

    export = NeuronConfig(batch_size=4, sequence_length=64, context_buckets=[16], token_buckets=[32, 64],
                          continuous_batching=True)
    check_export_flags(export, None, None, None)
    check_export_flags(export, 4, 64, 1)
    with pytest.raises(ValueError, match=r"not compiled for --batch_size 8 \(compiled: 4\), --sequence_length 128 "
                                         r"\(compiled: 64\): pass --batch_size 4 --sequence_length 64 "
                                         r"--tensor_parallel_size 1"):
        check_export_flags(export, 8, 128, None)
    with pytest.raises(ValueError, match=r"re-export it with\s+--continuous_batching"):
        check_export_flags(NeuronConfig(batch_size=4, sequence_length=64), None, None, None)


def test_ray_serve_deployment_settings():
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from optimum_neuronx.server.ray_app import deployment

    replicas = deployment("export-dir", {}, "name", replicas=2, batch_size=4, max_waiting=3, neuron_cores=2)
    assert replicas.num_replicas == 2 and replicas.max_ongoing_requests == 4 + 3
    assert replicas.max_queued_requests == 4
    assert replicas.ray_actor_options == {"num_cpus": 1.0, "resources": {"neuron_cores": 2}}
    config = replicas.backpressure_config
    assert (config.status_code, config.retry_after_s) == (429, 1)


def test_serve_help_matches_docs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-m", "optimum_neuronx.serve", "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "80"}, timeout=120)
    assert result.returncode == 0
    documented = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    assert result.stdout.replace("python -m optimum_neuronx.serve", "optimum-cli neuron serve").strip() in documented
