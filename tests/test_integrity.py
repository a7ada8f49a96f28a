"""An export recorded as produced here is trusted only while its files are the ones recorded (inode, size, ctime),
and the compiled code loaded is exactly the bytes verified: same-size swaps and a swap racing the load are caught."""

from __future__ import annotations

import logging
import os
import shutil
import zipfile

import pytest
import torch

from conftest import left_padded_prompts
from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx import trust as trust_module
from optimum_neuronx.artifacts import ArtifactError
from optimum_neuronx.trust import provenance
from test_trust import EVIL_C, evil_so, rewrite_package  # noqa: F401 (fixture)


@pytest.fixture
def recorded_copy(saved_tiny_llama, tmp_path):
    """A copy of the saved tiny Llama, loaded once: recorded as produced here, at this path."""
    directory = tmp_path / "mine"
    shutil.copytree(saved_tiny_llama, directory)
    NeuronModelForCausalLM.from_pretrained(directory)
    assert provenance(directory) == "here"
    return directory


def _flip_same_size(path, offset_from_end=200):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    replacement = path.with_name(path.name + ".new")
    replacement.write_bytes(bytes(data))
    os.replace(replacement, path)  # renamed over: the attacker's usual move, size unchanged


@pytest.mark.parametrize("name", ["model.pt2", "neuronx_weights.safetensors"])
def test_a_same_size_edit_at_a_recorded_path_is_caught(recorded_copy, name):
    _flip_same_size(recorded_copy / name)
    assert provenance(recorded_copy) == "moved"  # the record no longer vouches for the files: digests decide
    with pytest.raises(ArtifactError, match=rf"{name} does not match its sha256"):
        NeuronModelForCausalLM.from_pretrained(recorded_copy)


def test_an_untouched_recorded_export_loads_without_hashing_its_weights(recorded_copy, monkeypatch):
    from optimum_neuronx import artifacts

    hashed = []
    original = artifacts.file_sha256
    monkeypatch.setattr(artifacts, "file_sha256", lambda path: hashed.append(os.path.basename(path)) or original(path))
    model = NeuronModelForCausalLM.from_pretrained(recorded_copy)
    assert model.artifact_dir == recorded_copy and "neuronx_weights.safetensors" not in hashed
    input_ids, attention_mask = left_padded_prompts([6], seed=4)
    assert model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3).shape == (1, 9)


def test_a_package_renamed_over_after_it_was_hashed_is_never_loaded(recorded_copy, evil_so, tmp_path, monkeypatch):
    """The race: the digests check out, then an attacker renames a package with their shared object over model.pt2
    before the graphs load. What loads is the private copy checked as it was made: the swap is refused."""
    evil = tmp_path / "evil.pt2"
    shutil.copy(recorded_copy / "model.pt2", evil)
    with zipfile.ZipFile(evil) as archive:
        graph_so = next(name for name in archive.namelist() if name.endswith(".so"))
    rewrite_package(evil, replace={graph_so: evil_so})
    marker = tmp_path / "marker"
    original = trust_module.read_artifact  # what the trust decision reads the export with

    def read_then_swap(*args, **kwargs):
        result = original(*args, **kwargs)
        os.replace(evil, recorded_copy / "model.pt2")
        return result

    monkeypatch.setattr(trust_module, "read_artifact", read_then_swap)
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    with pytest.raises(ArtifactError, match=r"model.pt2 does not match its sha256"):
        NeuronModelForCausalLM.from_pretrained(recorded_copy)
    assert not marker.exists()


@pytest.mark.parametrize("threads", ["1", "3"])
def test_another_thread_count_reuses_the_compiled_graphs(saved_tiny_llama, compiled_model, threads):
    """A reload under another OMP_NUM_THREADS runs the same graphs: nothing is rebuilt (the fresh process refuses to
    compile), and the tokens are the same."""
    from conftest import generate_in_fresh_process

    input_ids, attention_mask = left_padded_prompts([7], seed=5)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    result, tokens = generate_in_fresh_process(saved_tiny_llama, inputs, 6,
                                               env={**os.environ, "OMP_NUM_THREADS": threads})
    assert "(no compilation)" in result.stderr and "cannot run here" not in result.stderr
    assert tokens == compiled_model("llama").generate(**inputs, max_new_tokens=6, do_sample=False).tolist()
