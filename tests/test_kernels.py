"""Our hand-written kernel inside AOTInductor graphs: bfloat16 and float32 decode projections (rows_matvec)."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch

import kernel_packages

from optimum_neuronx.backends import get_backend
from optimum_neuronx.backends.inductor.backend import X86_FEATURE_PROBES, cpu_has
from optimum_neuronx.backends.inductor.lowering import Lowering
from optimum_neuronx.backends.inductor.ops import rows_matvec

BACKEND = get_backend("inductor")
DTYPES = [torch.bfloat16, torch.float32]
# What exports with each variant of the kernel need of the CPU that runs them (bfloat16 on AVX-512: through
# avx512_bf16's dot products, or widened to float32 without them; a CPU with avx512_bf16 runs both here)
DOT_ISA = {"avx512_bf16": {torch.bfloat16: ["avx512", "avx512_bf16"]},
           "avx512": {torch.bfloat16: ["avx512"], torch.float32: ["avx512"]},
           "avx2": {torch.bfloat16: ["avx2"], torch.float32: ["avx2"]}}

# (rows, in, out), for 64-byte lines of 32 bfloat16 or 16 float32: full lines plus a tail, lines only, a tail only
# (K < 32), more rows than the kernel's 4 accumulators (4 + 1), output counts that leave a remainder after the
# blocks of 4 weight rows in each thread's half, and fewer outputs than one block; inputs that leave whole lines
# and a tail after the steps of several lines (AVX-512: 4 lines per step at 1 row and 4 bfloat16 rows, 2 at 2
# float32 rows); bfloat16 rows of x past the AVX-512 kernel's 24 KiB of short rows at 4, 3 and 2 rows, which it
# takes whole in blocks of 4 weight rows like float32 ones (ending in a tail at 4 rows; output counts below one
# block and past it), up to 52 KiB of float32; one row of 2100, which the kernels compiled with pieces of 4 KiB
# (PIECES) cut into 2 (bfloat16) or 3 (float32) pieces with partial sums; so does the AVX2 kernel, which takes one
# weight row at a time, at every row count (up to 13 pieces). Those kernels also hand out one block of weight rows
# at a time (CHUNK_BYTES: 1, rounded up to a block), so the threads take many chunks and steal from each other.
SHAPES = [(1, 48, 80), (4, 64, 70), (3, 20, 33), (5, 100, 33), (2, 576, 131), (4, 40, 3), (1, 300, 40),
          (4, 232, 9), (4, 3300, 9), (3, 4200, 7), (2, 6200, 5), (1, 2100, 12)]


class _Projections(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(out, k, generator=generator).to(dtype), requires_grad=False)
            for _, k, out in SHAPES)

    def forward(self, xs, transposed):
        outs = [rows_matvec(x, w) for x, w in zip(xs, self.weights)]
        # x as a strided view (a row of x is a column of `transposed`): the kernel must follow strides
        return (*outs, rows_matvec(transposed.t(), self.weights[0]))


def _inputs(dtype):
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, k, generator=generator).to(dtype) for rows, k, _ in SHAPES]
    return xs, torch.randn(SHAPES[0][1], 3, generator=generator).to(dtype)


def _runs_here(isa, dtype):
    return dtype in DOT_ISA[isa] and all(cpu_has(feature) for feature in DOT_ISA[isa][dtype]) \
        and bool(BACKEND.dot_kernel_isa(dtype))


PIECES = 4096
CHUNK_BYTES = 1
VARIANTS = [(isa, dtype, pieces) for pieces in (-1, PIECES) for isa in DOT_ISA for dtype in DOT_ISA[isa]]


kernel_packages.register("rows_matvec", _runs_here, lambda dtype: (_Projections(dtype), _inputs(dtype)))


@pytest.fixture(scope="module", params=VARIANTS, ids=[
    f"{isa}-{'bf16' if dtype == torch.bfloat16 else 'fp32'}{'-pieces-blocks' if pieces > 0 else ''}"
    for isa, dtype, pieces in VARIANTS])
def kernel_package(request, tmp_path_factory):
    """This variant's graph: in the package shared with the other kernels' tests (kernel_packages.py), or, with
    pieces of x and chunks of one block of weight rows (options of the kernel's own), in a package of its own."""
    isa, dtype, pieces = request.param
    if not _runs_here(isa, dtype):
        pytest.skip(f"rows_matvec's {isa} {dtype} kernel needs {' and '.join(DOT_ISA[isa][dtype])} and GCC or Clang")
    if pieces < 0:
        return kernel_packages.kernel_part("rows_matvec", isa, dtype, lambda: tmp_path_factory.mktemp("kernels"))
    return kernel_packages.standalone_part("rows_matvec", isa, dtype, tmp_path_factory.mktemp("pieces"),
                                           piece_bytes=pieces, chunk_bytes=CHUNK_BYTES)


def _expected(module, args):
    # float64 sums of the same numbers, rounded once: the kernel (float32 sums) may differ only in rounding
    xs, transposed = args
    pairs = [*zip(xs, module.weights), (transposed.t(), module.weights[0])]
    return [torch.nn.functional.linear(x.double(), w.double()).to(x.dtype) for x, w in pairs]


def _assert_close(out, expected):
    if out.dtype == torch.bfloat16:  # one bfloat16 rounding step apart at most
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
    else:  # float32 sums of up to 6200 products of unit normals, in another order
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)


