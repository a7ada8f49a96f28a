"""An export's compiler options never run code: a foreign export's are not applied to its rebuild, and the options
anyone passes go through an allow-list (numbers, booleans, known enums) on both backends, NEURON_CC_FLAGS too."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import left_padded_prompts
from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.backends import get_backend
from optimum_neuronx.backends.inductor.backend import parse_compiler_args
from optimum_neuronx.backends.neuron import neuronx_cc
from optimum_neuronx.configuration import NeuronConfig
from optimum_neuronx.instances import INSTANCE_TYPES
from optimum_neuronx.exporters.plan import plan_export
from test_trust import foreign_copy, restamp  # noqa: F401 (fixture)


def test_a_foreign_exports_compiler_command_never_runs(foreign_copy, compiled_model, tmp_path, caplog):
    """The reported attack: `cpp.cxx=sh -c '...'` in a foreign export's neuron_config.json, every digest re-stamped.
    The rebuild runs without the export's options (a warning names them); the marker is never written."""
    marker = tmp_path / "marker"
    meta_path = foreign_copy / "neuron_config.json"
    meta = json.loads(meta_path.read_text())
    meta["neuron_config"]["compiler_args"] = [f"cpp.cxx=[\"sh\", \"-c\", \"touch {marker}; g++ $@\"]",
                                              f"cpp.cxx=sh -c 'touch {marker}'"]
    meta_path.write_text(json.dumps(meta))
    restamp(foreign_copy)
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        model = NeuronModelForCausalLM.from_pretrained(foreign_copy)
    assert not marker.exists()
    assert "compiler_args" in caplog.text and "cpp.cxx" in caplog.text and "trust_remote_code=True" in caplog.text
    assert model.neuron_config.compiler_args == ()
    input_ids, attention_mask = left_padded_prompts([9, 5], seed=2)
    options = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(input_ids, **options), compiled_model("llama").generate(input_ids, **options))


@pytest.mark.parametrize("arg, named", [
    ("cpp.cxx=sh -c 'touch /tmp/x'", "'cpp.cxx' holds a"),
    ('cpp.cxx=["sh", "-c", "id"]', "'cpp.cxx' holds a"),
    ("cpp.ld=evil", "'cpp.ld'"),  # not an option at all
    ("post_grad_custom_post_pass=1", "'post_grad_custom_post_pass' holds a"),
    ("cpp.simdlen=1024", "'cpp.simdlen' takes one of"),
    ("aot_inductor.compile_wrapper_opt_level=O0 -fplugin=/tmp/evil.so", "'aot_inductor.compile_wrapper_opt_level' "
                                                                         "takes one of"),
    ("max_autotune=yes", "'max_autotune' takes a bool"),
    ("cpp.threads=true", "'cpp.threads' takes a int"),
    ("trace.enabled=true", "'trace.enabled' is one that does"),
    ("aot_inductor.debug_compile=true", "'aot_inductor.debug_compile' is one that does"),
])
def test_inductor_options_outside_the_allow_list_are_refused(arg, named):
    with pytest.raises(ValueError, match=r"compiler arg .* is refused|is not a torch._inductor.config option") as err:
        parse_compiler_args([arg])
    assert named in str(err.value)


def test_inductor_options_in_the_allow_list_are_taken():
    assert parse_compiler_args(["max_autotune=false", "cpp.threads=2", "cpp.simdlen=256", "cpp.min_chunk_size=512"]) \
        == {"max_autotune": False, "cpp.threads": 2, "cpp.simdlen": 256, "cpp.min_chunk_size": 512}


def test_an_export_with_a_refused_option_fails_before_anything_is_written(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"'cpp.cxx' holds a"):
        NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, batch_size=1, sequence_length=32,
                                               compiler_args=["cpp.cxx=/bin/sh"], compile_cache_dir=tmp_path)
    assert not (tmp_path / "entries").exists()


@pytest.mark.parametrize("flags, named", [
    (["--logfile=/tmp/log"], "'--logfile=/tmp/log'"),
    (["--pipeline", "compile"], "'--pipeline'"),
    (["--tensorizer-options=--foo"], "'--tensorizer-options=--foo'"),
    (["--auto-cast", "/bin/sh"], "--auto-cast '/bin/sh'"),
    (["--lnc"], "needs a value"),
])
def test_neuronx_cc_flags_outside_the_allow_list_are_refused(flags, named):
    with pytest.raises(ValueError, match="neuronx-cc flag") as err:
        neuronx_cc.check_flags(flags)
    assert named in str(err.value)
    with pytest.raises(ValueError, match="neuronx-cc flag"):  # argv never builds a command line with them
        neuronx_cc.argv(tmp := __import__("pathlib").Path("g.hlo.pb"), tmp.with_suffix(".neff"),
                        INSTANCE_TYPES["inf2"], "bf16", flags)


