"""backend="neuron" end to end on the XLA CPU device: export, the artifact and its manifest, parity with Transformers
at tp_degree 1, 2 and 4 (virtual CPU devices, conftest sets XLA_FLAGS), reload without compiling, the KV cache kept
on the device, the ahead-of-time NEFF compile through a fake neuronx-cc, and the errors."""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import re
import sys

import pytest
import torch

from conftest import (ARCHITECTURES, BF16_BLOCK_KINDS, BF16_EXPORT, NEURON_EXPORT, SLIDING_WINDOW_FAMILIES,
                      SMOLLM2_EXPORT, STATIC_BATCHES, assert_bf16_logits_within_tolerance,
                      assert_staggered_requests_match_generate_alone, left_padded_prompts, tiny_export)
from optimum_neuronx import NeuronConfig, NeuronModelForCausalLM
from optimum_neuronx.modeling.decoder import StaticDecoder
from optimum_neuronx.verification import compare_generation

pytest.importorskip("torch_mlir", reason="the [neuron] extra (torch-mlir) is not installed")
pytest.importorskip("jax", reason="the [neuron] extra (jax, jaxlib) is not installed")

from optimum_neuronx.backends.neuron import backend as neuron  # noqa: E402
from optimum_neuronx.backends.neuron import neuronx_cc, pjrt  # noqa: E402

pytestmark = pytest.mark.pjrt  # every test here may start the PJRT client


def refuse(*args, **kwargs):
    raise AssertionError("compilation (or weight loading) attempted where none may happen")


@pytest.fixture(scope="session")
def neuron_model(tiny_checkpoint):
    """tp_degree -> the tiny Llama exported with backend="neuron" (once per session)."""
    return functools.cache(lambda tp: NeuronModelForCausalLM.from_pretrained(
        tiny_checkpoint("llama"), export=True, num_cores=tp, **NEURON_EXPORT))


def _compare(model, reference, new_tokens=40, **kwargs):
    input_ids, attention_mask = left_padded_prompts([16, 11, 5], seed=7)
    return compare_generation(reference, model, input_ids, attention_mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, **kwargs)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers_across_buckets(neuron_model, reference_model, tp):
    # 3 left-padded prompts of 16 tokens + 40 new ones: token graph 32 then 64, on tp virtual devices
    result = _compare(neuron_model(tp), reference_model("llama"))
    print(f"tp_degree={tp}: {result.summary()}")
    assert result.tokens_match and result.max_logit_diff < 1e-4
    assert_staggered_requests_match_generate_alone(neuron_model(tp))  # the same graphs through the engine


# Every family in float32 on one device; compiled on two devices for an MHA family (gpt2) and a MoE one (mixtral),
# llama (dense GQA) at 1, 2 and 4 above; every family's sharded layout is checked eagerly at the end of this file.
@pytest.mark.slow
@pytest.mark.parametrize("model_type, tp", [(a, 1) for a in ARCHITECTURES if a != "llama"]
                         + [("gpt2", 2), ("mixtral", 2)])
def test_every_architecture_matches_transformers(tiny_checkpoint, reference_model, model_type, tp):
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), export=True, num_cores=tp,
                                                   **tiny_export(model_type, backend="neuron"))
    result = _compare(model, reference_model(model_type))
    print(f"{model_type} tp_degree={tp}: {result.summary()}")
    assert result.tokens_match and result.max_logit_diff < 1e-4
    if model_type == "mixtral" and tp == 2:  # decode steps gather their rows' experts (3 rows x 2 of 8 experts)
        manifest = json.loads((model.artifact_dir / neuron.MANIFEST_NAME).read_text())
        axes = {a["name"].rsplit(".", 2)[-2]: a["sharded_axis"] for a in manifest["graphs"]["token_32"]["arguments"]
                if a["name"].endswith(".weight")}
        # every expert cut across the devices ([layers, experts, 2 I, H] by 2 I, [layers, experts, H, I] by I)
        assert (axes["experts_gate_up"], axes["experts_down"], axes["router"]) == (2, 3, None)
    if model_type == "phi3":  # its family export keeps context graphs (LongRoPE switches a static batch together)
        model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), export=True, num_cores=tp,
                                                       **tiny_export(model_type, backend="neuron",
                                                                     continuous_batching=True))
    assert_staggered_requests_match_generate_alone(model)  # requests joining and leaving the batch