def test_kernel_matches_sums_rounded_once(kernel_package):
    module, args = kernel_package.module, kernel_package.args
    outs = kernel_package.run()
    assert len(outs) == len(SHAPES) + 1
    for out, expected, eager in zip(outs, _expected(module, args), module(*args)):
        assert out.dtype == expected.dtype and out.shape == expected.shape
        _assert_close(out, expected)
        _assert_close(out, eager)


@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_matches_at_other_thread_counts(kernel_package, threads):
    # The rows are split into one share per thread (omp_get_max_threads, which torch.set_num_threads sets): one
    # thread takes every chunk; three (more than the cores of a 2-core host) take turns and steal from each other.
    module, args = kernel_package.module, kernel_package.args
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = kernel_package.run()
    finally:
        torch.set_num_threads(before)
    for out, expected in zip(outs, _expected(module, args)):
        _assert_close(out, expected)


def test_kernel_rounds_each_sum_once_to_nearest_even(kernel_package):
    # Rows of x with two ones: each sum is one addition of two weights, exact in float32 in any order, so the output
    # must be that float32 sum rounded once (bfloat16: to nearest, ties to even), bit for bit, in every path (sums
    # stored one at a time, 4 x 4 blocks, pieces).
    module, (xs, transposed) = kernel_package.module, kernel_package.args
    generator = torch.Generator().manual_seed(2)
    hot = []
    for x in xs:
        rows, k = x.shape
        picks = torch.stack([torch.randperm(k, generator=generator)[:2] for _ in range(rows)])
        hot.append(torch.zeros(rows, k, dtype=x.dtype).scatter_(1, picks, 1.0))
    outs = kernel_package.run((hot, transposed))
    for out, x, weight in zip(outs, hot, module.weights):
        picks = x.nonzero()[:, 1].view(x.shape[0], 2)
        expected = (weight.float()[:, picks[:, 0]] + weight.float()[:, picks[:, 1]]).t().to(x.dtype)
        assert torch.equal(out, expected)


def _run_in_a_fresh_process(part, tmp_path, env=None):
    """The part's outputs for its example inputs, run by a process that never imports optimum_neuronx."""
    torch.save(part.flat_inputs(), tmp_path / "inputs.pt")
    script = (
        "import sys, torch\n"
        "loader = torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], 'model', False, 1, -1)\n"
        "torch.save(loader.boxed_run(torch.load(sys.argv[2])), sys.argv[3])\n"
        "assert not any(name.startswith('optimum_neuronx') for name in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, part.path, str(tmp_path / "inputs.pt"),
                             str(tmp_path / "outputs.pt")], capture_output=True, text=True, timeout=120,
                            env=None if env is None else dict(os.environ, **env))
    assert result.returncode == 0, result.stderr[-3000:]
    return part.outputs_from_flat(torch.load(tmp_path / "outputs.pt"))


