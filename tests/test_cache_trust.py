"""The local compile cache is private to its user and trusts only what this user stored: planted entries are
ignored (and recompiled), entries never share inodes with exports, malformed entries are skipped, `cache clear`
removes entries only, and the key holds only what changes the graphs."""

from __future__ import annotations

import json
import logging
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.cache import ENTRY_META, CompileCache, cache_key
from optimum_neuronx.configuration import NeuronConfig
from optimum_neuronx.digests import file_sha256
from optimum_neuronx.exporters.plan import plan_export
from optimum_neuronx.trust import provenance_dir
from optimum_neuronx.backends import get_backend

SMALL = dict(batch_size=1, sequence_length=32, context_buckets=(16,), token_buckets=(32,))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cache_folders_and_files_are_private(compiled_model, isolated_compile_cache):
    compiled_model("llama")  # stored in the session's cache
    root = Path(isolated_compile_cache)
    entries = [entry for entry in (root / "entries").iterdir()]
    assert entries and _mode(root) == 0o700 and _mode(root / "entries") == 0o700
    for entry in entries:
        assert _mode(entry) == 0o700
        assert all(_mode(f) == 0o600 for f in entry.iterdir()), entry
    assert _mode(provenance_dir()) == 0o700


def test_a_planted_entry_is_ignored_and_recompiled(tiny_checkpoint, compiled_model, tmp_path, caplog, monkeypatch):
    """Someone who can write the cache folder plants an entry for the very key the next export asks for, with a
    matching cache_entry.json: its graphs are not used (an INFO line names it), the export compiles its own (here it
    is stopped there), and what it stores replaces the planted entry."""
    from conftest import seed_compile_cache, tiny_export

    session_export = compiled_model("llama")  # (compiled, or loaded from the session's cache, before compiling is stopped)
    checkpoint, options = str(tiny_checkpoint("llama")), tiny_export("llama")
    key = plan_export(checkpoint, NeuronConfig(**options), check_host_memory=False).cache_key()
    cache = CompileCache(tmp_path / "shared-cache")
    planted = cache.entry_dir(key)
    planted.mkdir(parents=True)
    (planted / "model.pt2").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip: no graph would load from it
    meta = {"fields": key.fields, "digest": key.digest, "created": 0.0,
            "sha256": {"model.pt2": file_sha256(planted / "model.pt2")}, "compile_time_s": {}}
    (planted / ENTRY_META).write_text(json.dumps(meta))
    assert cache.lookup(key, trusted=True) == planted  # what trust_remote_code would take: the test can fail

    def compiles_its_own(*args, **kwargs):
        raise RuntimeError("compiling its own graphs")

    monkeypatch.setattr(get_backend("inductor"), "compile", compiles_its_own)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"), pytest.raises(RuntimeError, match="its own graphs"):
        NeuronModelForCausalLM.from_pretrained(checkpoint, export=True, compile_cache_dir=cache.root, **options)
    assert f"Compile cache entry {planted} was not stored by this user" in caplog.text
    assert "Compile cache miss" in caplog.text
    # the graphs it compiles are stored as an export stores them (the session's own export here)
    seed_compile_cache(cache.root, checkpoint, session_export)
    assert cache.lookup(key) == planted and (planted / "model.pt2").stat().st_size > 22  # replaced by ours


def test_saved_exports_share_no_inode_with_the_cache(compiled_model, isolated_compile_cache, tmp_path):
    compiled_model("llama").save_pretrained(tmp_path / "saved")
    cached = {p.stat().st_ino for p in Path(isolated_compile_cache).glob("entries/*/model.pt2")}
    assert cached and (tmp_path / "saved" / "model.pt2").stat().st_ino not in cached
    assert compiled_model("llama").artifact_dir.joinpath("model.pt2").stat().st_ino not in cached


def test_a_malformed_entry_is_skipped_with_a_warning(tmp_path, caplog):
    cache = CompileCache(tmp_path)
    for name, text in [("a" * 32, '{"sha256": {}}'), ("b" * 32, "[" * 200_000), ("c" * 32, '{"fields": 3}')]:
        (tmp_path / "entries" / name).mkdir(parents=True)
        (tmp_path / "entries" / name / ENTRY_META).write_text(text)
    key = cache_key({"model_type": "llama"}, {"batch_size": 1}, {})
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        assert list(cache.entries()) == []
        assert cache.miss_reason(key) == "the cache is empty"
    assert caplog.text.count("skipped") >= 3
    listing = subprocess.run([str(Path(sys.executable).parent / "optimum-cli"), "neuron", "cache", "list",
                              "--compile_cache_dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr and "0 entries" in listing.stdout


def test_cache_clear_removes_entries_only(tmp_path):
    entries = tmp_path / "entries"
    (entries / ("d" * 32)).mkdir(parents=True)
    (entries / "my-notes").mkdir()
    (entries / "keep.txt").write_text("mine")
    assert CompileCache(tmp_path).clear() == 1
    assert sorted(p.name for p in entries.iterdir()) == ["keep.txt", "my-notes"]


def test_the_key_holds_only_what_changes_the_graphs(tiny_checkpoint):
    """instance_type plans Neuron devices: on the inductor backend every value gives the same key."""
    checkpoint = str(tiny_checkpoint("llama"))
    digests = {plan_export(checkpoint, NeuronConfig(**SMALL, instance_type=name),
                           check_host_memory=False).cache_key().digest for name in (None, "inf2", "trn1", "trn2.48xlarge")}
    assert len(digests) == 1


def test_lookup_labels_other_batch_sizes_as_usable_versions():
    from optimum_neuronx.commands.cache import _same_versions

    ours = {"optimum_neuronx": "1", "artifact_format": 5, "torch": "2.13", "compiler": {"version": "x",
                                                                                       "lowering": {"rows": 1}}}
    other_batch = {**ours, "compiler": {"version": "x", "lowering": {"rows": 4}}}
    assert _same_versions(other_batch, ours)
    assert not _same_versions({**ours, "torch": "2.14"}, ours)
    assert not _same_versions({**ours, "compiler": {"version": "y"}}, ours)
