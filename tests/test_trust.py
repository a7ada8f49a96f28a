"""Loading an export never runs foreign native code or silently computes garbage: tried the way an attacker would
(a shared object with a constructor, zip entries with `..`, same-size byte flips, edited JSON with its hashes
recomputed), each asserting the clear error or the local rebuild, and that the attacker's marker was not written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import left_padded_prompts
from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.artifacts import ArtifactError, config_hash
from optimum_neuronx.digests import file_sha256

EVIL_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void evil(void) {
    FILE *f = fopen(getenv("EVIL_MARKER"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def restamp(directory: Path) -> None:
    """What an attacker does after editing an export: every size, sha256 and the export hash recomputed."""
    meta_path = directory / "neuron_config.json"
    meta = json.loads(meta_path.read_text())
    for name in meta["files"]:
        meta["files"][name] = {"size": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
    config = json.loads((directory / "config.json").read_text())
    meta["config_hash"] = config_hash(config, meta)
    meta_path.write_text(json.dumps(meta, indent=2))


def rewrite_package(package: Path, replace: dict[str, bytes] = {}, add: dict[str, bytes] = {}) -> None:
    source = package.with_suffix(".orig")
    package.rename(source)
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(package, "w") as new:
        for item in old.infolist():
            new.writestr(item, replace.get(item.filename, old.read(item.filename)))
        for name, data in add.items():
            new.writestr(name, data)
    source.unlink()


@pytest.fixture
def foreign_copy(saved_tiny_llama, tmp_path):
    directory = tmp_path / "someone-else"
    shutil.copytree(saved_tiny_llama, directory)
    return directory


@pytest.fixture(scope="module")
def evil_so(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the attacker's shared object")
    work = tmp_path_factory.mktemp("evil")
    (work / "evil.c").write_text(EVIL_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(work / "evil.so"), str(work / "evil.c")], check=True)
    return (work / "evil.so").read_bytes()


def _greedy(model, seed=2):
    input_ids, attention_mask = left_padded_prompts([9, 5], seed=seed)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)


def _load_in_subprocess(directory: Path, marker: Path, trust: bool) -> subprocess.CompletedProcess:
    code = (f"from optimum_neuronx import NeuronModelForCausalLM\n"
            f"NeuronModelForCausalLM.from_pretrained({str(directory)!r}, trust_remote_code={trust})\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "EVIL_MARKER": str(marker)}, timeout=600)


def test_a_foreign_shared_object_never_runs_without_consent(foreign_copy, evil_so, compiled_model, tmp_path, caplog):
    import logging

    package = foreign_copy / "model.pt2"
    with zipfile.ZipFile(package) as archive:
        graph_so = next(name for name in archive.namelist() if name.endswith(".so"))
    rewrite_package(package, replace={graph_so: evil_so})
    restamp(foreign_copy)
    marker = tmp_path / "marker"
    os.environ["EVIL_MARKER"] = str(marker)
    try:
        with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
            model = NeuronModelForCausalLM.from_pretrained(foreign_copy)
    finally:
        os.environ.pop("EVIL_MARKER")
    assert not marker.exists()
    assert "was not exported on this machine" in caplog.text and "Rebuilding the graphs here" in caplog.text
    assert model.artifact_dir != foreign_copy  # the rebuilt graphs (a compile-cache hit: same config and weights)
    assert torch.equal(_greedy(model), _greedy(compiled_model("llama")))
    # with consent the same load runs the attacker's constructor: the test above can fail
    result = _load_in_subprocess(foreign_copy, marker, trust=True)
    assert marker.exists(), result.stderr[-2000:]


def test_archive_entries_outside_the_package_folder_are_refused(foreign_copy, tmp_path):
    escape = tmp_path / "escaped.txt"
    relative = os.path.relpath(escape, "/tmp/x/y/z")
    rewrite_package(foreign_copy / "model.pt2", add={f"model/../../{relative}": b"escaped"})
    restamp(foreign_copy)
    with pytest.raises(ValueError, match=r"archive entry .* would be extracted outside the package's folder"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy, trust_remote_code=True)
    assert not escape.exists()


def test_same_size_byte_flips_are_caught_where_the_source_is_new_and_by_verify(foreign_copy, capsys):
    weights = foreign_copy / "neuronx_weights.safetensors"
    data = bytearray(weights.read_bytes())
    start = len(data) // 2
    data[start:start + 4096] = bytes(b ^ 0xFF for b in data[start:start + 4096])
    weights.write_bytes(bytes(data))
    # a copy of an export made here, at a path it was never loaded from: its files are checked before use
    with pytest.raises(ArtifactError, match=r"neuronx_weights.safetensors does not match its sha256"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy)
    from optimum_neuronx.commands.verify import main

    assert main([str(foreign_copy)]) == 1
    assert "does not match its sha256" in capsys.readouterr().err


def test_a_flipped_graph_file_is_caught_before_it_is_loaded(foreign_copy):
    package = foreign_copy / "model.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 3:len(data) // 3 + 64] = bytes(64)  # same size: only its digest can tell
    package.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model.pt2 does not match its sha256"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy, trust_remote_code=True)


def edit_to_one_layer(directory: Path, spec_too: bool = False) -> None:
    """config.json edited to one layer (the weights hold two; `spec_too`: neuron_config.json's decoder spec as
    well), every hash recomputed."""
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    if spec_too:
        meta = json.loads((directory / "neuron_config.json").read_text())
        meta["model"]["decoder_spec"]["num_layers"] = 1
        (directory / "neuron_config.json").write_text(json.dumps(meta))
    restamp(directory)


def test_edited_config_with_recomputed_hashes_gets_a_clear_error(foreign_copy):
    edit_to_one_layer(foreign_copy)
    # refused from the weights file's header, before a model of the edited config is built
    with pytest.raises(ArtifactError, match=r"config.json gives 1 layers but the weights hold 2: config and weights do "
                                            r"not belong together"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy)


def test_a_trusted_export_edited_after_compiling_gets_a_clear_error_not_a_crash(foreign_copy):
    # Even with consent, graphs are never handed inputs of other shapes than they were compiled for.
    edit_to_one_layer(foreign_copy)
    with pytest.raises(ArtifactError, match=r"config.json gives num_hidden_layers = 1 but the graphs were compiled "
                                            r"for 2 \(neuron_config.json's decoder spec\): the export was edited"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy, trust_remote_code=True)
    edit_to_one_layer(foreign_copy, spec_too=True)
    with pytest.raises(ArtifactError, match=r"graph prefill_16 was compiled for kv_cache \(2, 2, 3, 2, 64, 16\) "
                                            r"float32, but this export's config.json and neuron_config.json give "
                                            r"\(1, 2, 3, 2, 64, 16\) float32"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy, trust_remote_code=True)


def test_trusted_weights_of_other_shapes_are_refused_at_load(foreign_copy):
    from safetensors.torch import load_file

    from optimum_neuronx.weights_io import save_weights

    weights = {name: t.clone() for name, t in load_file(str(foreign_copy / "neuronx_weights.safetensors")).items()}
    weights["norm.weight"] = torch.ones(32)
    save_weights(weights, foreign_copy / "neuronx_weights.safetensors")
    restamp(foreign_copy)
    with pytest.raises(ValueError, match=r"neuronx_weights.safetensors holds norm.weight as \(32,\) torch.float32, but graph "
                                         r"\w+ was compiled for \(64,\) float32"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy, trust_remote_code=True, huge_pages=False)


def test_a_failed_load_leaves_no_extraction_folder(foreign_copy):
    import tempfile

    package = foreign_copy / "model.pt2"
    with zipfile.ZipFile(package) as archive:
        graph_so = next(name for name in archive.namelist() if name.endswith(".so"))
    garbage = b"not a shared object, " * 64 + os.urandom(16)
    rewrite_package(package, replace={graph_so: garbage})
    restamp(foreign_copy)
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("aotinductor_*"))
    with pytest.raises(Exception):
        NeuronModelForCausalLM.from_pretrained(foreign_copy, trust_remote_code=True)
    left = [folder for folder in set(temp.glob("aotinductor_*")) - before
            if any(f.is_file() and f.read_bytes() == garbage for f in folder.rglob("*.so"))]
    assert not left


CALL_WITH_A_WRONG_CACHE = """
import sys, torch
from optimum_neuronx import NeuronModelForCausalLM
model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
cache = torch.zeros(1, 2, 3, 2, 64, 16)  # one layer where the graph was compiled for two
inputs = [torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long),
          torch.ones(3, 32, dtype=torch.bool), torch.zeros(3, dtype=torch.long), cache, torch.arange(3)]
