"""Writes killed mid-way (SIGKILL runs no cleanup) leave the old export or the new one, never a mix, and no staging
copy of the weights in the temp folder; Hub-cache links are followed only in a real Hub cache layout; an output
folder holding the model is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from optimum_neuronx.artifacts import ArtifactError, atomic_directory, check_file_name

KILLED_WHILE_SWAPPING = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from optimum_neuronx import artifacts
    original = os.rename
    calls = []
    def rename(source, destination):
        original(source, destination)
        calls.append(destination)
        if len(calls) == int(sys.argv[2]):
            os.kill(os.getpid(), 9)  # killed right after this rename
    artifacts.os.rename = rename
    with artifacts.atomic_directory(sys.argv[1]) as staging:
        (Path(staging) / "neuron_config.json").write_text("new")
        (Path(staging) / "model.pt2").write_text("new graphs")
""")


@pytest.mark.parametrize("killed_after", [1, 2])
def test_a_save_killed_while_replacing_an_export_leaves_the_old_or_the_new_one(tmp_path, killed_after):
    target = tmp_path / "export"
    target.mkdir()
    (target / "neuron_config.json").write_text("old")
    (target / "model.pt2").write_text("old graphs")
    (target / "NOTES.md").write_text("the user's own file")
    result = subprocess.run([sys.executable, "-c", KILLED_WHILE_SWAPPING, str(target), str(killed_after)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    with atomic_directory(target) as staging:  # the next write puts things right first
        (staging / "neuron_config.json").write_text("newer")
    assert (target / "neuron_config.json").read_text() == "newer"
    assert (target / "NOTES.md").read_text() == "the user's own file"
    assert (target / "model.pt2").read_text() in ("old graphs", "new graphs")  # kept whole from one of them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left beside it


def test_a_process_killed_mid_export_leaves_no_staging_copy_behind():
    from optimum_neuronx.tempdirs import temporary_directory

    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from optimum_neuronx.tempdirs import temporary_directory
        folder = temporary_directory("export")
        (__import__("pathlib").Path(folder.name) / "neuronx_weights.safetensors").write_bytes(b"0" * 1024)
        print(folder.name, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    left = Path(child.stdout.readline().strip())
    child.kill()
    child.wait(timeout=60)
    assert left.is_dir()
    with temporary_directory("export") as mine:
        assert not left.exists() and Path(mine).is_dir()


def test_hub_blob_links_are_followed_only_in_a_real_hub_cache_layout(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret").write_text("not the export's")
    repo = tmp_path / "models--me--x"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "blobs").symlink_to(elsewhere)  # the blobs folder itself points anywhere
    link = repo / "snapshots" / "abc" / "model.pt2"
    link.symlink_to("../../blobs/secret")
    with pytest.raises(ArtifactError, match="symbolic link out of the export directory"):
        check_file_name(repo / "snapshots" / "abc", "model.pt2")
    (repo / "blobs").unlink()
    (repo / "blobs").mkdir()
    (repo / "blobs" / "secret").write_text("a real blob")
    assert check_file_name(repo / "snapshots" / "abc", "model.pt2") == link


def test_an_output_folder_holding_the_model_is_refused(tiny_checkpoint, tmp_path):
    cli = str(Path(sys.executable).parent / "optimum-cli")
    checkpoint = tiny_checkpoint("llama")
    for output in (checkpoint, checkpoint.parent):
        result = subprocess.run([cli, "export", "neuron", "--model", str(checkpoint), "--overwrite", str(output)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 1 and "holds the model being exported" in result.stderr, result.stderr[-2000:]
    assert (checkpoint / "config.json").is_file()
