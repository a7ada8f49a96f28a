"""push_to_hub / from_pretrained(repo_id) against a local Hub-compatible server (HF_ENDPOINT points to it)."""

import os
import socket

import pytest
import torch

from conftest import generate_in_fresh_process
from hub_server import HubServer
from optimum_neuronx import NeuronModelForCausalLM

PROMPT = {"input_ids": torch.tensor([[5, 17, 42, 99]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}


def hub_env(endpoint, home):
    return dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1",
                HF_HUB_OFFLINE="0")


PUSH = """
import sys
from optimum_neuronx import NeuronModelForCausalLM
print(NeuronModelForCausalLM.from_pretrained(sys.argv[1]).push_to_hub(sys.argv[2]))
"""


def push(directory, repo_id, env):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", PUSH, str(directory), repo_id], capture_output=True, text=True,
                          timeout=300, env=env)


SAVE_AND_PUSH = """
import sys
from optimum_neuronx import NeuronModelForCausalLM
NeuronModelForCausalLM.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], push_to_hub=True, repo_id=sys.argv[3],
                                                                    commit_message="saved and pushed")
"""


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


def test_push_then_pull_into_fresh_cache_gives_identical_tokens(hub, saved_tiny_llama, compiled_model, tmp_path):
    result = push(saved_tiny_llama, "me/tiny-llama", hub_env(hub.url, tmp_path / "push-home"))
    assert result.returncode == 0, result.stderr[-3000:]
    commits = [r for r in hub.state.requests if r.startswith("POST /api/models/me/tiny-llama/commit/")]
    assert len(commits) == 1
    files = hub.state.repos["me/tiny-llama"]["files"]
    assert sorted(files) == ["README.md", "config.json", "generation_config.json", "model.pt2", "model.safetensors",
                             "neuron_config.json"]
    card = files["README.md"].decode()
    for line in ("| batch_size | 3 |", "| sequence_length | 64 |", "| context buckets | [16] |",
                 "| token-generation buckets | [32, 64] |", "| dtype (auto_cast_type) | fp32 |",
                 f"| torch | {torch.__version__} |", "library_name: optimum-neuronx"):
        assert line in card

    expected = compiled_model("llama").generate(**PROMPT, max_new_tokens=30, do_sample=False).tolist()
    result, tokens = generate_in_fresh_process("me/tiny-llama", PROMPT, 30, env=hub_env(hub.url, tmp_path / "pull"))
    assert "(no compilation)" in result.stderr
    assert tokens == expected


def test_invalid_repo_id(compiled_model):
    with pytest.raises(ValueError, match=r"Invalid Hub repo id 'not a/valid//id'"):
        compiled_model("llama").push_to_hub("not a/valid//id")


def _closed_port_endpoint():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_unreachable_server_names_the_endpoint(saved_tiny_llama, tmp_path):
    endpoint = _closed_port_endpoint()
    result = push(saved_tiny_llama, "me/anything", hub_env(endpoint, tmp_path / "push"))
    assert result.returncode != 0 and f"Cannot reach the Hub at {endpoint}" in result.stderr
    result, _ = generate_in_fresh_process("me/anything", PROMPT, 5, env=hub_env(endpoint, tmp_path / "pull"),
                                          check=False)
    assert result.returncode != 0 and f"Cannot reach the Hub at {endpoint}" in result.stderr
    assert not list((tmp_path / "pull").rglob("*.safetensors"))


def test_downloaded_artifact_missing_a_file_is_refused(hub, saved_tiny_llama, tmp_path):
    result = push(saved_tiny_llama, "me/broken", hub_env(hub.url, tmp_path / "push"))
    assert result.returncode == 0, result.stderr[-3000:]
    del hub.state.repos["me/broken"]["files"]["model.pt2"]
    result, _ = generate_in_fresh_process("me/broken", PROMPT, 5, env=hub_env(hub.url, tmp_path / "pull"),
                                          check=False)
    assert result.returncode != 0 and "is missing model.pt2. Re-export" in result.stderr


CACHED_EXPORT = """
import logging, sys
import torch._inductor
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
if sys.argv[4] == "refuse-compile":
    def refuse(*args, **kwargs):
        raise AssertionError("compiled despite the Hub cache")
    torch._inductor.aot_compile = refuse
from optimum_neuronx import NeuronModelForCausalLM
m = NeuronModelForCausalLM.from_pretrained(sys.argv[1], export=True, compile_cache_dir=sys.argv[2],
                                           compile_cache_repo=sys.argv[3], batch_size=1, sequence_length=32,
                                           context_buckets=[16], token_buckets=[32],
                                           trust_remote_code=sys.argv[5] == "trust")
print(m.generate(__import__("torch").tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False).tolist())
"""


