"""Our hand-written kernel inside AOTInductor graphs: bfloat16 decode projections (rows_matvec_bf16)."""

import subprocess
import sys
import zipfile

import pytest
import torch

from optimum_neuronx.backends import get_backend
from optimum_neuronx.modeling.decoder import Lowering
from optimum_neuronx.modeling.ops import rows_matvec_bf16

BACKEND = get_backend("inductor")
needs_kernel = pytest.mark.skipif(not BACKEND.has_bf16_dot_kernel(),
                                  reason="rows_matvec_bf16's kernel needs avx512_bf16 and GCC or Clang")

# (rows, in, out): one full 32-element line plus a tail, lines only, a tail only (K < 32), more rows than the
# kernel's 4 accumulators (4 + 1), and an odd output count split between threads.
SHAPES = [(1, 48, 80), (4, 64, 70), (3, 20, 33), (5, 100, 33), (2, 576, 131)]


class _Projections(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(out, k, generator=generator).bfloat16(), requires_grad=False)
            for _, k, out in SHAPES)

    def forward(self, xs, transposed):
        outs = [rows_matvec_bf16(x, w) for x, w in zip(xs, self.weights)]
        # x as a strided view (a row of x is a column of `transposed`): the kernel must follow strides
        return (*outs, rows_matvec_bf16(transposed.t(), self.weights[0]))


def _inputs():
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, k, generator=generator).bfloat16() for rows, k, _ in SHAPES]
    return xs, torch.randn(SHAPES[0][1], 3, generator=generator).bfloat16()


@pytest.fixture(scope="module")
def kernel_package(tmp_path_factory):
    from torch._inductor.package import package_aoti

    from optimum_neuronx.backends.inductor_kernels import c_shim_options

    module, args = _Projections().eval(), _inputs()
    program = torch.export.export(module, args, strict=False)
    files = torch._inductor.aot_compile(program.module(), args, options={
        "aot_inductor.package": True, **c_shim_options(dot_rows=4)})
    return package_aoti(str(tmp_path_factory.mktemp("kernel") / "kernel.pt2"), files), module, args


def _expected(module, args):
    # float32 sums of the same bfloat16 numbers, rounded once: the kernel may differ only in summation order
    xs, transposed = args
    pairs = [*zip(xs, module.weights), (transposed.t(), module.weights[0])]
    return [torch.nn.functional.linear(x.float(), w.float()).bfloat16() for x, w in pairs]


@needs_kernel
def test_kernel_matches_float32_sums_rounded_once(kernel_package):
    from torch._inductor.package import load_package

    path, module, args = kernel_package
    outs = load_package(path)(*args)
    for out, expected, eager in zip(outs, _expected(module, args), module(*args)):
        assert out.dtype == torch.bfloat16 and out.shape == expected.shape
        # one bfloat16 rounding step apart at most (a float32 sum in another order can round the other way)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(out.float(), eager.float(), rtol=2 ** -7, atol=1e-3)


@needs_kernel
def test_graph_carries_the_kernel_and_runs_without_our_package(kernel_package, tmp_path):
    # The wrapper calls the kernel as a C function compiled into it, not through the dispatcher: a process that
    # never imported optimum_neuronx (so the op is not registered) runs the graph.
    path, module, args = kernel_package
    with zipfile.ZipFile(path) as package:
        wrapper = next(package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_rows_matvec_bf16(") == len(SHAPES) + 2  # definition + one call per use
    assert "proxy_executor_call_function" not in wrapper and "call_dispatcher" not in wrapper
    xs, transposed = args
    torch.save([*xs, transposed], tmp_path / "inputs.pt")
    script = (
        "import sys, torch\n"
        "loader = torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], 'model', False, 1, -1)\n"
        "torch.save(loader.boxed_run(torch.load(sys.argv[2])), sys.argv[3])\n"
        "assert not any(name.startswith('optimum_neuronx') for name in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, path, str(tmp_path / "inputs.pt"),
                             str(tmp_path / "outputs.pt")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for out, expected in zip(torch.load(tmp_path / "outputs.pt"), _expected(module, args)):
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)


def test_fake_kernel_names_bad_operands():
    with torch._subclasses.FakeTensorMode():
        x, weight = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(5, 9, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"x \[R, K\] and weight \[N, K\]; got \(2, 8\) and \(5, 9\)"):
            rows_matvec_bf16(x, weight)
        with pytest.raises(ValueError, match=r"bfloat16 tensors; got torch.float32"):
            rows_matvec_bf16(x.float(), weight[:, :8])


def test_bf16_decode_lowering_uses_the_kernel_up_to_four_rows(monkeypatch):
    fp32 = BACKEND.lowering(torch.float32, batch_size=4)
    assert fp32.dot_rows == 0 and fp32.packed_rows == 4 and not fp32.uses_dot_kernel(1, 64, torch.bfloat16)
    if BACKEND.has_bf16_dot_kernel():
        for batch in (1, 4):
            lowering = BACKEND.lowering(torch.bfloat16, batch_size=batch)
            assert lowering.dot_rows == 4 and lowering.for_layers().dot_rows == 4
            assert lowering.uses_dot_kernel(batch, 1536, torch.bfloat16)  # 4 rows of 1536: 12 KiB
            assert not lowering.uses_dot_kernel(batch, 1536, torch.float32)
            assert "avx512_bf16" in BACKEND.target(lowering).split()
        assert not lowering.uses_dot_kernel(4, 2048, torch.bfloat16)  # 16 KiB of input rows: oneDNN's
        assert lowering.uses_dot_kernel(1, 5632, torch.bfloat16)  # 11 KiB
        wide = BACKEND.lowering(torch.bfloat16, batch_size=8)
        assert wide.packed_rows == 8 and not wide.uses_dot_kernel(8, 64, torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert BACKEND.lowering(torch.bfloat16, batch_size=1).dot_rows == 0


@pytest.mark.parametrize("hidden, intermediate, packed", [
    (576, 1536, []),  # SmolLM2: every projection's 4 input rows fit (12 KiB at most)
    (576, 3072, ["down_proj"]),  # a wider MLP: the down projection's 24 KiB do not
])
def test_weights_the_kernel_reads_are_never_packed(hidden, intermediate, packed):
    # At batch 4 a bf16 export packs for oneDNN only the weights the kernel does not read: the kernel needs them
    # plain. (Built on the meta device: no memory.)
    from optimum_neuronx.modeling.decoder import DecoderSpec, StaticDecoder

    spec = DecoderSpec(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_layers=2,
                       num_heads=hidden // 64, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, hidden_act="silu",
                       qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, tie_word_embeddings=False,
                       rope_inv_freq=(1.0,) * 32, rope_attention_scaling=1.0)
    lowering = Lowering(dot_rows=4, dot_input_bytes=12288, onednn=True, packed_rows=4, matvec_rows=4)
    with torch.device("meta"):
        float32 = StaticDecoder(spec, lowering)
    assert float32.packable_weight_names() == [  # float32: all of them
        f"layers.{i}.{name}.weight" for i in range(2) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    ] + ["lm_head.weight"]
    expected = [f"layers.{i}.{name}.weight" for i in range(2) for name in packed]
    assert float32.to(torch.bfloat16).packable_weight_names() == expected


def test_export_needing_the_kernel_refused_on_a_cpu_without_avx512_bf16(monkeypatch):
    target = BACKEND.target(Lowering(dot_rows=4))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    reason = BACKEND.missing_target_support(target)
    assert "lacks avx512_bf16" in reason, reason

