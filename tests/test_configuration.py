import dataclasses

import pytest
import torch

from optimum_neuronx import NeuronConfig


def test_defaults_and_round_trip(tmp_path):
    config = NeuronConfig(batch_size=2, sequence_length=512, auto_cast_type="bfloat16", compiler_args=["a=1"])
    assert config.context_buckets == (128, 256, 512) and config.token_buckets == (128, 256, 512)
    assert config.auto_cast_type == "bf16" and config.torch_dtype == torch.bfloat16
    assert NeuronConfig.from_dict(config.to_dict()) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 4


def test_buckets_are_sorted_and_deduplicated():
    config = NeuronConfig(sequence_length=64, context_buckets=[32, 16, 32], token_buckets=[64, 32])
    assert config.context_buckets == (16, 32) and config.token_buckets == (32, 64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), r"batch_size must be a positive integer, got 0"),
    (dict(sequence_length="long"), r"sequence_length must be a positive integer, got 'long'"),
    (dict(auto_cast_type="int3"), r"Unknown auto_cast_type 'int3'"),
    (dict(sequence_length=64, context_buckets=[128]), r"context_buckets \[128\] must lie between 1 and sequence_length \(64\)"),
    (dict(sequence_length=64, token_buckets=[]), r"token_buckets must not be empty"),
    (dict(sequence_length=64, token_buckets=[32]), r"largest token-generation bucket \(32\) must equal sequence_length \(64\)"),
    (dict(tp_degree=3), r"tp_degree \(num_cores\) 3 is not supported; use one of"),
    (dict(backend="tpu"), r"Unknown backend 'tpu'; supported backends: inductor"),
    (dict(compiler_args="-O3"), r"compiler_args must be a list of strings"),
    (dict(context_buckets=["x"]), r"context_buckets must be a list of positive integers"),
])
def test_invalid_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NeuronConfig(**kwargs)


def test_unknown_field_in_file_is_refused():
    with pytest.raises(ValueError, match=r"Unknown NeuronConfig fields \['batch'\]"):
        NeuronConfig.from_dict({"batch": 1})


def test_compiler_args_are_checked_against_inductor_options():
    from optimum_neuronx.backends.inductor.backend import parse_compiler_args

    assert parse_compiler_args(["max_autotune=false", "aot_inductor.compile_wrapper_opt_level=O0"]) == {
        "max_autotune": False, "aot_inductor.compile_wrapper_opt_level": "O0"}
    with pytest.raises(ValueError, match=r"'no_such_option' is not a torch._inductor.config option"):
        parse_compiler_args(["no_such_option=1"])
    with pytest.raises(ValueError, match=r"must look like name=value"):
        parse_compiler_args(["-O3"])


def test_graphs_compile_with_our_inductor_options_unless_compiler_args_override(monkeypatch, tmp_path):
    import types

    from optimum_neuronx.backends.inductor import backend as inductor
    from optimum_neuronx.backends.inductor.codegen import MIN_ELEMENTS_PER_THREAD

    seen = []
    monkeypatch.setattr(inductor, "compile_workers", lambda graphs: 1)
    monkeypatch.setattr(inductor, "_compile_graph", lambda decoder, inputs, options, build_dir, graph: (
        seen.append(options) or ([], 0.0)))
    monkeypatch.setattr("torch._inductor.package.package_aoti", lambda *args, **kwargs: None)
    decoder = types.SimpleNamespace(kernels=types.SimpleNamespace(dot_rows=0, dot_isa="avx2", attention_kernel=False,
                                                                   int8_kernel=False))
    graphs = [types.SimpleNamespace(name="token_32")]
    backend = inductor.InductorBackend()
    backend.compile(decoder, graphs, None, tmp_path, NeuronConfig())
    backend.compile(decoder, graphs, None, tmp_path, NeuronConfig(compiler_args=["cpp.min_chunk_size=64"]))
    assert [options["cpp.min_chunk_size"] for options in seen] == [MIN_ELEMENTS_PER_THREAD, 64]
    # stamped into exports: another value recompiles
    assert backend.codegen_options()["min_elements_per_thread"] == MIN_ELEMENTS_PER_THREAD
