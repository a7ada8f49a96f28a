"""Every bad input gets a clear error that names the value, the limit and the fix."""

import json
import logging
import shutil

import pytest
import torch

from optimum_neuronx import NeuronConfig, NeuronModelForCausalLM
from optimum_neuronx.artifacts import ArtifactError
from optimum_neuronx.exporters import export as export_module
from optimum_neuronx.loading import load_export
from optimum_neuronx.backends import get_backend

MODEL = "llama"


def test_prompt_longer_than_largest_context_bucket(compiled_model):
    # an export without continuous batching (phi3's family export keeps its context graphs, [16, 64]) refuses a
    # prompt longer than its largest bucket before running anything; with it, the prompt is encoded in chunks
    from optimum_neuronx.buckets import context_bucket

    with pytest.raises(ValueError, match=r"20 tokens but the largest compiled context-encoding bucket is 16.*re-export"):
        context_bucket(20, (16,))
    chunked = compiled_model(MODEL).generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=5)
    assert chunked.shape == (1, 25)


def test_prompt_plus_new_tokens_beyond_sequence_length(compiled_model):
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(60\) = 70 exceeds the compiled "
                                         r"sequence_length \(64\)\. Use max_new_tokens <= 54"):
        compiled_model(MODEL).generate(torch.ones(1, 10, dtype=torch.long), max_new_tokens=60)


def test_truncation_only_when_asked_and_logged(compiled_model, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        out = compiled_model(MODEL).generate(torch.ones(1, 10, dtype=torch.long), max_new_tokens=60,
                                             min_new_tokens=54, do_sample=False, truncate_to_sequence_length=True)
    assert out.shape[1] == 64
    assert "max_new_tokens lowered from 60 to 54" in caplog.text


def test_forward_past_the_cache_end_is_refused(compiled_model):
    model = compiled_model(MODEL)
    handle = model(torch.ones(1, 16, dtype=torch.long)).past_key_values
    handle.length = 64
    with pytest.raises(ValueError, match=r"position 64: the compiled sequence_length .* is 64"):
        model(torch.ones(1, 1, dtype=torch.long), past_key_values=handle)


def test_batch_larger_than_compiled(compiled_model):
    with pytest.raises(ValueError, match=r"needs 4 rows but the model was compiled for batch_size=3.*batch_size >= 4"):
        compiled_model(MODEL).generate(torch.ones(4, 5, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"needs 4 rows .* batch_size=3"):
        compiled_model(MODEL).generate(torch.ones(2, 5, dtype=torch.long), max_new_tokens=3, num_beams=2)


def test_outputs_the_graphs_do_not_compute_are_refused(compiled_model):
    model, ids = compiled_model(MODEL), torch.ones(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"labels \(a loss\): the compiled graphs return logits only.*"
                                         r"AutoModelForCausalLM"):
        model(ids, labels=ids)
    with pytest.raises(ValueError, match=r"output_hidden_states=True: .*logits only"):
        model.generate(ids, max_new_tokens=2, output_hidden_states=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match=r"output_attentions=True: .*logits only"):
        model(ids, output_attentions=True)
    embeds = torch.zeros(1, 5, 64)
    for call in (lambda: model(inputs_embeds=embeds), lambda: model.generate(inputs_embeds=embeds, max_new_tokens=2)):
        with pytest.raises(ValueError, match=r"inputs_embeds is not supported.*Pass input_ids"):
            call()


@pytest.mark.parametrize("ids, message", [
    (torch.full((1, 4), 300), r"Token id 300 is outside this model's vocabulary \(ids 0 to 255\).*tokenizer"),
    (torch.tensor([[5, -1, 7]]), r"Token id -1 is outside this model's vocabulary"),
    (torch.zeros(1, 0, dtype=torch.long), r"input_ids holds no tokens.*BOS"),
    (torch.ones(1, 4), r"integer token ids, got dtype torch.float32"),
    (torch.ones(4, dtype=torch.long), r"\[batch, tokens\] tensor, got shape \(4,\).*ids\[None\]"),
], ids=["past_vocab", "negative", "empty", "float", "1d"])
def test_bad_input_ids_are_refused(compiled_model, ids, message):
    """Out-of-vocabulary ids used to abort the whole process inside the compiled embedding lookup."""
    model = compiled_model(MODEL)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, max_new_tokens=2)
    if ids.dim() == 2 and ids.shape[1]:
        handle = model(torch.ones(1, 3, dtype=torch.long)).past_key_values
        with pytest.raises(ValueError, match=message):
            model(ids, past_key_values=handle)  # decode steps check their ids too


def test_attention_mask_of_another_shape_is_refused(compiled_model):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\) but input_ids has \(2, 4\)"):
        compiled_model(MODEL).generate(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3),
                                       max_new_tokens=2)


