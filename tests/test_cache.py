"""Compile cache: hit, miss with its reason, corruption, concurrent exports, and the CLI."""

import json
import logging
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import BF16_EXPORT, seed_compile_cache, tiny_export
from optimum_neuronx import NeuronConfig, NeuronModelForCausalLM
from optimum_neuronx.cache import CompileCache
from optimum_neuronx.backends.workers import COMPILE_WORKERS_ENV
from optimum_neuronx.backends import get_backend
from optimum_neuronx.exporters.plan import plan_export

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")
PROMPT = torch.tensor([[7, 8, 9, 10]])


def _export(checkpoint, cache_dir):
    """A qwen2 checkpoint exported with the session's shapes (TINY_EXPORT) through the compile cache at `cache_dir`."""
    return NeuronModelForCausalLM.from_pretrained(checkpoint, export=True, compile_cache_dir=cache_dir,
                                                  **tiny_export("qwen2"))


@pytest.fixture(scope="module")
def filled_cache(tiny_checkpoint, compiled_model, tmp_path_factory):
    """A cache holding the session's qwen2 export (TINY_EXPORT's shapes), and that export's tokens for PROMPT."""
    model = compiled_model("qwen2")
    cache_dir = seed_compile_cache(tmp_path_factory.mktemp("cache"), tiny_checkpoint("qwen2"), model)
    return cache_dir, model.generate(PROMPT, max_new_tokens=20, do_sample=False)


def test_second_export_is_a_cache_hit_and_compiles_nothing(filled_cache, tiny_checkpoint, monkeypatch, caplog):
    cache_dir, tokens = filled_cache

    def refuse(*args, **kwargs):
        raise AssertionError("compiled despite a cache hit")

    monkeypatch.setattr(get_backend("inductor"), "compile", refuse)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        model = _export(tiny_checkpoint("qwen2"), cache_dir)
    assert "Compile cache hit" in caplog.text and "nothing to compile" in caplog.text
    assert torch.equal(model.generate(PROMPT, max_new_tokens=20, do_sample=False), tokens)


def test_a_fine_tune_reuses_the_base_models_graphs(filled_cache, tiny_checkpoint, tmp_path, monkeypatch, caplog):
    """Same config, other weights: a cache hit that compiles nothing and generates the fine-tune's tokens."""
    from transformers import AutoModelForCausalLM

    cache_dir, base_tokens = filled_cache
    tuned = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"))
    with torch.no_grad():
        for parameter in tuned.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    tuned.save_pretrained(tmp_path / "fine-tune")
    expected = tuned.eval().generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=20,
                                     do_sample=False)
    assert not torch.equal(expected, base_tokens)  # other weights, other tokens: the test can fail

    def refuse(*args, **kwargs):
        raise AssertionError("compiled despite a cache hit")

    monkeypatch.setattr(get_backend("inductor"), "compile", refuse)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        model = _export(tmp_path / "fine-tune", cache_dir)
    assert "Compile cache hit" in caplog.text
    assert torch.equal(model.generate(PROMPT, max_new_tokens=20, do_sample=False), expected)
    for entry, _ in CompileCache(cache_dir).entries():  # graphs only: no weights in the cache
        assert not list(entry.glob("*.safetensors")) and (entry / "model.pt2").is_file()


def test_miss_says_which_field_differs(filled_cache, tiny_checkpoint):
    cache_dir, _ = filled_cache
    plan = plan_export(str(tiny_checkpoint("qwen2")), NeuronConfig(**tiny_export(
        "qwen2", sequence_length=48, token_buckets=[32, 48])), check_host_memory=False)
    cache = CompileCache(cache_dir)
    key = plan.cache_key()
    assert cache.lookup(key) is None
    reason = cache.miss_reason(key)
    assert "neuron_config.sequence_length: cached 64, requested 48" in reason
    assert "neuron_config.token_buckets: cached [32, 64], requested [32, 48]" in reason
    assert CompileCache(cache_dir.parent / "empty").miss_reason(key) == "the cache is empty"


EXPORT_AND_SAVE = """
import json, logging, sys
from optimum_neuronx import NeuronModelForCausalLM
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
NeuronModelForCausalLM.from_pretrained(sys.argv[1], export=True, compile_cache_dir=sys.argv[2],
                                       **json.loads(sys.argv[3])).save_pretrained(sys.argv[4])
"""


