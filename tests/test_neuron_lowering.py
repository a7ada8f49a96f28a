"""The neuron backend's lowering (StableHLO through torch-mlir) and execution (PJRT, the XLA CPU device here),
checked against the same decoder run eagerly (itself checked against Transformers in test_parity.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_COMMON, TINY_CONFIGS
from optimum_neuronx import NeuronConfig
from optimum_neuronx.exporters import get_export_config
from optimum_neuronx.modeling.decoder import StaticDecoder

pytest.importorskip("torch_mlir", reason="the [neuron] extra (torch-mlir) is not installed")
pytest.importorskip("jax", reason="the [neuron] extra (jax, jaxlib) is not installed")

from optimum_neuronx.backends.neuron.pjrt import PjrtGraph, to_torch  # noqa: E402
from optimum_neuronx.backends.neuron.stablehlo import NeuronKernels, lower_graph  # noqa: E402

pytestmark = pytest.mark.pjrt  # every test here may start the PJRT client

SEQUENCE, PROMPT, BATCH = 16, 8, 2


def _decoder(dtype=torch.float32) -> StaticDecoder:
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", **{**TINY_COMMON, **TINY_CONFIGS["llama"]})
    spec = get_export_config("llama").decoder_spec(config, NeuronConfig(
        sequence_length=SEQUENCE, context_buckets=[PROMPT], token_buckets=[SEQUENCE]))
    torch.manual_seed(0)
    decoder = StaticDecoder(spec, NeuronKernels()).eval()
    for name, parameter in decoder.named_parameters():
        parameter.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return decoder.to(dtype)


def _cache(decoder, dtype=torch.float32):
    return torch.zeros(decoder.spec.kv_cache_shape(BATCH, SEQUENCE), dtype=dtype)


def _graphs(decoder, dtype=torch.float32):
    cache = _cache(decoder, dtype)
    return {(tokens, window): lower_graph(decoder, decoder.example_inputs(BATCH, tokens, window, cache),
                                          f"{'context' if tokens > 1 else 'token'}_{window}")
            for tokens, window in ((PROMPT, PROMPT), (1, SEQUENCE))}


@pytest.fixture(scope="module")
def lowered():
    decoder = _decoder()
    graphs = _graphs(decoder)
    return decoder, graphs, {key: PjrtGraph.compile(graph) for key, graph in graphs.items()}


def _steps():
    """A left-padded prompt (row 1: 3 pads) and 3 decode steps: (ids, positions, cache_start, key_valid, last)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (BATCH, PROMPT + 3), generator=generator)
    valid = torch.ones(BATCH, SEQUENCE, dtype=torch.bool)
    valid[1, :3] = False
    positions = (valid[:, :PROMPT + 3].long().cumsum(-1) - 1).clamp(min=0)
    yield (ids[:, :PROMPT], positions[:, :PROMPT], torch.zeros(BATCH, dtype=torch.long), valid[:, :PROMPT],
           torch.full((BATCH,), PROMPT - 1))
    for t in range(PROMPT, PROMPT + 3):
        yield (ids[:, t:t + 1], positions[:, t:t + 1], torch.full((BATCH,), t), valid,
               torch.zeros(BATCH, dtype=torch.long))


def _run(decoder, graphs, executables, dtype=torch.float32):
    """Logits of every step, eager and through PJRT with the cache kept on the device; both final caches."""
    eager_cache, device_cache, state = _cache(decoder, dtype), None, decoder.state_dict()
    eager, compiled = [], []
    for inputs in _steps():
        key = (inputs[0].shape[1], inputs[3].shape[1])
        graph, executable = graphs[key], executables[key]
        with torch.no_grad():
            eager.append(decoder(*inputs, eager_cache))
        given = dict(zip(("input_ids", "position_ids", "cache_start", "key_valid", "last_index"), inputs))
        given["seq_ids"] = torch.arange(BATCH)
        given["kv_cache"] = device_cache if device_cache is not None else executable.placement.put(_cache(decoder, dtype))
        args = [state[a.name] if a.kind == "weight" else given[a.name] for a in graph.arguments]
        outputs = executable(args)
        assert given["kv_cache"].is_deleted()  # donated: the graph wrote the cache in place on the device
        device_cache = outputs[graph.outputs.index("kv_cache")]
        compiled.append(to_torch(outputs[graph.outputs.index("logits")]))
    return eager, compiled, eager_cache, to_torch(device_cache)