# The sliding-window families at tp 1 above; here their windows over sharded caches
@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLIDING_WINDOW_FAMILIES)
def test_sliding_windows_match_transformers_across_devices(model_type, tiny_checkpoint, reference_model):
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), export=True, num_cores=2,
                                                   **dict(NEURON_EXPORT, **STATIC_BATCHES))
    result = _compare(model, reference_model(model_type))
    print(f"{model_type} tp_degree=2: {result.summary()}")
    assert result.tokens_match and result.max_logit_diff < 1e-4


@pytest.mark.slow
def test_speculation_verifies_drafts_across_devices(tiny_checkpoint, reference_model):
    """Verification graphs (3 drafted tokens) sharded over 2 devices: prompt lookup and a draft model give plain
    greedy's tokens, across the 32 -> 64 bucket."""
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, num_cores=2,
                                                   **dict(NEURON_EXPORT, batch_size=1), speculation_length=3)
    assert {"verify_32", "verify_64"} <= set(model._graphs)
    prompt = torch.tensor([[21, 22, 23, 24, 25, 21, 22, 23, 24, 25, 21, 22]])
    expected = reference_model("llama").generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    for options in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=reference_model("llama"))):
        actual = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, **options)
        assert torch.equal(actual, expected), options


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_logits_equal_one_device(neuron_model, tp):
    input_ids, attention_mask = left_padded_prompts([16, 11, 5], seed=8)
    kwargs = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    one = neuron_model(1).generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    sharded = neuron_model(tp).generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(one.sequences, sharded.sequences)
    # the same sums in another order (partial sums reduced across devices): float32 rounding apart
    torch.testing.assert_close(torch.stack(sharded.logits), torch.stack(one.logits), rtol=1e-4, atol=5e-5)
    # 4 devices and 2 KV heads: each KV head repeated so that every device holds one
    cache = neuron_model(tp).artifact_dir
    manifest = json.loads((cache / neuron.MANIFEST_NAME).read_text())
    assert manifest["tp_degree"] == tp and manifest["layout"]["num_kv_heads"] == 2
    kv_arg = next(a for a in manifest["graphs"]["token_64"]["arguments"] if a["name"] == "kv_cache")
    assert kv_arg["shape"][3] == max(2, tp) and kv_arg["sharded_axis"] == 3
    text = (cache / "token_64.mlir").read_text()
    assert f'mhlo.sharding = "{{devices=[1,1,1,{tp},1,1]{",".join(map(str, range(tp)))}}}"' in text


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_attends_with_its_own_heads(neuron_model, tp):
    # In the partitioned program XLA compiled: one reduction after each row-parallel projection (o, down), and
    # nothing gathered as large as one layer's keys (the weights and the cache window stay split by head).
    import math
    import re

    model = neuron_model(tp)
    hlo = model._graphs["token_64"].executable.executable.hlo_modules()[0].to_string()
    assert len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo)) == 2 * model.config.num_hidden_layers
    gathered = [math.prod(int(n) for n in shape.split(",") if n)
                for shape in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)]
    batch, kv_heads, window, head_dim = 3, 2, 64, 16
    assert gathered and max(gathered) < batch * kv_heads * window * head_dim


