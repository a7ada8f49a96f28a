"""Speculative decoding: verification graphs score the drafted tokens in one pass, rejected ones are rolled back."""

import collections

import pytest
import torch

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.configuration import NeuronConfig

from conftest import tiny_export

MODEL = "llama"
SPECULATION = 3
# A prompt that repeats itself: prompt lookup finds drafts in it.
PROMPT = torch.tensor([[21, 22, 23, 24, 25, 21, 22, 23, 24, 25, 21, 22]])


@pytest.fixture(scope="module")
def speculative(tiny_checkpoint):
    """The tiny Llama at batch 1 with verification graphs for 3 drafted tokens; graph calls counted by name."""
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL), export=True,
                                                   **tiny_export(MODEL, batch_size=1),
                                                   speculation_length=SPECULATION)
    calls = collections.Counter()

    def counted(name, graph):
        def call(inputs):
            calls[name] += 1
            return graph(inputs)
        return call

    # the ids input each compiled graph takes, [batch, tokens], read before the calls are wrapped
    model.ids_shapes = {name: graph.input_signature[0][0] for name, graph in model._graphs.items()}
    model._engine.graphs = {name: counted(name, graph) for name, graph in model._graphs.items()}  # it calls them
    model.graph_calls = calls
    return model


def test_export_has_a_verification_graph_per_token_bucket(speculative):
    # (continuous batching: the context bucket is a one-row prefill graph)
    assert sorted(speculative._graphs) == ["prefill_16", "token_32", "token_64", "verify_32", "verify_64"]
    # each verification graph, as compiled, takes the last accepted token and SPECULATION drafted ones in one pass
    assert speculative.ids_shapes == {"prefill_16": [1, 16], "token_32": [1, 1], "token_64": [1, 1],
                                      "verify_32": [1, SPECULATION + 1], "verify_64": [1, SPECULATION + 1]}


@pytest.mark.parametrize("assistant", ["prompt_lookup", "eager_twin", "other_eager", "compiled_other"])
def test_speculation_matches_plain_greedy(speculative, reference_model, compiled_model, assistant):
    """Drafts from the prompt, from the eager twin (all accepted), from another random model (mostly rejected: the
    cache rolls back), from another compiled model; 40 new tokens cross the 32 -> 64 token bucket. Every drafted
    token goes through a verification graph: no token graph call per drafted token."""
    options = {"prompt_lookup": lambda: dict(prompt_lookup_num_tokens=SPECULATION),
               "eager_twin": lambda: dict(assistant_model=reference_model(MODEL)),
               "other_eager": lambda: dict(assistant_model=reference_model("qwen2")),
               "compiled_other": lambda: dict(assistant_model=compiled_model("qwen2"))}[assistant]()
    expected = reference_model(MODEL).generate(PROMPT, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    speculative.graph_calls.clear()
    actual = speculative.generate(PROMPT, max_new_tokens=40, min_new_tokens=40, do_sample=False, **options)
    assert torch.equal(actual, expected)
    calls = speculative.graph_calls
    assert calls["verify_32"] + calls["verify_64"] > 0
    # Each pass yields at least one token: verification passes plus single steps never exceed the new tokens.
    assert calls["verify_32"] + calls["verify_64"] + calls["token_32"] + calls["token_64"] <= 40
    if assistant == "eager_twin":  # every draft accepted: several tokens a pass
        assert calls["verify_32"] + calls["verify_64"] + calls["token_32"] + calls["token_64"] < 25


def test_verification_logits_and_rollback(speculative, reference_model):
    """Teacher-forced: a pass over 4 new tokens gives eager's logits at each; rolling 2 back and scoring other tokens
    gives eager's logits for the new sequence (the rejected tokens' K/V are never attended to)."""
    ids = torch.arange(3, 23)[None]
    other = torch.tensor([[91, 92, 93]])
    with torch.no_grad():
        expected = reference_model(MODEL)(ids).logits
        expected_other = reference_model(MODEL)(torch.cat([ids[:, :14], other], 1)).logits
    handle = speculative(ids[:, :12]).past_key_values
    speculative.graph_calls.clear()
    logits = speculative(ids[:, 12:16], past_key_values=handle, logits_to_keep=0).logits
    assert speculative.graph_calls == {"verify_32": 1}
    assert (logits - expected[:, 12:16]).abs().max().item() < 1e-4
    handle.crop(-2)
    assert handle.get_seq_length() == 14
    logits = speculative(other, past_key_values=handle, logits_to_keep=0).logits
    assert (logits - expected_other[:, 14:]).abs().max().item() < 1e-4
    # More tokens than a pass takes: passes of 4, then the rest
    handle = speculative(ids[:, :5]).past_key_values
    speculative.graph_calls.clear()
    logits = speculative(ids[:, 5:14], past_key_values=handle, logits_to_keep=0).logits
    assert speculative.graph_calls == {"verify_32": 2, "token_32": 1}
    assert (logits - expected[:, 5:14]).abs().max().item() < 1e-4


def test_near_the_end_of_the_cache_drafts_are_scored_one_step_each(speculative, reference_model):
    """A pass that would write past sequence_length falls back to single decode steps; tokens stay eager's."""
    prompt = torch.arange(3, 16)[None]
    expected = reference_model(MODEL).generate(prompt, max_new_tokens=51, min_new_tokens=51, do_sample=False)
    actual = speculative.generate(prompt, max_new_tokens=51, min_new_tokens=51, do_sample=False,
                                  assistant_model=reference_model(MODEL))
    assert torch.equal(actual, expected)


def test_speculation_errors(speculative, reference_model, left_padded_batch, tiny_checkpoint):
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens=5 exceeds the 3 drafted tokens .*speculation_length=3"):
        speculative.generate(PROMPT, max_new_tokens=4, prompt_lookup_num_tokens=5)
    with pytest.raises(ValueError, match=r"one sequence at a time, but this request has 3 prompts"):
        ids, mask = left_padded_batch
        speculative.generate(ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_num_tokens=2)
    draft = reference_model(MODEL)
    draft.generation_config.num_assistant_tokens = 8
    try:
        with pytest.raises(ValueError, match=r"num_assistant_tokens=8 exceeds the 3 drafted tokens"):
            speculative.generate(PROMPT, max_new_tokens=4, assistant_model=draft)
    finally:
        draft.generation_config.num_assistant_tokens = None
    with pytest.raises(ValueError, match=r"speculation_length=2 needs batch_size=1 .* got batch_size=3"):
        NeuronConfig(batch_size=3, sequence_length=64, speculation_length=2)
    with pytest.raises(ValueError, match=r"speculation_length=63 leaves no room in sequence_length=64"):
        NeuronConfig(sequence_length=64, speculation_length=63)
    with pytest.raises(ValueError, match=r"speculation_length must be a non-negative integer"):
        NeuronConfig(speculation_length=-1)


def test_speculation_is_refused_for_window_caches(tiny_checkpoint):
    checkpoint = tiny_checkpoint("mistral")  # a 12-token window on every layer: its cache is a ring
    with pytest.raises(ValueError, match=r"keep only their last 12 tokens .* cannot be rolled back"):
        NeuronModelForCausalLM.from_pretrained(checkpoint, export=True, batch_size=1, sequence_length=64,
                                               context_buckets=[16], token_buckets=[64], speculation_length=2)


def test_export_without_verification_graphs_warns(compiled_model, caplog):
    import logging

    model = compiled_model(MODEL)
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        model.generate(PROMPT, max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert "no verification graphs (speculation_length=0)" in caplog.text