def test_dtype_keywords_mean_auto_cast_type(tiny_checkpoint, saved_tiny_llama):
    with pytest.raises(ValueError, match=r"torch_dtype=torch.bfloat16 and auto_cast_type='fp16' disagree"):
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL), export=True, torch_dtype=torch.bfloat16,
                                               auto_cast_type="fp16")
    with pytest.raises(ValueError, match=r"compiled with auto_cast_type='fp32' but \{'auto_cast_type': 'fp16'\}"):
        NeuronModelForCausalLM.from_pretrained(saved_tiny_llama, dtype=torch.float16)


def test_unknown_model_type(tmp_path):
    from transformers import BloomConfig

    BloomConfig(n_layer=1, hidden_size=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'bloom' is not supported.*gemma3_text, gpt2, granite, llama, mistral, mixtral"):
        NeuronModelForCausalLM.from_pretrained(tmp_path, export=True, sequence_length=32)


def test_unknown_auto_cast_type(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"Unknown auto_cast_type 'int3'.*'fp32', 'bf16', 'fp16'"):
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL), export=True, auto_cast_type="int3")


def test_tp_degree_needs_a_backend_that_shards(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"tp_degree \(num_cores\) = 2: the inductor backend does not shard.*num_cores=1"):
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL), export=True, num_cores=2, sequence_length=32,
                                               backend="inductor")


def test_plain_checkpoint_without_export(tiny_checkpoint):
    with pytest.raises(ArtifactError, match=r"not an exported model.*export=True"):
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL))


def test_reload_with_other_shapes_is_refused(saved_tiny_llama):
    with pytest.raises(ValueError, match=r"compiled with batch_size=3 .* re-export"):
        NeuronModelForCausalLM.from_pretrained(saved_tiny_llama, batch_size=5)


@pytest.fixture
def damaged(saved_tiny_llama, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(saved_tiny_llama, copy)
    return copy


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["versions"].update(torch="1.0.0"), r"compiled with torch 1.0.0, but torch .* is installed"),
    (lambda m: m["versions"].update(optimum_neuronx="0.0.1"), r"exported by optimum-neuronx 0.0.1"),
    (lambda m: m.update(artifact_format=99), r"artifact format 99"),
    (lambda m: m["neuron_config"].update(batch_size=1), r"no longer matches what was compiled"),
    # An export made on a CPU with wider vector instructions would die with SIGILL here, not raise.
    (lambda m: m["versions"]["compiler"].update(target="cpu neon_sve9000"),
     r"compiled for the vector instructions 'neon_sve9000', which this CPU lacks \(it supports: .*\)\. Load it "
     r"with NeuronModelForCausalLM.from_pretrained, which rebuilds its graphs here"),
], ids=["torch", "package", "format", "neuron_config_edited", "cpu_target"])
def test_stale_or_foreign_artifact_refused(damaged, edit, message):
    # Loading the compiled graphs as they are (from_pretrained rebuilds those it cannot run: test_optimum_neuron_compat)
    _edit_json(damaged / "neuron_config.json", edit)
    with pytest.raises(ArtifactError, match=message):
        load_export(damaged)


def test_export_is_stamped_with_the_cpu_it_compiled_for(saved_tiny_llama):
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from optimum_neuronx.backends.inductor import BACKEND

    target = json.loads((saved_tiny_llama / "neuron_config.json").read_text())["versions"]["compiler"]["target"]
    assert target.startswith(f"cpu {pick_vec_isa()}".strip())
    assert BACKEND.missing_target_support(target) == ""


def test_export_needing_an_instruction_set_this_cpu_lacks_refused(damaged, monkeypatch):
    # The x86 check reads the CPU's feature flags: pretend this one has VNNI but no AVX-512 (whatever it really has).
    _edit_json(damaged / "neuron_config.json",
               lambda m: m["versions"]["compiler"].update(target="cpu avx512 avx512_vnni"))
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    with pytest.raises(ArtifactError, match=r"compiled for the vector instructions 'avx512 avx512_vnni'; this CPU "
                                            r"lacks avx512 \(it supports: .*\)\. Load it with"):
        load_export(damaged)