@pytest.mark.slow
def test_sampling_and_beam_search_run_on_device(neuron_model, reference_model):
    model = neuron_model(2)
    input_ids, attention_mask = left_padded_prompts([9], seed=3)
    sampled = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, top_k=20,
                             temperature=0.8, max_new_tokens=12)
    assert sampled.shape == (1, 9 + 12)
    torch.manual_seed(0)
    first = model.generate(input_ids=input_ids, do_sample=True, max_new_tokens=12)
    torch.manual_seed(0)
    assert torch.equal(first, model.generate(input_ids=input_ids, do_sample=True, max_new_tokens=12))
    # beam search reorders the cache on the device (DeviceKVCache.reorder): same beams as Transformers
    kwargs = dict(num_beams=3, max_new_tokens=10, do_sample=False)
    ours = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    theirs = reference_model("llama").generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(ours, theirs)


@pytest.mark.slow
def test_the_kv_cache_stays_on_the_device(neuron_model, monkeypatch):
    model = neuron_model(2)
    input_ids, _ = left_padded_prompts([6], seed=4)
    out = model(input_ids=input_ids)
    cache = model._engine.cache.kv
    assert isinstance(cache, neuron.DeviceKVCache)
    before = cache.buffer
    host_copies = []
    real = neuron.to_torch
    monkeypatch.setattr(neuron, "to_torch", lambda array: host_copies.append(array.shape) or real(array))
    model(input_ids=input_ids[:, -1:], past_key_values=out.past_key_values)
    assert before.is_deleted()  # donated to the token graph, which returned the written cache
    assert cache.buffer is not before and not cache.buffer.is_deleted()
    assert len(cache.buffer.sharding.device_set) == 2
    assert host_copies == [(3, 256)]  # only the logits came back to the host
    assert neuron.to_torch(cache.buffer)[:, :, 0, :, 6].abs().sum() > 0  # the token's K/V, written at slot 6


def test_artifact_holds_portable_modules_hlo_executables_and_a_manifest(neuron_model):
    directory = neuron_model(1).artifact_dir
    manifest = json.loads((directory / neuron.MANIFEST_NAME).read_text())
    stamp = json.loads((directory / "neuron_config.json").read_text())
    # (continuous batching: prefill and fused graphs)
    assert set(manifest["graphs"]) == {"prefill_16", "token_32", "token_64", "fused_32", "fused_64"}
    assert manifest["executables"]["platform"] == "cpu" and manifest["instance_type"] == "inf2.48xlarge"
    for name, entry in manifest["graphs"].items():
        assert entry["files"] == {"mlir": f"{name}.mlir", "mlirbc": f"{name}.mlirbc", "hlo": f"{name}.hlo.pb",
                                  "pjrt": f"{name}.pjrt"}
        assert set(entry["sha256"]) == set(entry["files"].values())
        assert all(file in stamp["files"] for file in entry["files"].values())
        names = [a["name"] for a in entry["arguments"]]
        assert names[-7:] == list(StaticDecoder.INPUT_NAMES[:7]) and "layers.qkv_proj.weight" in names
        assert entry["aliases"] == {str(names.index("kv_cache")): 0} and entry["outputs"] == ["kv_cache", "logits"]
    # the portable artifact is StableHLO bytecode a consumer reads back into the same module
    from jaxlib.mlir.dialects import stablehlo

    text = stablehlo.deserialize_portable_artifact_str((directory / "token_32.mlirbc").read_bytes())
    assert b"stablehlo" in text or "stablehlo" in str(text)
    assert (directory / "token_32.hlo.pb").stat().st_size > 1000
    assert not (directory / "model.pt2").exists()


def test_reload_runs_without_compiling(neuron_model, reference_model, tmp_path, monkeypatch, caplog):
    import logging

    neuron_model(1).save_pretrained(tmp_path / "saved")
    monkeypatch.setattr(pjrt.PjrtGraph, "compile", refuse)
    monkeypatch.setattr(neuron, "lower_graph", refuse)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        model = NeuronModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert "the neuron graphs run on the XLA CPU device" in caplog.text
    assert "(no compilation)" in caplog.text
    assert _compare(model, reference_model("llama"), new_tokens=20).tokens_match