def test_graph_carries_the_kernel_and_runs_without_our_package(kernel_package, tmp_path):
    # The wrapper calls the kernel as a C function compiled into it, not through the dispatcher: a process that
    # never imported optimum_neuronx (so the op is not registered) runs the graph.
    module, args = kernel_package.module, kernel_package.args
    with zipfile.ZipFile(kernel_package.path) as package:
        wrapper = next(package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_rows_matvec(") == len(SHAPES) + 2  # definition + one call per use
    assert "proxy_executor_call_function" not in wrapper and "call_dispatcher" not in wrapper
    for out, expected in zip(_run_in_a_fresh_process(kernel_package, tmp_path), _expected(module, args)):
        _assert_close(out, expected)


def test_kernel_does_every_share_in_a_team_smaller_than_planned(kernel_package, tmp_path):
    # Shares are planned for omp_get_max_threads() (3 here), but the team that runs them may be smaller (a call
    # from inside another parallel region; here a limit of 1 thread): its threads take the other shares' chunks.
    module, args = kernel_package.module, kernel_package.args
    outs = _run_in_a_fresh_process(kernel_package, tmp_path, env={"OMP_NUM_THREADS": "3", "OMP_THREAD_LIMIT": "1"})
    for out, expected in zip(outs, _expected(module, args)):
        _assert_close(out, expected)


def test_fake_kernel_names_bad_operands():
    with torch._subclasses.FakeTensorMode():
        x, weight = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(5, 9, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"x \[R, K\] and weight \[N, K\] or tiles \[N / T, K, T\]; "
                                             r"got \(2, 8\) and \(5, 9\)"):
            rows_matvec(x, weight)
        with pytest.raises(ValueError, match=r"two bfloat16 or two float32 tensors; got torch.float32 and "
                                             r"torch.bfloat16"):
            rows_matvec(x.float(), weight[:, :8])
        with pytest.raises(ValueError, match=r"got torch.float16 and torch.float16"):
            rows_matvec(x.half(), weight[:, :8].half())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_decode_lowering_uses_the_kernel_up_to_four_rows_and_packs_nothing(dtype, monkeypatch):
    if not BACKEND.dot_kernel_isa(dtype):
        pytest.skip(f"no {dtype} dot kernel on this machine")
    best = next(isa for isa in DOT_ISA if dtype in DOT_ISA[isa] and _runs_here(isa, dtype))
    avx512 = best.startswith("avx512")
    one_row = BACKEND.kernels(dtype, batch_size=1)  # AVX2: no faster than Inductor's multiply + sum at one row
    assert (one_row.dot_rows, one_row.packed_rows) == ((4, 0) if avx512 else (0, 0))
    assert one_row.dot_isa == best  # decode attention's kernel (test_attention_kernel.py) runs at every batch
    for batch in (1, 4) if avx512 else (2, 4):
        lowering = BACKEND.kernels(dtype, batch_size=batch)
        assert lowering.dot_rows == 4 and lowering.for_layers().dot_rows == 4
        assert lowering.packed_rows == 0  # the kernel reads the weights plain: nothing to reorder at load
        assert lowering.uses_dot_kernel(batch, dtype) and not lowering.uses_dot_kernel(batch, torch.float16)
        # the best variant this CPU runs, and the export's target names what it needs
        assert lowering.dot_isa == best
        assert set(DOT_ISA[lowering.dot_isa][dtype]) <= set(BACKEND.target(lowering, dtype).split())
    wide = BACKEND.kernels(dtype, batch_size=8)
    assert not wide.uses_dot_kernel(8, dtype) and wide.uses_dot_kernel(4, dtype)
    assert wide.packed_rows == (8 if wide.onednn else 0)
    if avx512:  # without avx512_bf16, bfloat16 takes the AVX-512 variant that widens it (float32 always does)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        widened = BACKEND.kernels(dtype, batch_size=1)
        assert widened.dot_isa == "avx512" and widened.dot_rows == 4
        # the kernel adds nothing to what Inductor's own kernels need (which may name avx512_bf16 on such a CPU)
        assert set(BACKEND.target(widened, dtype).split()) == set(BACKEND.target().split()) | {"avx512"}
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)  # an AVX2 CPU takes the AVX2 variant
    assert BACKEND.kernels(dtype, batch_size=4).dot_isa == "avx2"
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: False)
    without = BACKEND.kernels(dtype, batch_size=4)
    assert without.dot_rows == 0 and without.packed_rows == (4 if without.onednn else 0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weights_the_kernel_reads_are_never_packed(tied):
    # An export packs weights for oneDNN at load only when its token graphs' rows (the batch) are past the
    # kernel's: the kernel reads them plain. (Built on the meta device: no memory.)
    from optimum_neuronx.modeling.decoder import StaticDecoder
    from optimum_neuronx.modeling.spec import DecoderSpec

    spec = DecoderSpec(vocab_size=256, hidden_size=576, intermediate_size=3072, num_layers=2, num_heads=9,
                       num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, hidden_act="silu", qkv_bias=False,
                       o_bias=False, mlp_bias=False, qk_norm=False, tie_word_embeddings=tied,
                       rope_inv_freq=(1.0,) * 32, rope_attention_scaling=1.0)
    projections = [f"layers.{i}.{name}.weight" for i in range(2)
                   for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    every = projections if tied else [*projections, "lm_head.weight"]  # a tied head is the embedding: plain
    for dtype in (torch.float32, torch.bfloat16):
        for dot_rows, packed_rows, packed in ((4, 4, []), (4, 8, every), (0, 4, every), (4, 0, [])):
            lowering = Lowering(dot_rows=dot_rows, onednn=True, packed_rows=packed_rows, matvec_rows=4)
            with torch.device("meta"):
                decoder = StaticDecoder(spec, lowering).to(dtype)
            assert BACKEND.packable_weight_names(decoder) == packed, (dtype, dot_rows, packed_rows)


@pytest.mark.parametrize("isa, dtype, lacking", [("avx512_bf16", torch.bfloat16, "avx512_bf16"),
                                                 ("avx512", torch.bfloat16, "avx512"),
                                                 ("avx512", torch.float32, "avx512"),
                                                 ("avx2", torch.bfloat16, "avx2"), ("avx2", torch.float32, "avx2")])
def test_export_needing_the_kernel_refused_on_a_cpu_without_its_instructions(isa, dtype, lacking, monkeypatch):
    target = BACKEND.target(Lowering(dot_rows=4, dot_isa=isa), dtype)
    assert lacking in target.split()
    # This CPU pretends to have everything else the target names, whatever it really has.
    for feature in target.split()[1:]:
        monkeypatch.setattr(torch.cpu, X86_FEATURE_PROBES[feature], lambda lacks=feature == lacking: not lacks)
    reason = BACKEND.missing_target_support(target)
    assert f"this CPU lacks {lacking} (it supports:" in reason, reason
    for feature in target.split()[1:]:
        monkeypatch.setattr(torch.cpu, X86_FEATURE_PROBES[feature], lambda: True)
    assert BACKEND.missing_target_support(target) == ""


@pytest.mark.parametrize("cpuinfo, identity, one_row, several_rows", [
    ("vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\nvendor_id\t: AuthenticAMD\n", ("AuthenticAMD", 26), 0, 0),
    ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\n", ("AuthenticAMD", 25), 0, 1),  # no entry: the generic profile
    ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n", ("GenuineIntel", 6), 1, 1),
    ("processor\t: 0\nBogoMIPS\t: 50.00\n", ("", -1), 0, 1),  # no x86 fields (e.g. aarch64)
])
def test_kernel_tuning_follows_the_cpu(cpuinfo, identity, one_row, several_rows, tmp_path, monkeypatch):
    from optimum_neuronx.backends.inductor import codegen as inductor_codegen, custom_kernels as inductor_kernels
    from optimum_neuronx.backends.inductor import tuning as tuning_table

    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert tuning_table.cpu_identity(str(path)) == identity
    monkeypatch.setattr(tuning_table, "cpu_identity", lambda: identity)
    tuning = {"row_prefetch_locality": one_row, "rows_prefetch_locality": several_rows}
    assert tuning_table.kernel_tuning() == tuning
    # the kernel is compiled with them, Inductor's row reductions prefetch with the one-row hint, and exports
    # (and their compile-cache keys) carry them all
    shims = inductor_kernels.c_shim_options(4, "avx512")["aot_inductor.custom_ops_to_c_shims"]
    source = shims[torch.ops.optimum_neuronx.rows_matvec.default][0]
    # one translation unit: the shared header once, in front of the kernels, which no longer include it
    assert source.count("#define OPTIMUM_NEURONX_KERNELS_COMMON_H") == 1 and '#include "common.h"' not in source
    assert source.index("OPTIMUM_NEURONX_KERNELS_COMMON_H") < source.index("aoti_torch_cpu_rows_matvec")
    assert f"#define OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY {one_row}\n" in source
    assert f"#define OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY {several_rows}\n" in source
    assert inductor_codegen.row_prefetch_locality() == one_row
    assert BACKEND.codegen_options()["kernel_tuning"] == tuning
    assert BACKEND.codegen_options()["row_prefetch_locality"] == one_row


def test_the_tuning_table_names_only_known_constants():
    # every CPU's entry overrides values the generic profile has: a misspelt name would silently do nothing
    from optimum_neuronx.backends.inductor import tuning

    generic = tuning.PROFILES["generic"]
    assert set(generic) == {"weight_tile", *tuning.KERNEL_CONSTANTS}
    for name, entry in tuning.PROFILES.items():
        assert set(entry) <= set(generic), name
        assert all(dtype in ("fp32", "bf16", "fp16") for dtype in entry.get("weight_tile", {})), name
