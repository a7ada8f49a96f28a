"""push_to_hub / from_pretrained(repo_id) against a local Hub-compatible server (HF_ENDPOINT points to it)."""

import os
import socket

import pytest
import torch

from conftest import generate_in_fresh_process, seed_compile_cache
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
    assert sorted(files) == ["README.md", "config.json", "generation_config.json", "model.pt2", "neuron_config.json",
                             "neuronx_weights.safetensors"]
    card = files["README.md"].decode()
    for line in ("| batch_size | 3 |", "| sequence_length | 64 |", "| context buckets | [16] |",
                 "| token-generation buckets | [32, 64] |", "| dtype (auto_cast_type) | fp32 |",
                 f"| torch | {torch.__version__} |", "library_name: optimum-neuronx", "pipeline_tag: text-generation",
                 'NeuronModelForCausalLM.from_pretrained("me/tiny-llama")'):
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


@pytest.mark.slow
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


def test_hub_backed_compile_cache_shares_entries_and_skips_damaged_or_untrusted_ones(hub, tiny_checkpoint, tmp_path):
    """One machine compiles and pushes; a trusted one fetches and compiles nothing; an untrusted one never consults
    the Hub, and a graph file damaged on the Hub (no longer its sha256) is evicted: those two go on to compile (this
    test's processes refuse to, so that only machine-a compiles; the refusal shows they got that far)."""
    import subprocess
    import sys

    def cached_export(machine, mode, trust="trust"):
        env = dict(hub_env(hub.url, tmp_path / f"home-{machine}"),
                   OPTIMUM_NEURONX_PROVENANCE=str(tmp_path / f"provenance-{machine}"))
        return subprocess.run([sys.executable, "-c", CACHED_EXPORT, str(tiny_checkpoint("qwen3")),
                               str(tmp_path / machine), "me/compile-cache", mode, trust], capture_output=True,
                              text=True, timeout=600, env=env)

    def refused_to_compile(result):
        return result.returncode != 0 and "AssertionError: compiled despite the Hub cache" in result.stderr

    first = cached_export("machine-a", "compile")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Compile cache miss" in first.stderr and "Pushed compile cache entry" in first.stderr
    assert hub.state.repos["me/compile-cache"]["private"] is True  # created private: it names the models it holds
    files = hub.state.repos["me/compile-cache"]["files"]
    assert any(name.endswith("/model.pt2") for name in files) and any(n.endswith("/cache_entry.json") for n in files)
    assert not any(name.endswith(".safetensors") for name in files)  # entries hold graphs, never weights

    second = cached_export("machine-b", "refuse-compile")  # empty local cache, same Hub repo, trusted
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Fetched compile cache entry" in second.stderr and "Compile cache hit" in second.stderr
    assert second.stdout == first.stdout

    # without trust_remote_code the Hub entries' native code is never fetched: this machine would compile
    untrusted = cached_export("machine-c", "refuse-compile", trust="no")
    assert refused_to_compile(untrusted), untrusted.stderr[-3000:]
    assert "is not consulted" in untrusted.stderr and "Fetched compile cache entry" not in untrusted.stderr

    graph_name = next(name for name in files if name.endswith("/model.pt2"))
    graph = bytearray(files[graph_name])
    graph[len(graph) // 2] ^= 0x55
    files[graph_name] = bytes(graph)
    damaged = cached_export("machine-d", "refuse-compile")
    assert refused_to_compile(damaged), damaged.stderr[-3000:]
    assert "is corrupted (model.pt2 does not match its sha256): evicted" in damaged.stderr


EXPORT_AND_PUSH_WITHOUT_WEIGHTS = """
import sys
from optimum_neuronx import NeuronModelForCausalLM
m = NeuronModelForCausalLM.from_pretrained(sys.argv[1], export=True, batch_size=3, sequence_length=64,
                                           context_buckets=[16], token_buckets=[32, 64], continuous_batching=True)
m.push_to_hub(sys.argv[2], include_weights=False)
"""


def test_an_export_pushed_without_weights_takes_them_from_its_source(hub, tiny_checkpoint, compiled_model, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    source = tiny_checkpoint("llama")
    compiled_model("llama")  # the export below has its shapes: a hit in the session's compile cache
    hub.state.repos["me/source"] = {"sha": "5" * 40, "files": {p.name: p.read_bytes() for p in source.iterdir()
                                                                if p.is_file()}}
    result = subprocess.run([sys.executable, "-c", EXPORT_AND_PUSH_WITHOUT_WEIGHTS, "me/source", "me/no-weights"],
                            capture_output=True, text=True, timeout=600, env=hub_env(hub.url, tmp_path / "exporter"))
    assert result.returncode == 0, result.stderr[-3000:]
    files = hub.state.repos["me/no-weights"]["files"]
    assert "neuronx_weights.safetensors" not in files and "model.pt2" in files
    card = files["README.md"].decode()
    assert "base_model: me/source" in card and "The weights are not in this repo" in card

    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    prompt = {"input_ids": torch.tensor([[5, 17, 42, 99]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    expected = reference.generate(**prompt, max_new_tokens=20, do_sample=False).tolist()
    result, tokens = generate_in_fresh_process("me/no-weights", prompt, 20, env=hub_env(hub.url, tmp_path / "user"))
    assert "was pushed without its weights: converting them from me/source@" + "5" * 40 in result.stderr
    assert tokens == expected

    # the source's weights change under the same name: refused, naming both digests
    weights = bytearray(hub.state.repos["me/source"]["files"]["model.safetensors"])
    weights[-64:] = bytes(b ^ 0x55 for b in weights[-64:])
    hub.state.repos["me/source"]["files"]["model.safetensors"] = bytes(weights)
    other_user = dict(hub_env(hub.url, tmp_path / "other-user"), OPTIMUM_NEURONX_CACHE=str(tmp_path / "other-cache"),
                      OPTIMUM_NEURONX_PROVENANCE=str(tmp_path / "other-provenance"))
    result, _ = generate_in_fresh_process("me/no-weights", prompt, 5, env=other_user, check=False)
    assert result.returncode != 0
    assert "converted here, have sha256" in result.stderr and "not the one the export was made from" in result.stderr


def test_push_without_weights_of_a_local_export_is_refused(compiled_model):
    with pytest.raises(ValueError, match=r"include_weights=False: .* exported from a local directory"):
        compiled_model("llama").push_to_hub("me/anything", include_weights=False)


def test_optimum_neuron_command_line_from_the_hub(hub, tiny_checkpoint, tmp_path):
    """optimum-neuron's export command, flag for flag, with --cache_dir as the download cache."""
    import subprocess
    import sys
    from pathlib import Path

    source = tiny_checkpoint("qwen3")
    hub.state.repos["me/qwen3"] = {"sha": "7" * 40, "files": {p.name: p.read_bytes() for p in source.iterdir()
                                                               if p.is_file()}}
    cli = str(Path(sys.executable).parent / "optimum-cli")
    downloads = tmp_path / "downloads"
    result = subprocess.run(
        [cli, "export", "neuron", "--model", "me/qwen3", "--task", "text-generation", "--batch_size", "1",
         "--sequence_length", "64", "--num_cores", "2", "--auto_cast_type", "bf16", "--cache_dir", str(downloads),
         "--compile_cache_dir", str(tmp_path / "compile-cache"), "-O1", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env=hub_env(hub.url, tmp_path / "home"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(downloads.rglob("config.json")), "the checkpoint was not downloaded into --cache_dir"
    from optimum_neuronx import NeuronConfig

    nc = NeuronConfig.from_pretrained(tmp_path / "out")
    assert (nc.tp_degree, nc.auto_cast_type, nc.backend, nc.compiler_args) == (2, "bf16", "neuron", ("-O1",))
    meta = __import__("json").loads((tmp_path / "out" / "neuron_config.json").read_text())
    assert meta["source"] == {"repo_id": "me/qwen3", "revision": "7" * 40, "subfolder": ""}
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
    assert files["neuronx_weights.safetensors"] == (target / "neuronx_weights.safetensors").read_bytes()
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


def test_cache_create_synchronize_and_lookup_through_the_hub(hub, tiny_checkpoint, compiled_model, tmp_path):
    """A private cache repo is created, local entries pushed once, and lookup reads the Hub's entries' keys."""
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).parent / "optimum-cli")
    env = hub_env(hub.url, tmp_path / "home")
    cache = ["--compile_cache_dir", str(tmp_path / "local-cache")]
    run = lambda *args: subprocess.run([cli, "neuron", "cache", *args], capture_output=True, text=True,  # noqa: E731
                                       timeout=600, env=env)
    # created from another home: `create` makes the repo this home's default, which would push on export
    created = subprocess.run([cli, "neuron", "cache", "create", "me/shared-cache"], capture_output=True, text=True,
                             timeout=600, env=hub_env(hub.url, tmp_path / "creator-home"))
    assert created.returncode == 0, created.stderr[-2000:]
    assert hub.state.repos["me/shared-cache"]["private"] is True and "private compile cache repo" in created.stdout

    seed_compile_cache(tmp_path / "local-cache", tiny_checkpoint("mistral"), compiled_model("mistral"))
    first = run("synchronize", *cache, "--cache_repo", "me/shared-cache")
    assert first.returncode == 0 and "pushed 1 entries" in first.stdout, first.stderr[-2000:]
    assert run("synchronize", *cache, "--cache_repo", "me/shared-cache").stdout.startswith("pushed 0 entries")
    assert not any(name.endswith(".safetensors") for name in hub.state.repos["me/shared-cache"]["files"])

    lookup = run("lookup", str(tiny_checkpoint("mistral")), "--batch_size", "3", "--sequence_length", "64",
                 "--context_buckets", "16", "--token_buckets", "32,64", "--continuous_batching",
                 "--compile_cache_dir", str(tmp_path / "empty-cache"),
                 "--cache_repo", "me/shared-cache")
    assert lookup.returncode == 0, lookup.stdout + lookup.stderr[-2000:]
    assert "0 cached exports of this model in" in lookup.stdout and "1 in the Hub repo me/shared-cache" in lookup.stdout
    assert "hub  " in lookup.stdout and "cache hit" in lookup.stdout


NEURON_CONFIG_FROM_HUB = """
import json, sys
from optimum_neuronx import NeuronConfig
print(json.dumps(NeuronConfig.from_pretrained(sys.argv[1]).to_dict()))
"""


def test_neuron_config_from_a_hub_repo_reads_only_its_config(hub, saved_tiny_llama, tmp_path):
    import json
    import subprocess
    import sys

    assert push(saved_tiny_llama, "me/config-only", hub_env(hub.url, tmp_path / "push")).returncode == 0
    before = len(hub.state.requests)
    result = subprocess.run([sys.executable, "-c", NEURON_CONFIG_FROM_HUB, "me/config-only"], capture_output=True,
                            text=True, timeout=300, env=hub_env(hub.url, tmp_path / "read"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["batch_size"] == 3
    fetched = [r for r in hub.state.requests[before:] if "/resolve/" in r]
    assert fetched and all(r.endswith("/neuron_config.json") for r in fetched), fetched


def test_optimum_neuron_cache_commands_and_variables(hub, tiny_checkpoint, tmp_path):
    """optimum-neuron's spellings: `cache create` with no name or `-n NAME` (in the user's namespace, then the default
    cache repo), `cache set NAME`, `--repo_id` on lookup / synchronize, `--dtype` on lookup, CUSTOM_CACHE_REPO."""
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).parent / "optimum-cli")
    env = {**hub_env(hub.url, tmp_path / "home"), "HF_TOKEN": "hf_test"}
    run = lambda *args, **extra: subprocess.run([cli, "neuron", "cache", *args], capture_output=True,  # noqa: E731
                                                text=True, timeout=600, env={**env, **extra})
    created = run("create")
    assert created.returncode == 0, created.stderr[-2000:]
    assert hub.state.repos["me/optimum-neuronx-cache"]["private"] is True
    assert run("create", "-n", "named-cache").returncode == 0 and "me/named-cache" in hub.state.repos
    assert (tmp_path / "home" / "optimum-neuronx" / "cache_repo").read_text().strip() == "me/named-cache"
    assert run("set", "me/optimum-neuronx-cache").returncode == 0
    assert (tmp_path / "home" / "optimum-neuronx" / "cache_repo").read_text().strip() == "me/optimum-neuronx-cache"
    lookup = ["lookup", str(tiny_checkpoint("mistral")), "--sequence_length", "32", "--context_buckets", "16",
              "--token_buckets", "32", "--dtype", "fp32", "--compile_cache_dir", str(tmp_path / "empty")]
    for args, extra in [((), {}), (("--repo_id", "me/named-cache"), {}), ((), {"CUSTOM_CACHE_REPO": "me/named-cache"})]:
        result = run(*lookup, *args, **extra)
        assert result.returncode == 1 and "cache miss" in result.stdout, result.stderr[-2000:]  # nothing cached yet
        expected = "me/named-cache" if args or extra else "me/optimum-neuronx-cache"
        assert f"0 in the Hub repo {expected}" in result.stdout, result.stdout
    synchronized = run("synchronize", "--compile_cache_dir", str(tmp_path / "empty"), "--repo_id", "me/named-cache")
    assert synchronized.returncode == 0 and "to me/named-cache" in synchronized.stdout, synchronized.stderr[-2000:]


OPTIMUM_NEURON_PUSH = """
import sys
from optimum_neuronx import NeuronModelForCausalLM
model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
model.save_pretrained(sys.argv[2])
model.push_to_hub(sys.argv[2], sys.argv[3], private=True, revision="main", token="hf_test", endpoint=sys.argv[4])
try:
    model.push_to_hub(sys.argv[2] + "-missing", sys.argv[3], endpoint=sys.argv[4])
except ValueError as err:
    print("refused:", err)
"""


def test_optimum_neuron_push_to_hub_signature(hub, saved_tiny_llama, tmp_path):
    """push_to_hub(save_directory, repository_id, private=, revision=, token=, endpoint=) pushes that directory to
    repository_id (not to a repo named after the folder), at the endpoint given (HF_ENDPOINT points elsewhere)."""
    import subprocess
    import sys

    env = {**hub_env("http://127.0.0.1:9", tmp_path / "home")}  # nothing listens there: only `endpoint` can work
    result = subprocess.run([sys.executable, "-c", OPTIMUM_NEURON_PUSH, str(saved_tiny_llama), str(tmp_path / "saved"),
                             "me/optimum-neuron-style", hub.url], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    repo = hub.state.repos["me/optimum-neuron-style"]
    assert repo["private"] is True and "saved" not in hub.state.repos
    assert repo["files"]["model.pt2"] == (tmp_path / "saved" / "model.pt2").read_bytes()
    assert "refused:" in result.stdout and "is not a directory" in result.stdout