@pytest.mark.slow
def test_bf16_export_is_within_bf16_noise(tiny_checkpoint, reference_model):
    # its own export: the Llama block in bfloat16 (neuron_model is float32)
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, auto_cast_type="bf16",
                                                   **dict(NEURON_EXPORT, **STATIC_BATCHES))
    input_ids, attention_mask = left_padded_prompts([16, 11, 5], seed=5)
    assert_bf16_logits_within_tolerance(model, tiny_checkpoint, reference_model, input_ids, attention_mask)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", BF16_BLOCK_KINDS)
def test_bf16_logits_of_every_block_kind_within_bf16_noise(model_type, tiny_checkpoint, reference_model):
    # its own export: bfloat16
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), export=True, backend="neuron",
                                                   **BF16_EXPORT)
    input_ids, attention_mask = left_padded_prompts([14, 9], seed=5)
    assert_bf16_logits_within_tolerance(model, tiny_checkpoint, reference_model, input_ids, attention_mask,
                                        model_type)


@pytest.mark.slow
def test_cli_export_and_verify(tiny_checkpoint, tmp_path):
    # neuron_model(2)'s shapes: a hit in the session's compile cache once that export is made
    out = tmp_path / "cli-neuron"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    export = subprocess.run([sys.executable, "-m", "optimum_neuronx.commands", "--model",
                             str(tiny_checkpoint("llama")), "--backend", "neuron", "--batch_size", "3",
                             "--sequence_length", "64", "--context_buckets", "16", "--token_buckets", "32,64",
                             "--continuous_batching", "--num_cores", "2", str(out)], capture_output=True, text=True, env=env)
    assert export.returncode == 0, export.stderr[-3000:]
    assert "compiled token_64" in export.stdout
    verify = subprocess.run([sys.executable, "-m", "optimum_neuronx.commands.verify", str(out)],
                            capture_output=True, text=True, env=env)
    assert verify.returncode == 0 and "OK" in verify.stdout, verify.stdout + verify.stderr[-2000:]


@pytest.mark.slow
def test_pipeline_on_smollm2_matches_eager(smollm2_checkpoint):
    # the real model on the neuron backend (its own export)
    import transformers

    from optimum_neuronx import pipeline

    model = NeuronModelForCausalLM.from_pretrained(smollm2_checkpoint, export=True, backend="neuron",
                                                   **SMOLLM2_EXPORT)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_checkpoint)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    eager = transformers.pipeline("text-generation", model=str(smollm2_checkpoint))
    greedy = dict(max_new_tokens=16, do_sample=False)
    prompts = ["The capital of France is", "Once upon a time, in a small village,"]
    assert pipe(prompts, **greedy) == eager(prompts, **greedy)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert pipe(chat, **greedy)[0]["generated_text"][-1]["content"] == "The capital of France is Paris."


# -- the ahead-of-time NEFF compile, with a fake neuronx-cc on PATH -----------------------------------------------

FAKE_NEURONX_CC = """\
#!{python}
import json, os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_NEURONX_CC_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_NEURONX_CC_FAIL"):
    print("ERROR: the fake compiler was told to fail")
    sys.exit(70)
# side by side: wait (a while at most) until another graph's compile has started too
marker = os.path.join(os.environ["FAKE_NEURONX_CC_DIR"], os.path.basename(args[1]))
open(marker, "w").close()
for _ in range(200):
    if len(os.listdir(os.environ["FAKE_NEURONX_CC_DIR"])) >= 2:
        break
    time.sleep(0.05)
else:
    sys.exit("no other compile ran at the same time")
with open(args[args.index("--output") + 1], "wb") as out:
    out.write(b"NEFF" + os.path.basename(args[1]).encode())
"""