def test_graphs_keep_the_weights_as_arguments_and_donate_the_cache(lowered):
    decoder, graphs, _ = lowered
    names = list(decoder.state_dict())
    for graph in graphs.values():
        weights = [a.name for a in graph.arguments if a.kind == "weight"]
        assert sorted(weights) == sorted(names)  # every weight an argument: model.safetensors feeds them all
        assert [a.name for a in graph.arguments if a.kind == "input"] == [
            "input_ids", "position_ids", "cache_start", "key_valid", "last_index", "kv_cache", "seq_ids"]
        cache = graph.argument_index("kv_cache")
        assert graph.aliases == {cache: 0} and graph.outputs == ("kv_cache", "logits")
        assert f"%arg{cache}: tensor<" in graph.text and "tf.aliasing_output = 0 : i32" in graph.text
        assert "arith.constant" not in graph.text and "stablehlo." in graph.text
        # no weight baked in: the module text is far smaller than the weights it takes
        assert len(graph.text) < sum(t.numel() * t.element_size() for t in decoder.state_dict().values()) / 4


def test_prefill_and_decode_on_the_device_match_eager(lowered):
    decoder, graphs, executables = lowered
    eager, compiled, eager_cache, device_cache = _run(decoder, graphs, executables)
    for step, (expected, got) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(device_cache, eager_cache, rtol=1e-5, atol=1e-5)
    assert eager_cache[:, :, :, :, PROMPT:PROMPT + 3].abs().sum() > 0


def test_serialized_executables_reload_without_compiling(lowered):
    decoder, graphs, executables = lowered
    reloaded = {key: PjrtGraph.deserialize(graphs[key], executable.serialize())
                for key, executable in executables.items()}
    first, again = _run(decoder, graphs, executables)[1], _run(decoder, graphs, reloaded)[1]
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_bf16_graphs_match_eager_bf16():
    decoder = _decoder(torch.bfloat16)
    graphs = _graphs(decoder, torch.bfloat16)
    executables = {key: PjrtGraph.compile(graph) for key, graph in graphs.items()}
    eager, compiled, eager_cache, device_cache = _run(decoder, graphs, executables, torch.bfloat16)
    assert device_cache.dtype == torch.bfloat16
    for expected, got in zip(eager, compiled):
        # the two compilers round bf16 intermediates differently: within a few bf16 ulps of the logits' scale
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.03 * scale)
        gap = expected.float().topk(2).values
        clear = (gap[:, 0] - gap[:, 1]) > 0.05 * scale  # greedy tokens agree wherever the top two are not a near-tie
        assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_a_started_pjrt_client_stops_forked_compiles(lowered):
    # jaxlib's threads do not survive fork: once a PJRT client runs, graphs compile in this process
    from optimum_neuronx.backends.workers import compile_workers, pjrt_started

    assert pjrt_started() and compile_workers(4) == 1


def test_an_op_the_lowering_cannot_express_is_named_with_the_graph():
    class Iterates(torch.nn.Module):
        def forward(self, x):
            return sum(row for row in x)  # iterating a tensor traces to squeeze, which torch-mlir does not lower

    with pytest.raises(ValueError, match=r"graph odd_graph: the StableHLO lowering \(torch-mlir\) cannot express "
                                         r"torch\.aten\.squeeze"):
        lower_graph(Iterates(), (torch.randn(3, 4),), "odd_graph")