def test_loading_needs_no_cpp_compiler(saved_tiny_llama, compiled_model, tmp_path):
    # Only exporting compiles C++. With no compiler on PATH (and an empty Inductor cache), a fresh process must
    # load the export and generate what the exporting process does.
    import os

    from conftest import generate_in_fresh_process

    inputs = {"input_ids": torch.tensor([[5, 9, 2, 7]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    expected = compiled_model(MODEL).generate(**inputs, max_new_tokens=6, do_sample=False)
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result, tokens = generate_in_fresh_process(saved_tiny_llama, inputs, max_new_tokens=6, env=env)
    assert tokens == expected.tolist()
    assert "outdated pt2" not in result.stderr


def test_edited_model_config_refused(damaged):
    _edit_json(damaged / "config.json", lambda c: c.update(rms_norm_eps=0.5))
    with pytest.raises(ArtifactError, match=r"config.json or neuron_config.json no longer matches"):
        NeuronModelForCausalLM.from_pretrained(damaged)


@pytest.mark.parametrize("name", ["neuronx_weights.safetensors", "model.pt2"])
def test_missing_file_refused(damaged, name):
    (damaged / name).unlink()
    with pytest.raises(ArtifactError, match=rf"missing {name}\. Re-export"):
        NeuronModelForCausalLM.from_pretrained(damaged)


@pytest.mark.parametrize("name", ["neuronx_weights.safetensors", "model.pt2"])
def test_truncated_file_refused(damaged, name):
    path = damaged / name
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ArtifactError, match=rf"{name} has {size // 2} bytes but the export wrote {size}"):
        NeuronModelForCausalLM.from_pretrained(damaged)


def test_interrupted_export_leaves_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated interruption during compilation")

    monkeypatch.setattr(get_backend("inductor"), "compile", crash)
    target = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        export_module.export(str(tiny_checkpoint(MODEL)), target, NeuronConfig(sequence_length=32))
    assert list(tmp_path.iterdir()) == []


def test_interrupted_save_leaves_previous_artifact_usable(compiled_model, saved_tiny_llama, tmp_path, monkeypatch):
    target = tmp_path / "saved"
    shutil.copytree(saved_tiny_llama, target)
    before = sorted(p.name for p in target.iterdir())

    def crash(source, destination):
        (destination / "neuronx_weights.safetensors").write_bytes(b"partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr("optimum_neuronx.runtime.copy_artifact_files", crash)
    with pytest.raises(OSError, match="disk full"):
        compiled_model(MODEL).save_pretrained(target)
    assert sorted(p.name for p in target.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]
    NeuronModelForCausalLM.from_pretrained(target)


def test_sequence_length_past_max_position_embeddings(tiny_checkpoint, caplog):
    """Refused, naming both, unless the model's RoPE scaling covers it (then logged): the tiny llama's llama3 scaling
    (factor 4 over 32 positions) covers 128, not its max_position_embeddings of 256; qwen2's plain RoPE covers
    nothing past 256."""
    import logging

    from optimum_neuronx.configuration import NeuronConfig
    from optimum_neuronx.exporters.plan import plan_export

    with pytest.raises(ValueError, match=r"sequence_length = 512 is longer than the model's max_position_embeddings "
                                         r"= 256: positions past it were never trained. Export with sequence_length "
                                         r"<= 256"):
        plan_export(str(tiny_checkpoint("qwen2")), NeuronConfig(sequence_length=512), check_host_memory=False)
    from transformers import AutoConfig

    from optimum_neuronx.exporters.registry import get_export_config

    config = AutoConfig.from_pretrained(tiny_checkpoint("llama"))
    config.max_position_embeddings = 64
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        get_export_config("llama").decoder_spec(config, NeuronConfig(sequence_length=128))
    assert "sequence_length 128 is past max_position_embeddings 64; its llama3 RoPE scaling covers 128" in caplog.text
    with pytest.raises(ValueError, match=r"and what its llama3 RoPE scaling covers \(128\)"):
        get_export_config("llama").decoder_spec(config, NeuronConfig(sequence_length=256))