@pytest.fixture
def fake_neuronx_cc(tmp_path, monkeypatch):
    bin_dir, markers = tmp_path / "bin", tmp_path / "markers"
    bin_dir.mkdir()
    markers.mkdir()
    script = bin_dir / "neuronx-cc"
    script.write_text(FAKE_NEURONX_CC.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NEURONX_CC_LOG", str(tmp_path / "argv.jsonl"))
    monkeypatch.setenv("FAKE_NEURONX_CC_DIR", str(markers))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 compiles at a time
    return lambda: [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("instance_type, source, lnc", [("inf2.8xlarge", ".hlo.pb", None), ("trn2", ".mlir", "2")])
def test_neffs_are_compiled_per_target_in_parallel(tiny_checkpoint, fake_neuronx_cc, instance_type, source, lnc):
    # its own export: the NEFF compile runs inside the export, for this instance type (static batches: 3 graphs)
    static = dict(NEURON_EXPORT, **STATIC_BATCHES)
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, instance_type=instance_type,
                                                   compile_cache=False, **static)
    calls = fake_neuronx_cc()
    assert len(calls) == 3
    target = {"inf2.8xlarge": "inf2", "trn2": "trn2"}[instance_type]
    for argv in calls:
        assert argv[0] == "compile" and argv[1].endswith(source)
        assert argv[argv.index("--framework") + 1] == "XLA" and argv[argv.index("--target") + 1] == target
        assert argv[argv.index("--model-type") + 1] == "transformer" and "-O2" in argv
        assert argv[argv.index("--auto-cast") + 1] == "none"  # fp32 stays fp32
        assert (argv[argv.index("--lnc") + 1] if "--lnc" in argv else None) == lnc
    manifest = json.loads((model.artifact_dir / neuron.MANIFEST_NAME).read_text())
    # a family name (optimum-neuron's `trn2`) stands for its largest size
    expected = {"inf2.8xlarge": "inf2.8xlarge", "trn2": "trn2.48xlarge"}[instance_type]
    assert manifest["neff"]["instance_type"] == expected and manifest["neff"]["target"] == target
    for name, entry in manifest["graphs"].items():
        assert entry["files"]["neff"] == f"{name}.neff"
        assert (model.artifact_dir / f"{name}.neff").read_bytes() == f"NEFF{name}{source}".encode()


def test_neuronx_cc_argv_follows_auto_cast_type_and_compiler_args():
    from pathlib import Path

    from optimum_neuronx.instances import instance_type

    argv = neuronx_cc.argv(Path("g.hlo.pb"), Path("g.neff"), instance_type("trn1"), "bf16", ("-O3",))
    assert argv[:4] == ["neuronx-cc", "compile", "g.hlo.pb", "--framework"]
    assert "-O2" not in argv and argv[-1] == "-O3"
    assert argv[argv.index("--auto-cast") + 1] == "matmult" and argv[argv.index("--auto-cast-type") + 1] == "bf16"


@pytest.mark.slow
def test_a_neff_compile_failure_names_the_graph_and_keeps_the_log(tiny_checkpoint, fake_neuronx_cc, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", "1")  # fails inside an export of its own
    with pytest.raises(RuntimeError, match=r"neuronx-cc failed to compile graph \w+ for trn1.32xlarge \(exit code "
                                           r"70\); its log: (\S+\.log)") as info:
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, instance_type="trn1.32xlarge",
                                               compile_cache=False, **dict(NEURON_EXPORT, **STATIC_BATCHES))
    log = info.value.args[0].rsplit("its log: ", 1)[1]
    assert "the fake compiler was told to fail" in open(log).read()


# -- bad input ------------------------------------------------------------------------------------------------------

def test_a_tp_degree_that_does_not_divide_the_heads_is_refused_before_loading_weights(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    with pytest.raises(ValueError, match=r"tp_degree \(num_cores\) 8 does not divide the attention heads "
                                         r"\(num_attention_heads\) \(4\); use a tp_degree that does: 1, 2, 4"):
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, num_cores=8, **NEURON_EXPORT)


def test_tp_degrees_and_instance_types_are_checked():
    with pytest.raises(ValueError, match=r"tp_degree \(num_cores\) 4 is not supported on trn1.32xlarge \(32 "
                                         r"NeuronCores\); use one of \(1, 2, 8, 32\)"):
        NeuronConfig(tp_degree=4, instance_type="trn1.32xlarge", backend="neuron")
    with pytest.raises(ValueError, match=r"Unknown instance_type 'inf3'; known: inf2.xlarge, .*trn2.48xlarge"):
        NeuronConfig(instance_type="inf3", backend="neuron")


def test_a_footprint_that_does_not_fit_names_needed_and_available_memory():
    from transformers import AutoConfig

    from optimum_neuronx.memory import check_fits_neuron_cores, estimate_memory_from_config

    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    estimate = estimate_memory_from_config(config, NeuronConfig(
        batch_size=16, sequence_length=4096, auto_cast_type="bf16", tp_degree=2, instance_type="inf2.24xlarge"))
    with pytest.raises(ValueError, match=r"tp_degree \(num_cores\) = 2 needs 22.3 GiB per NeuronCore, more than the "
                                         r"16 GiB of one on inf2.24xlarge .* use num_cores=4"):
        check_fits_neuron_cores(estimate)


def test_executables_of_another_platform_version_are_rebuilt_from_the_stablehlo(neuron_model, tmp_path, monkeypatch,
                                                                               caplog):
    import logging

    neuron_model(1).save_pretrained(tmp_path / "saved")
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected = neuron_model(1).generate(prompt, max_new_tokens=8, do_sample=False)
    monkeypatch.setattr(neuron, "platform_version", lambda client: "cpu 9.99")
    monkeypatch.setattr(neuron.PjrtGraph, "deserialize", _refuse)  # the stale executables are never loaded
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        model = NeuronModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert re.search(r"holds PJRT executables compiled for 'cpu .*', but this machine runs 'cpu 9.99': compiling its "
                     r"StableHLO graphs", caplog.text)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), expected)