def test_hub_backed_compile_cache_shares_entries(hub, tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    def cached_export(machine, mode, trust="trust"):
        env = dict(hub_env(hub.url, tmp_path / f"home-{machine}"),
                   OPTIMUM_NEURONX_PROVENANCE=str(tmp_path / f"provenance-{machine}"))
        return subprocess.run([sys.executable, "-c", CACHED_EXPORT, str(tiny_checkpoint("qwen3")),
                               str(tmp_path / machine), "me/compile-cache", mode, trust], capture_output=True,
                              text=True, timeout=600, env=env)

    first = cached_export("machine-a", "compile")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Compile cache miss" in first.stderr and "Pushed compile cache entry" in first.stderr
    pushed = hub.state.repos["me/compile-cache"]["files"]
    assert any(name.endswith("/model.pt2") for name in pushed) and any(n.endswith("/cache_entry.json") for n in pushed)

    second = cached_export("machine-b", "refuse-compile")  # empty local cache, same Hub repo, trusted
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Fetched compile cache entry" in second.stderr and "Compile cache hit" in second.stderr
    assert second.stdout == first.stdout

    # without trust_remote_code the Hub entries' native code is never fetched: this machine compiles
    untrusted = cached_export("machine-c", "compile", trust="no")
    assert untrusted.returncode == 0, untrusted.stderr[-3000:]
    assert "is not consulted" in untrusted.stderr and "Fetched compile cache entry" not in untrusted.stderr
    assert untrusted.stdout == first.stdout


def test_a_poisoned_hub_cache_entry_is_not_used(hub, tiny_checkpoint, tmp_path):
    # Whoever can write the cache repo swaps the weights of an entry and fixes the entry's own sha256 list: the
    # weights no longer are the ones its key names, so the entry is evicted and the export compiles here.
    import hashlib
    import json
    import subprocess
    import sys

    def cached_export(machine, mode):
        env = dict(hub_env(hub.url, tmp_path / f"home-{machine}"),
                   OPTIMUM_NEURONX_PROVENANCE=str(tmp_path / f"provenance-{machine}"))
        return subprocess.run([sys.executable, "-c", CACHED_EXPORT, str(tiny_checkpoint("qwen2")),
                               str(tmp_path / machine), "me/poisoned-cache", mode, "trust"], capture_output=True,
                              text=True, timeout=600, env=env)

    first = cached_export("machine-a", "compile")
    assert first.returncode == 0, first.stderr[-3000:]
    files = hub.state.repos["me/poisoned-cache"]["files"]
    weights_name = next(name for name in files if name.endswith("/model.safetensors"))
    weights = bytearray(files[weights_name])
    weights[-64:] = bytes(b ^ 0x55 for b in weights[-64:])
    files[weights_name] = bytes(weights)
    meta_name = weights_name.replace("model.safetensors", "cache_entry.json")
    meta = json.loads(files[meta_name])
    meta["sha256"]["model.safetensors"] = hashlib.sha256(weights).hexdigest()
    files[meta_name] = json.dumps(meta).encode()
    second = cached_export("machine-b", "compile")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "holds other weights than its key names: evicted, compiling here" in second.stderr
    assert second.stdout == first.stdout


def test_save_pretrained_with_push_to_hub(hub, saved_tiny_llama, tmp_path):
    """Transformers' save_pretrained(..., push_to_hub=True, repo_id=...): saved locally, then pushed in one commit."""
    import subprocess
    import sys

    target = tmp_path / "saved-then-pushed"
    result = subprocess.run([sys.executable, "-c", SAVE_AND_PUSH, str(saved_tiny_llama), str(target), "me/saved"],
                            capture_output=True, text=True, timeout=300, env=hub_env(hub.url, tmp_path / "home"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (target / "model.pt2").is_file()
    files = hub.state.repos["me/saved"]["files"]
    assert files["model.safetensors"] == (target / "model.safetensors").read_bytes()
    assert "README.md" in files and "model.pt2" in files


def test_save_pretrained_names_the_options_it_ignores(compiled_model, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        compiled_model("llama").save_pretrained(tmp_path / "saved", safe_serialization=True, max_shard_size="1GB")
    assert (tmp_path / "saved" / "model.pt2").is_file()
    assert "save_pretrained: max_shard_size, safe_serialization ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        NeuronModelForCausalLM.from_pretrained(tmp_path / "saved", device_map="auto", local_files_only=True)
    assert "from_pretrained: device_map ignored" in caplog.text
