"""A foreign export's shapes and config fields are data an attacker chose: each hostile value is refused with a
clear error before anything of that size is allocated, compiled or built."""

from __future__ import annotations

import json
import shutil

import pytest

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.artifacts import ArtifactError
from optimum_neuronx.configuration import MAX_GRAPHS, NeuronConfig
from test_trust import restamp


@pytest.fixture
def foreign(saved_tiny_llama, tmp_path):
    directory = tmp_path / "foreign"
    shutil.copytree(saved_tiny_llama, directory)
    return directory


def _edit(directory, name, change):
    path = directory / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    restamp(directory)


@pytest.mark.parametrize("field, value", [("sequence_length", 1 << 25), ("batch_size", 10 ** 7)])
def test_shapes_past_this_machines_memory_are_refused_before_allocating(foreign, field, value):
    def change(meta):
        meta["neuron_config"][field] = value
        meta["neuron_config"]["context_buckets"] = [16]
        meta["neuron_config"]["token_buckets"] = [32, meta["neuron_config"]["sequence_length"]]
    _edit(foreign, "neuron_config.json", change)
    _edit(foreign, "config.json", lambda config: config.update(max_position_embeddings=1 << 26))
    with pytest.raises(ValueError, match=r"needs [\d.]+ GiB of this machine's memory, but [\d.]+ GiB is available: "
                                         r"lower batch_size or sequence_length"):
        NeuronModelForCausalLM.from_pretrained(foreign)


def test_thousands_of_buckets_are_refused(foreign):
    _edit(foreign, "neuron_config.json", lambda meta: meta["neuron_config"].update(
        context_buckets=list(range(1, 2049)), sequence_length=4096, token_buckets=[4096]))
    with pytest.raises(ArtifactError, match=rf"2048 context and 1 token buckets make 2049 graphs to compile, more "
                                            rf"than {MAX_GRAPHS}"):
        NeuronModelForCausalLM.from_pretrained(foreign)
    with pytest.raises(ValueError, match=r"more than 64: pass fewer context_buckets"):
        NeuronConfig(sequence_length=4096, context_buckets=list(range(1, 100)))


def test_a_million_layers_over_weights_for_two_is_refused_at_once(foreign):
    _edit(foreign, "config.json", lambda config: config.update(num_hidden_layers=10 ** 6))
    with pytest.raises(ArtifactError, match=r"config.json gives 1000000 layers but the weights hold 2"):
        NeuronModelForCausalLM.from_pretrained(foreign)


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("num_hidden_layers", -1),
                                          ("hidden_size", 1 << 40), ("vocab_size", "256")])
def test_damaged_config_fields_are_named(foreign, field, value):
    _edit(foreign, "config.json", lambda config: config.update({field: value}))
    with pytest.raises(ValueError, match=rf"config.{field} = {value!r} must be a positive integer|{field}"):
        NeuronModelForCausalLM.from_pretrained(foreign)


def test_deeply_nested_json_is_a_clear_error(foreign, tmp_path):
    (foreign / "neuron_config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ArtifactError, match=r"neuron_config.json is unreadable \(RecursionError"):
        NeuronModelForCausalLM.from_pretrained(foreign)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(ValueError, match=r"config.json nests too deeply|is not a valid JSON|RecursionError"):
        NeuronModelForCausalLM.from_pretrained(checkpoint, export=True)
