"""The export plan is computed once and recorded: neuron_config.json holds the decoder spec and the backend stamp,
read back typed (stamp.ExportStamp) when the export loads, not derived again from config.json; format 7 exports
(no spec recorded) still load; a checkpoint is loaded in the export's dtype unless it is quantized."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import left_padded_prompts, tiny_export
from test_trust import restamp
from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.artifacts import ArtifactError, read_artifact
from optimum_neuronx.backends import get_backend
from optimum_neuronx.configuration import NeuronConfig
from optimum_neuronx.exporters.export_config import ExportConfig
from optimum_neuronx.exporters.plan import plan_export
from optimum_neuronx.modeling.spec import DecoderSpec
from optimum_neuronx.stamp import ExportStamp


def refuse(*args, **kwargs):  # loading must never compile
    raise AssertionError("compilation attempted while loading")


def test_the_stamp_records_the_plan(saved_tiny_llama, tiny_checkpoint):
    stamp = read_artifact(saved_tiny_llama)
    plan = plan_export(str(tiny_checkpoint("llama")), stamp.neuron_config, check_host_memory=False)
    assert stamp.artifact_format == 8 and stamp.model_type == "llama"
    assert stamp.spec == plan.spec and stamp.backend == plan.backend_stamp and stamp.graphs == plan.graphs
    assert ExportStamp.from_json(stamp.to_json()) == dataclasses.replace(stamp, identity="")


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2", "qwen3_moe", "phi3"])
def test_every_spec_reads_back_as_written(tiny_checkpoint, family):
    spec = plan_export(str(tiny_checkpoint(family)), NeuronConfig(**tiny_export(family)),
                       check_host_memory=False).spec
    assert DecoderSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(num_heads="4"), r"num_heads = 4 is not of type int"),
    (lambda d: d.update(num_layers=-1), r"num_layers = -1 is not of type int"),
    (lambda d: d.update(rope_inv_freq=[1.0, "x"]), r"rope_inv_freq = \[1.0, 'x'\] is not of type tuple\[float, \.\.\.\]"),
    (lambda d: d.update(cache_places=[[0, 0]]), r"cache_places .* is not of type tuple\[tuple\[int, int, int\]"),
    (lambda d: d.update(norm="exotic"), r"norm = 'exotic' is none of"),
    (lambda d: d.update(evil=1), r"unknown fields \['evil'\]"),
    (lambda d: d.pop("hidden_size"), r"lacks \['hidden_size'\]"),
])
def test_a_damaged_spec_is_refused_naming_the_field(saved_tiny_llama, tmp_path, change, message):
    directory = tmp_path / "edited"
    shutil.copytree(saved_tiny_llama, directory)
    meta_path = directory / "neuron_config.json"
    meta = json.loads(meta_path.read_text())
    change(meta["model"]["decoder_spec"])
    meta_path.write_text(json.dumps(meta))
    restamp(directory)
    with pytest.raises(ArtifactError, match=message):
        NeuronModelForCausalLM.from_pretrained(directory, trust_remote_code=True)


def test_a_reload_reads_the_spec_instead_of_deriving_it(saved_tiny_llama, compiled_model, monkeypatch):
    monkeypatch.setattr(ExportConfig, "decoder_spec", lambda *a: pytest.fail("the spec was derived at load"))
    monkeypatch.setattr(get_backend("inductor"), "compile", refuse)
    model = NeuronModelForCausalLM.from_pretrained(saved_tiny_llama)
    ids, mask = left_padded_prompts([5, 9], seed=1)
    expected = compiled_model("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)


def test_a_format_7_export_still_loads(saved_tiny_llama, compiled_model, tmp_path, monkeypatch):
    """Format 7 recorded no spec: it is derived from config.json, the graphs load as they are."""
    directory = tmp_path / "format7"
    shutil.copytree(saved_tiny_llama, directory)
    meta_path = directory / "neuron_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["model"]
    meta["artifact_format"] = 7
    meta_path.write_text(json.dumps(meta))
    restamp(directory)
    assert read_artifact(directory).spec is None
    monkeypatch.setattr(get_backend("inductor"), "compile", refuse)
    model = NeuronModelForCausalLM.from_pretrained(directory, trust_remote_code=True)  # not recorded as made here
    ids, mask = left_padded_prompts([4, 7], seed=2)
    expected = compiled_model("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)
    meta["artifact_format"] = 6
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=r"uses artifact format 6; this package reads formats 7, 8"):
        read_artifact(directory)


def test_a_spec_for_another_model_type_is_refused(saved_tiny_llama, tmp_path):
    directory = tmp_path / "retyped"
    shutil.copytree(saved_tiny_llama, directory)
    meta_path = directory / "neuron_config.json"
    meta = json.loads(meta_path.read_text())
    meta["model"]["model_type"] = "qwen2"
    meta_path.write_text(json.dumps(meta))
    restamp(directory)
    with pytest.raises(ArtifactError, match=r"records a qwen2 model but config.json is llama's"):
        NeuronModelForCausalLM.from_pretrained(directory, trust_remote_code=True)


@pytest.mark.parametrize("options, loaded_in", [({"auto_cast_type": "bf16"}, torch.bfloat16),
                                                ({"auto_cast_type": "bf16", "quantization": "int8"}, torch.float32)])
def test_the_checkpoint_is_loaded_in_the_export_dtype_unless_quantizing(tiny_checkpoint, monkeypatch, options,
                                                                         loaded_in):
    from transformers import AutoModelForCausalLM

    from optimum_neuronx.exporters.export import prepare

    original, asked = AutoModelForCausalLM.from_pretrained, []

    def recording(*args, **kwargs):
        asked.append(kwargs.get("dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    prepared = prepare(str(tiny_checkpoint("llama")), NeuronConfig(**tiny_export("llama", **options)))
    assert asked == [loaded_in]
    embed = prepared.decoder.state_dict()["embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16 and embed.device.type == "cpu"


def test_a_rebuild_reads_the_export_once(saved_tiny_llama, compiled_model, tmp_path, monkeypatch, caplog):
    """The trust decision's read is passed on to the rebuild's plan (its source), not read again."""
    import logging

    from optimum_neuronx import artifacts, loading, trust
    from optimum_neuronx.exporters import export as export_module, plan as plan_module

    directory = tmp_path / "from-elsewhere"
    shutil.copytree(saved_tiny_llama, directory)
    monkeypatch.setattr(trust, "provenance", lambda *args: "foreign")  # not produced here: rebuilt
    reads = []

    def counted(path, *args, **kwargs):
        reads.append(Path(path).name)
        return artifacts.read_artifact(path, *args, **kwargs)

    for module in (trust, loading, plan_module, export_module):
        if hasattr(module, "read_artifact"):
            monkeypatch.setattr(module, "read_artifact", counted)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        model = NeuronModelForCausalLM.from_pretrained(directory)
    assert "Rebuilding the graphs here" in caplog.text and "Compile cache hit" in caplog.text
    assert reads == ["from-elsewhere"]
    ids, mask = left_padded_prompts([6, 3], seed=4)
    expected = compiled_model("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)