def _refuse(*args, **kwargs):
    raise AssertionError("a serialized executable of another platform version was loaded")


class _FakeNeuronClient:
    """What a Neuron PJRT plugin's client reports (contract only: the plugin itself never runs here)."""

    platform, platform_version = "neuron", "2.33.0"

    def __init__(self, device_kind="NC_v2"):
        import types

        self._devices = [types.SimpleNamespace(id=0, device_kind=device_kind)]

    def devices(self):
        return self._devices


def test_the_neuron_plugin_is_preferred_where_it_is_installed(monkeypatch, caplog):
    import importlib.util
    import logging

    import jax.extend.backend

    fake = _FakeNeuronClient()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "libneuronxla" else real_find_spec(name, *a))
    monkeypatch.setattr(jax.extend.backend, "get_backend",
                        lambda platform=None: fake if platform == "neuron" else None)
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        assert pjrt.default_client() is fake
    assert "XLA CPU device" not in caplog.text


def test_an_export_for_another_device_generation_is_refused():
    from pathlib import Path

    manifest = {"instance_type": "inf2.48xlarge", "neff": None,
                "executables": {"platform": "cpu", "platform_version": "cpu 0.10.2"}}
    assert not neuron.executables_match(manifest, _FakeNeuronClient("NC_v2"), Path("export"))
    with pytest.raises(ValueError, match=r"compiled for inf2.48xlarge \(NeuronCore-v2\), but this machine's Neuron "
                                         r"devices are 'NC_v3'.*instance_type='trn2'"):
        neuron.executables_match(manifest, _FakeNeuronClient("NC_v3"), Path("export"))


def test_a_corrupted_graph_file_is_refused(neuron_model, tmp_path):
    directory = tmp_path / "saved"
    neuron_model(1).save_pretrained(directory)
    executable = directory / "token_32.pjrt"
    data = bytearray(executable.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    executable.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"token_32.pjrt does not match its sha256"):
        NeuronModelForCausalLM.from_pretrained(directory)