def test_neuron_cc_flags_reach_neuronx_cc_through_the_allow_list(tiny_checkpoint, monkeypatch):
    """optimum-neuron's NEURON_CC_FLAGS: recorded in the export's compiler_args (so in its cache key) and on the
    neuronx-cc command line; a refused flag is an error naming the variable and the flag."""
    monkeypatch.setenv("NEURON_CC_FLAGS", "--auto-cast matmult --enable-fast-loading-neuron-binaries")
    config = NeuronConfig(batch_size=1, sequence_length=32, context_buckets=(16,), backend="neuron")
    prepared = plan_export(str(tiny_checkpoint("llama")), config, check_host_memory=False)
    flags = ("--auto-cast", "matmult", "--enable-fast-loading-neuron-binaries")
    assert prepared.neuron_config.compiler_args == flags
    assert prepared.cache_key().fields["neuron_config"]["compiler_args"] == list(flags)
    command = neuronx_cc.argv(__import__("pathlib").Path("g.hlo.pb"), __import__("pathlib").Path("g.neff"),
                              INSTANCE_TYPES["inf2"], "bf16", prepared.neuron_config.compiler_args)
    assert command[-3:] == list(flags)
    again = plan_export(str(tiny_checkpoint("llama")), prepared.neuron_config, check_host_memory=False)
    assert again.neuron_config.compiler_args == flags  # not added twice on a rebuild
    monkeypatch.setenv("NEURON_CC_FLAGS", "--logfile /tmp/x")
    with pytest.raises(ValueError, match=r"\$NEURON_CC_FLAGS: neuronx-cc flag '--logfile' is refused"):
        plan_export(str(tiny_checkpoint("llama")), config, check_host_memory=False)
    assert get_backend("inductor").environment_compiler_args() == ()  # the variable is neuronx-cc's alone


CALLBACK_MODULE = """module @m {
  func.func public @main(%arg0: tensor<2xf32>) -> (tensor<2xf32>) {
    %0 = stablehlo.custom_call @xla_python_cpu_callback(%arg0) {api_version = 2 : i32} : (tensor<2xf32>) -> tensor<2xf32>
    return %0 : tensor<2xf32>
  }
}"""
GENERIC_MODULE = CALLBACK_MODULE.replace(
    "stablehlo.custom_call @xla_python_cpu_callback(%arg0) {api_version = 2 : i32}",
    '"stablehlo.custom_call"(%arg0) {call_target_name = "lapack_sgesdd_ffi"}')
ENTRY = {"name": "token_32", "shards": 1, "outputs": ["logits"], "aliases": {},
         "arguments": [{"name": "x", "kind": "input", "shape": [2], "dtype": "float32", "sharded_axis": None}]}


@pytest.mark.parametrize("text, target", [(CALLBACK_MODULE, "xla_python_cpu_callback"),
                                          (GENERIC_MODULE, "lapack_sgesdd_ffi")])
def test_stablehlo_custom_calls_from_an_artifact_are_refused(text, target):
    """A module from an export's .mlir calling a target jaxlib registers (a Python callback, a LAPACK kernel with
    the module's layouts) is refused before anything compiles it, naming the target."""
    from optimum_neuronx.backends.neuron.stablehlo import StableHLOGraph

    with pytest.raises(ValueError, match=rf"graph token_32: its StableHLO makes custom calls to {target}, which the "
                                         rf"lowering never emits"):
        StableHLOGraph.from_dict(ENTRY, text)
    assert StableHLOGraph.from_dict(ENTRY, CALLBACK_MODULE.replace(
        "stablehlo.custom_call @xla_python_cpu_callback(%arg0) {api_version = 2 : i32}", "stablehlo.abs %arg0")).name


def test_the_lowering_itself_emits_no_custom_call():
    """What the allow-list is measured against: the sampling head (top-k, sort, cumulative sums) and a decoder graph
    lower to plain StableHLO ops."""
    from optimum_neuronx.backends.neuron.stablehlo import lower_graph
    from optimum_neuronx.modeling.sampling import sample_tokens

    class Head(torch.nn.Module):
        def forward(self, logits, sampling):
            return sample_tokens(logits, sampling)

    graph = lower_graph(Head(), (torch.randn(2, 300), torch.rand(2, 4)), "head")
    assert "custom_call" not in graph.text
