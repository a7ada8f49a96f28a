"""What optimum-neuron users bring: its arguments and defaults, its exports, and Transformers never mistaking ours."""

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimum_neuronx import NeuronConfig, NeuronModelForCausalLM
from optimum_neuronx.artifacts import ArtifactError
from optimum_neuronx.loading import load_export

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")
SMALL = dict(batch_size=1, sequence_length=32, context_buckets=[16], token_buckets=[32])


def test_transformers_does_not_load_an_export_as_a_checkpoint(saved_tiny_llama):
    from transformers import AutoModelForCausalLM

    with pytest.raises(OSError, match=r"model.safetensors"):
        AutoModelForCausalLM.from_pretrained(saved_tiny_llama)


def test_exporting_an_export_says_what_it_is(saved_tiny_llama):
    with pytest.raises(ValueError, match=r"is already a compiled export \(neuron_config.json\).*without export=True"):
        NeuronModelForCausalLM.from_pretrained(saved_tiny_llama, export=True, **SMALL)


def test_an_optimum_neuron_export_gets_a_clear_message(tmp_path, tiny_checkpoint):
    nxd = tmp_path / "nxd"
    nxd.mkdir()
    shutil.copy(tiny_checkpoint("llama") / "config.json", nxd)
    (nxd / "neuron_config.json").write_text(json.dumps({
        "_serialized_key": "NxDNeuronConfig", "checkpoint_id": "unsloth/Llama-3.2-1B-Instruct", "batch_size": 1,
        "sequence_length": 4096, "optimum_neuron_version": "0.4.0", "target": "trn1", "tp_degree": 2}))
    (nxd / "model.pt").write_bytes(b"traced")
    with pytest.raises(ArtifactError, match=r"is an export of optimum-neuron 0.4.0 \(NxD graphs for Neuron devices\).*"
                                            r"from_pretrained\('unsloth/Llama-3.2-1B-Instruct', export=True"):
        NeuronModelForCausalLM.from_pretrained(nxd)
    legacy = tmp_path / "tnx"
    legacy.mkdir()
    config = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    config["neuron"] = {"task": "text-generation", "batch_size": 1, "num_cores": 2, "auto_cast_type": "bf16"}
    (legacy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"is an export of optimum-neuron \(transformers-neuronx graphs"):
        NeuronModelForCausalLM.from_pretrained(legacy)


def test_defaults_follow_the_checkpoint(tiny_checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_checkpoint("llama"))
    nc = NeuronModelForCausalLM.get_neuron_config(tiny_checkpoint("llama"))
    assert (nc.batch_size, nc.sequence_length, nc.auto_cast_type, nc.tp_degree, nc.backend) == (
        1, config.max_position_embeddings, "fp32", 1, "inductor")
    config.dtype = torch.bfloat16
    config.max_position_embeddings = 131072
    nc = NeuronModelForCausalLM.get_neuron_config("any", config, batch_size=4, tensor_parallel_size=2)
    assert (nc.batch_size, nc.sequence_length, nc.auto_cast_type, nc.tp_degree, nc.backend) == (
        4, 4096, "bf16", 2, "neuron")  # capped; num_cores > 1 picks the backend that shards
    assert NeuronConfig.for_model(config, auto_cast_type="fp32", sequence_length=64).auto_cast_type == "fp32"


def test_export_with_a_neuron_config_as_in_optimum_neuron(tiny_checkpoint, compiled_model, tmp_path):
    from transformers import AutoConfig

    checkpoint = tiny_checkpoint("llama")
    neuron_config = NeuronModelForCausalLM.get_neuron_config(checkpoint, batch_size=3, sequence_length=64)
    assert neuron_config.context_buckets == (64,)
    expected = NeuronConfig(batch_size=3, sequence_length=64, context_buckets=[16], token_buckets=[32, 64],
                            continuous_batching=True)
    model = NeuronModelForCausalLM.export(checkpoint, AutoConfig.from_pretrained(checkpoint), expected)
    assert model.neuron_config == expected
    prompt = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False),
                       compiled_model("llama").generate(prompt, max_new_tokens=8, do_sample=False))
    model.save_pretrained(tmp_path / "saved")
    assert NeuronConfig.from_pretrained(tmp_path / "saved") == expected


def test_an_export_of_another_version_is_rebuilt_here(saved_tiny_llama, compiled_model, tmp_path, caplog):
    copy = tmp_path / "other-version"
    shutil.copytree(saved_tiny_llama, copy)
    meta = json.loads((copy / "neuron_config.json").read_text())
    meta["versions"]["torch"] = "2.0.0"
    (copy / "neuron_config.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=r"cannot run here: its graphs were compiled with torch 2.0.0"):
        load_export(copy)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        model = NeuronModelForCausalLM.from_pretrained(copy, trust_remote_code=True)
    assert "cannot run here: its graphs were compiled with torch 2.0.0" in caplog.text
    assert "Rebuilding them here from its config and weights" in caplog.text
    assert model.artifact_dir != copy
    prompt = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False),
                       compiled_model("llama").generate(prompt, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("flags, message", [
    (["--task", "feature-extraction"], r"--task feature-extraction: .* text-generation"),
    (["--compiler_args", "cpp.cxx=/bin/sh"], r"compiler arg 'cpp.cxx=/bin/sh' is refused"),
])
def test_cli_refuses_what_it_cannot_do(tiny_checkpoint, tmp_path, flags, message):
    import re

    result = subprocess.run([OPTIMUM_CLI, "export", "neuron", "--model", str(tiny_checkpoint("llama")), *flags,
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and re.search(message, result.stderr), result.stderr[-2000:]
    assert not (tmp_path / "out").exists()