def test_more_devices_than_the_client_has_is_a_clear_error():
    with pytest.raises(ValueError, match=r"partitioned across 64 devices \(tp_degree\) but the cpu PJRT client has "
                                         r"\d+\. .*xla_force_host_platform_device_count=64"):
        pjrt.devices_for(pjrt.cpu_client(), 64)


# -- optimum-cli neuron estimate ------------------------------------------------------------------------------------

def test_estimate_of_neurons_66b_example_needs_24_inf2_cores(tmp_path):
    # AWS Neuron's LLM inference guide: a 66B model in bf16 at batch 16 and 2048 tokens needs 24 NeuronCores on Inf2
    from transformers import AutoConfig

    from optimum_neuronx.commands.estimate import main

    AutoConfig.for_model("opt", hidden_size=9216, num_hidden_layers=64, num_attention_heads=72, ffn_dim=36864,
                         vocab_size=50272, max_position_embeddings=2048,
                         word_embed_proj_dim=9216).save_pretrained(tmp_path / "opt-66b")
    result = subprocess.run([sys.executable, "-m", "optimum_neuronx.commands.estimate", "--model",
                             str(tmp_path / "opt-66b"), "--batch_size", "16", "--sequence_length", "2048",
                             "--auto_cast_type", "bf16", "--instance_type", "inf2.48xlarge"],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "weights:     122.41 GiB" in result.stdout and "KV cache:     72.00 GiB" in result.stdout
    assert "smallest fitting tp_degree: 24" in result.stdout
    assert main(["--model", str(tmp_path / "opt-66b"), "--instance_type", "inf9"]) == 1


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_sharded_layout_computes_what_the_plain_decoder_does(model_type):
    # eager, no compiler, every family: the shard-major weights with KV heads repeated give the plain decoder's
    # logits, for a prompt and a decode step (MoE with 8 experts: the step gathers its rows' experts' slices)
    from transformers import AutoConfig

    from conftest import TINY_COMMON, TINY_CONFIGS
    from optimum_neuronx.backends.neuron.stablehlo import NeuronKernels
    from optimum_neuronx.exporters import get_export_config
    from optimum_neuronx.modeling.decoder import StaticDecoder
    from optimum_neuronx.modeling.sharding import ShardLayout

    heads = 4 if model_type == "phi3" else 8  # phi3's LongRoPE factors are sized for its head_dim of 16
    config = AutoConfig.for_model(model_type, **{**TINY_COMMON, **TINY_CONFIGS.get(model_type, {}),
                                                 "num_attention_heads": heads, "num_key_value_heads": 2})
    spec = get_export_config(model_type).decoder_spec(config, NeuronConfig(sequence_length=16, context_buckets=[8]))
    torch.manual_seed(0)
    plain = StaticDecoder(spec, NeuronKernels()).eval()
    for name, parameter in plain.named_parameters():
        parameter.normal_(1.0 if "norm" in name else 0.0, 0.2)
    inputs = plain.example_inputs(2, 8, 8, torch.zeros(spec.kv_cache_shape(2, 16)))
    inputs = (torch.randint(0, 256, (2, 8)), torch.arange(8).expand(2, 8), *inputs[2:5])
    step = (torch.randint(0, 256, (2, 1)), torch.full((2, 1), 8), torch.tensor([8]), torch.ones(2, 16, dtype=torch.bool),
            torch.zeros(2, dtype=torch.long))
    with torch.no_grad():
        cache = torch.zeros(spec.kv_cache_shape(2, 16))
        expected = plain(*inputs, cache), plain(*step, cache)
        for shards in (s for s in (2, 4, 8) if heads % s == 0):
            layout = ShardLayout.for_spec(spec, shards)
            sharded = neuron._sharded_decoder(plain, layout)
            assert sharded.spec.num_kv_heads == max(spec.num_kv_heads, shards)
            cache = torch.zeros(sharded.spec.kv_cache_shape(2, 16))
            got = sharded(*inputs, cache), sharded(*step, cache)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