try:
    model._graphs["token_32"](inputs)
except RuntimeError as err:
    print("refused:", str(err).splitlines()[0])
"""


def test_graphs_check_their_inputs_at_every_call(saved_tiny_llama):
    result = subprocess.run([sys.executable, "-c", CALL_WITH_A_WRONG_CACHE, str(saved_tiny_llama)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "refused:" in result.stdout, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "sub/dir"])
def test_listed_file_names_must_be_plain_names_of_the_export(foreign_copy, name):
    meta = json.loads((foreign_copy / "neuron_config.json").read_text())
    meta["files"][name] = {"size": 1, "sha256": "0" * 64}
    (foreign_copy / "neuron_config.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=r"lists .*which is not a plain file name of the export directory"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy)


def test_a_symlink_out_of_the_export_is_refused(foreign_copy):
    weights = foreign_copy / "neuronx_weights.safetensors"
    target = foreign_copy.parent / "elsewhere.safetensors"
    shutil.move(weights, target)
    weights.symlink_to(target)
    with pytest.raises(ArtifactError, match=r"neuronx_weights.safetensors is a symbolic link out of the export directory"):
        NeuronModelForCausalLM.from_pretrained(foreign_copy)


# -- the huge-page loader reads headers as strictly as the safetensors library ------------------------------------

def _safetensors_with_header(path: Path, header: dict, data: bytes) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    return path


@pytest.mark.parametrize("header, data, message", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}, bytes(24), r"'b' starts at byte 16 .*a gap"),
    ({"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), r"'a' \(F16, shape \[4\]\) needs 8"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), r"does not fit|cover 16 bytes"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), r"malformed entry"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1), r"malformed entry"),
])
def test_safetensors_headers_are_checked_before_any_byte_is_read(tmp_path, header, data, message):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from optimum_neuronx.weights_io import read_safetensors_header

    path = _safetensors_with_header(tmp_path / "w.safetensors", header, data)
    with pytest.raises(SafetensorError):
        load_file(str(path))  # the library refuses each of these too
    with pytest.raises(ArtifactError, match=message):
        read_safetensors_header(path)


# -- faults ---------------------------------------------------------------------------------------------------------

def test_a_killed_writer_leaves_no_staging_folder_after_a_rerun(tmp_path):
    from optimum_neuronx.artifacts import atomic_directory

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".export.tmp-{dead.stdout.strip()}-abcd"
    stale.mkdir()
    (stale / "neuronx_weights.safetensors").write_bytes(b"partial copy")
    live = tmp_path / f".export.tmp-{os.getpid()}-efgh"  # a write still in progress in a live process
    live.mkdir()
    with atomic_directory(tmp_path / "export") as staging:
        (staging / "file").write_text("x")
    assert not stale.exists() and live.exists() and (tmp_path / "export" / "file").is_file()


WORKERS_SCRIPT = """
import os, sys, time
from optimum_neuronx.backends.workers import map_in_workers