@pytest.mark.slow
def test_corrupted_entry_is_evicted_and_recompiled(tiny_checkpoint, tmp_path):
    # Both compiles in fresh processes: in one that has compiled other graphs, Inductor can make other fusion choices.
    def export_and_save(out: str, workers: str):
        result = subprocess.run([sys.executable, "-c", EXPORT_AND_SAVE, str(tiny_checkpoint("gpt2")),
                                 str(tmp_path / "cache"), json.dumps(BF16_EXPORT), str(tmp_path / out)],
                                capture_output=True, text=True, timeout=600,
                                env={**os.environ, COMPILE_WORKERS_ENV: workers})
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    export_and_save("first", "2")  # 2 graphs (gpt2 in bfloat16) compiled in forked workers, stored in the cache
    (entry, _), = CompileCache(tmp_path / "cache").entries()
    graph = entry / "model.pt2"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content: only the hash can tell
    graph.write_bytes(bytes(data))
    log = export_and_save("again", "1")  # the graphs one after the other in the process: the same C++
    assert "is corrupted (model.pt2 does not match its sha256): evicted, recompiling" in log
    assert "Compile cache miss" in log and "Stored the compiled graphs in the compile cache" in log
    first, again = (NeuronModelForCausalLM.from_pretrained(tmp_path / name) for name in ("first", "again"))
    assert torch.equal(again.generate(PROMPT, max_new_tokens=10, do_sample=False),
                       first.generate(PROMPT, max_new_tokens=10, do_sample=False))
    sources = _cpp_sources(first.artifact_dir / "model.pt2")
    assert len(sources) == 2 * len(first.neuron_config.graphs())  # 2 graphs (context, token), 2 sources each
    assert sources == _cpp_sources(again.artifact_dir / "model.pt2")


def _cpp_sources(package: Path) -> dict:
    """The C++ files in an AOTInductor package, without the paths of the build directory they were written in."""
    with zipfile.ZipFile(package) as archive:
        build_dir = re.compile(r"[^\s\"']*optimum-neuronx-aoti-[^/\s\"']*")
        return {name.rsplit("/", 1)[-1]: build_dir.sub("", archive.read(name).decode())
                for name in archive.namelist() if name.endswith(".cpp")}


EXPORT_SCRIPT = """
import logging, sys
from optimum_neuronx import NeuronModelForCausalLM
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
m = NeuronModelForCausalLM.from_pretrained(sys.argv[1], export=True, compile_cache_dir=sys.argv[2], batch_size=1,
                                           sequence_length=32, context_buckets=[16], token_buckets=[32])
m.save_pretrained(sys.argv[3])
"""


@pytest.mark.slow
def test_concurrent_exports_of_one_key_compile_once(tiny_checkpoint, tmp_path):
    # a fresh cache: exactly one of the two processes must compile
    cache_dir = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", EXPORT_SCRIPT, str(tiny_checkpoint("mistral")), str(cache_dir),
                               str(tmp_path / f"out{i}")], stderr=subprocess.PIPE, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert sum("Compile cache miss" in log for log in logs) == 1
    assert sum("Compile cache hit" in log for log in logs) == 1
    assert len(list(CompileCache(cache_dir).entries())) == 1
    a, b = (NeuronModelForCausalLM.from_pretrained(tmp_path / f"out{i}") for i in range(2))
    assert torch.equal(a.generate(PROMPT, max_new_tokens=10, do_sample=False),
                       b.generate(PROMPT, max_new_tokens=10, do_sample=False))


def test_cache_cli_list_lookup_clear(filled_cache, tiny_checkpoint):
    cache_dir, _ = filled_cache
    run = lambda *args: subprocess.run(  # noqa: E731
        [OPTIMUM_CLI, "neuron", "cache", *args, "--compile_cache_dir", str(cache_dir)], capture_output=True, text=True,
        timeout=300)
    listed = run("list")
    assert listed.returncode == 0 and "qwen2  batch_size=3 sequence_length=64 fp32 inductor tp=1" in listed.stdout
    # lookup reads the config only: a directory holding nothing else answers the same
    config_only = cache_dir.parent / "config-only"
    config_only.mkdir(exist_ok=True)
    (config_only / "config.json").write_bytes((tiny_checkpoint("qwen2") / "config.json").read_bytes())
    options = [str(config_only), "--batch_size", "3", "--sequence_length", "64", "--context_buckets", "16",
               "--continuous_batching", "--token_buckets", "32,64"]
    hit = run("lookup", *options)
    assert hit.returncode == 0, hit.stderr
    assert "1 cached exports of this model" in hit.stdout and "cache hit " in hit.stdout
    miss = run("lookup", *options[:-1], "16,32,64")
    assert miss.returncode == 1 and "token_buckets: cached [32, 64], requested [16, 32, 64]" in miss.stdout
    assert run("clear").stdout.startswith("removed ")
    assert "0 entries" in run("list").stdout