def work(item):
    os.write(1, f"{os.getpid()}\\n".encode())  # one write: the two workers' lines never interleave
    time.sleep(120)

map_in_workers(work, [1, 2], 2, lambda: None, str, desc="x", unit="x")
"""


def test_compile_workers_die_with_a_killed_exporter():
    process = subprocess.Popen([sys.executable, "-c", WORKERS_SCRIPT], stdout=subprocess.PIPE, text=True)
    workers = []
    while len(workers) < 2:
        line = process.stdout.readline()
        assert line, "the exporter ended before both workers started"
        workers += [int(line)] if line.strip().isdigit() else []
    process.kill()
    process.wait()
    for _ in range(100):
        alive = [pid for pid in workers if Path(f"/proc/{pid}").exists() and
                 "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
        if not alive:
            break
        import time

        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived their killed parent"


# -- the runtime refuses what would compute garbage ---------------------------------------------------------------

def test_generate_from_inside_generate_is_refused(compiled_model):
    model = compiled_model("llama")
    input_ids, _ = left_padded_prompts([5], seed=1)

    class Reenters:
        def put(self, value):
            model.generate(input_ids=input_ids, max_new_tokens=2)

        def end(self):
            pass

    with pytest.raises(RuntimeError, match=r"generate was called on this model while its own generate is running"):
        model.generate(input_ids=input_ids, max_new_tokens=3, streamer=Reenters())
    assert _greedy(model).shape[0] == 2  # the model is usable after


def test_a_stale_cache_handle_an_all_zero_mask_and_an_empty_batch_are_refused(compiled_model):
    model = compiled_model("llama")
    input_ids, _ = left_padded_prompts([6, 6], seed=2)
    first = model(input_ids=input_ids)
    model(input_ids=input_ids)  # a new context: the first handle is stale
    with pytest.raises(ValueError, match=r"a cache handle this model no longer holds"):
        model(input_ids=input_ids[:, -1:], past_key_values=first.past_key_values)
    mask = torch.ones_like(input_ids)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"attention_mask row\(s\) \[1\] mark no token as real"):
        model(input_ids=input_ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"input_ids holds no prompts \(shape \(0, 6\)\)"):
        model.generate(input_ids=input_ids[:0], max_new_tokens=2)


def test_verify_reports_an_unreadable_weights_file(foreign_copy, capsys):
    weights = foreign_copy / "neuronx_weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")  # a header length past the file: SafetensorError in the library
    weights.write_bytes(bytes(data))
    restamp(foreign_copy)
    from optimum_neuronx.commands.verify import main

    assert main([str(foreign_copy)]) == 1
    assert capsys.readouterr().err.startswith("error: ")
