"""Projection weights stored in tiles [N / T, K, T] (Lowering.weight_tile, modeling/layout.py): the ops, the dot kernel's tiled path
(decode), tiled_linear's kernel (prefill), in float32 and bfloat16, and exports that store their weights that way."""

import json
import zipfile

import pytest
import torch
from safetensors import safe_open

from optimum_neuronx import NeuronModelForCausalLM
from conftest import DTYPE_NAMES, tune
from optimum_neuronx.backends import get_backend
from optimum_neuronx.backends.inductor import backend as inductor, custom_kernels as inductor_kernels, ops
from optimum_neuronx.backends.inductor.lowering import Lowering, project
from optimum_neuronx.backends.inductor.ops import rows_matvec, tiled_linear
from optimum_neuronx.modeling.layout import tile_weight, untile_weight

BACKEND = get_backend("inductor")
# (rows, inputs, outputs, tile): 1-4 rows (one accumulator set or two), 5 rows (a chunk of 4, then 1), an odd
# number of inputs (bfloat16: the last input alone after the pairs), one tile only, tiles of 16, 32 and 64 outputs
# (bfloat16: 32 and 64, whole lines)
SHAPES = {torch.float32: [(1, 48, 64, 32), (2, 33, 96, 32), (3, 100, 128, 16), (4, 64, 256, 64), (5, 7, 32, 32),
                          (4, 576, 32, 32), (1, 2049, 320, 64), (3, 5, 48, 16)],
          torch.bfloat16: [(1, 48, 64, 32), (2, 33, 96, 32), (3, 100, 128, 64), (4, 64, 256, 64), (5, 7, 32, 32),
                           (4, 576, 32, 32), (1, 2049, 320, 64), (3, 5, 64, 32)]}


def _avx512_kernel(dtype=torch.float32):
    if BACKEND.dot_kernel_isa(dtype) != inductor.TILED_ISA[dtype]:
        pytest.skip(f"tiled {dtype} weights are read by the dot kernel's {inductor.TILED_ISA[dtype]} variant, which "
                    f"this CPU lacks")


@pytest.mark.parametrize("copy_bytes", [16 << 20, 0], ids=["copied-to-rows", "per-tile"])
def test_tiles_round_trip_and_the_eager_ops_match_linear(copy_bytes, monkeypatch):
    monkeypatch.setattr(ops, "TILED_LINEAR_COPY_BYTES", copy_bytes)  # tiled_linear's two ways through oneDNN
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(3, 96, 40, generator=generator), torch.randn(5, 40, generator=generator)
    tiles = tile_weight(weight, 32)  # stacked layers: the leading axis stays
    assert tiles.shape == (3, 3, 40, 32) and torch.equal(tiles[1, 2, 7], weight[1, 64:96, 7])
    assert torch.equal(untile_weight(tiles), weight)
    bias = torch.randn(96, generator=generator)
    expected = torch.nn.functional.linear(x, weight[0], bias)
    torch.testing.assert_close(rows_matvec(x, tiles[0]) + bias, expected)
    torch.testing.assert_close(tiled_linear(x, tiles[0], bias), expected)
    torch.testing.assert_close(tiled_linear(x, tiles[0], None), expected - bias)
    with pytest.raises(ValueError, match="cannot be cut into tiles of 32"):
        tile_weight(torch.zeros(40, 8), 32)
    bf16 = [t.bfloat16() for t in (x, tiles[0], bias)]  # bfloat16 alike (oneDNN's linear, or the tiles' product)
    expected = torch.nn.functional.linear(bf16[0], weight[0].bfloat16(), bf16[2]).float()
    torch.testing.assert_close(tiled_linear(*bf16).float(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close((rows_matvec(*bf16[:2]) + bf16[2]).float(), expected, rtol=2e-2, atol=2e-2)
    with torch._subclasses.FakeTensorMode():  # what export traces: the fake op checks the operands
        with pytest.raises(ValueError, match="two bfloat16 or two float32 tensors"):
            rows_matvec(torch.empty(2, 40, dtype=torch.bfloat16), torch.empty(3, 40, 32))
        with pytest.raises(ValueError, match=r"tiles \[N / T, K, T\]; got \(2, 40\) and \(3, 41, 32\)"):
            rows_matvec(torch.empty(2, 40), torch.empty(3, 41, 32))
        with pytest.raises(ValueError, match=r"tiled_linear takes x \[R, K\], tiles \[N / T, K, T\] and a bias"):
            tiled_linear(torch.empty(9, 40), torch.empty(3, 41, 32), None)
        with pytest.raises(ValueError, match=r"and \(\(95,\), torch.float32\)"):
            tiled_linear(torch.empty(9, 40), torch.empty(3, 40, 32), torch.empty(95))


class _TiledProjections(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        shapes = SHAPES[dtype]
        self.plain = [torch.randn(out, k, generator=generator).to(dtype) for _, k, out, _ in shapes]
        self.tiles = torch.nn.ParameterList(torch.nn.Parameter(tile_weight(w, tile), requires_grad=False)
                                            for w, (*_, tile) in zip(self.plain, shapes))
        # a bias for every other prefill (tiled_linear's kernel adds it; the others pass None)
        self.biases = [torch.randn(out, generator=generator).to(dtype) if i % 2 else None
                       for i, (_, _, out, _) in enumerate(shapes)]

    def forward(self, xs, transposed, many):
        # x as a strided view too (a row of x is a column of `transposed`): the kernel follows strides. `many`: x
        # of PREFILL_ROWS rows each, for tiled_linear (prefill) over the same tiles
        return (*(rows_matvec(x, w) for x, w in zip(xs, self.tiles)), rows_matvec(transposed.t(), self.tiles[0]),
                *(tiled_linear(x, w, b) for x, w, b in zip(many, self.tiles, self.biases)),
                tiled_linear(transposed.t(), self.tiles[0], None))


# rows of x per SHAPES entry for tiled_linear: blocks of 8 rows (tiles of 16 and 32) or 4 (64), and what is left
# after them (a half block, then fewer)
PREFILL_ROWS = [13, 8, 23, 7, 1, 9, 3, 30]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiled_package(request, tmp_path_factory):
    from torch._inductor.package import package_aoti

    dtype = request.param
    _avx512_kernel(dtype)
    generator = torch.Generator().manual_seed(1)
    module = _TiledProjections(dtype).eval()
    shapes = SHAPES[dtype]
    args = ([torch.randn(rows, k, generator=generator).to(dtype) for rows, k, _, _ in shapes],
            torch.randn(shapes[0][1], 3, generator=generator).to(dtype),
            [torch.randn(rows, k, generator=generator).to(dtype) for rows, (_, k, _, _) in zip(PREFILL_ROWS, shapes)])
    program = torch.export.export(module, args, strict=False)
    # chunks of one tile: many chunks, which the threads steal from each other
    options = inductor_kernels.c_shim_options(4, inductor.TILED_ISA[dtype], chunk_bytes=1)
    files = torch._inductor.aot_compile(program.module(), args, options={"aot_inductor.package": True, **options})
    return package_aoti(str(tmp_path_factory.mktemp("tiled") / "kernel.pt2"), files), module, args


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_kernel_reads_tiles_as_linear_does(tiled_package, threads):
    from torch._inductor.package import load_package

    path, module, (xs, transposed, many) = tiled_package
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        outs = load_package(path)(xs, transposed, many)
    finally:
        torch.set_num_threads(before)
    triples = [*((x, w, None) for x, w in zip(xs, module.plain)), (transposed.t(), module.plain[0], None),
               *zip(many, module.plain, module.biases), (transposed.t(), module.plain[0], None)]
    assert len(outs) == len(triples)
    for out, (x, weight, bias) in zip(outs, triples):
        # float32 sums in another order (bfloat16: then rounded, at most an ulp, 2^-8 of the value, apart)
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias if bias is None else bias.double())
        assert out.shape == expected.shape and out.dtype == x.dtype
        tolerance = {"rtol": 1e-5, "atol": 1e-4} if x.dtype == torch.float32 else {"rtol": 2 ** -8, "atol": 1e-3}
        torch.testing.assert_close(out.double(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowering_tiles_decode_batches_where_tuned(dtype, monkeypatch):
    _avx512_kernel(dtype)
    tune(monkeypatch, weight_tile={DTYPE_NAMES[dtype]: 32})
    lowerings = [BACKEND.kernels(dtype, batch_size=b) for b in (1, 2, 4)]
    assert [lowering.weight_tile for lowering in lowerings] == [32, 32, 32]
    assert BACKEND.kernels(dtype, batch_size=5).weight_tile == 0  # oneDNN's packed weights past 4 rows
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    assert BACKEND.kernels(other, batch_size=1).weight_tile == 0
    tune(monkeypatch, weight_tile={})
    assert BACKEND.kernels(dtype, batch_size=4).weight_tile == 0


def test_project_routes_tiles_by_rows_and_refuses_rows_it_cannot_read():
    # `project` (eager: the custom ops' own implementations): decode rows through the dot kernel, prefill rows
    # through tiled_linear, and a clear error where neither may read the tiles
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(64, 24, generator=generator), torch.randn(64, generator=generator)
    tiles = tile_weight(weight, 32)
    lowering = Lowering(dot_rows=4, matvec_rows=4, onednn=True, weight_tile=32)
    for rows in (1, 4, 9):  # 1 and 4: rows_matvec; 9: past dot_rows and matvec_rows, tiled_linear
        x = torch.randn(1, rows, 24, generator=generator)
        torch.testing.assert_close(project(x, tiles, bias, lowering), torch.nn.functional.linear(x, weight, bias))
    narrow = Lowering(dot_rows=1, matvec_rows=4, weight_tile=32)  # 3 rows: past the kernel, not past matvec
    with pytest.raises(ValueError, match=r"a tiled weight needs the dot kernel for 3 rows"):
        project(torch.randn(3, 24, generator=generator), tiles, None, narrow)


def _tiled_export(checkpoint, dtype, batch_size, tile=32):
    """The tiny llama exported with tiles of `tile` (whatever this CPU's tuning says): a context bucket of 16 and
    token buckets of 32 and 64."""
    _avx512_kernel(dtype)
    with pytest.MonkeyPatch.context() as patch:
        tune(patch, weight_tile={DTYPE_NAMES[dtype]: tile})
        return NeuronModelForCausalLM.from_pretrained(checkpoint, export=True, batch_size=batch_size,
                                                      sequence_length=64, context_buckets=[16],
                                                      token_buckets=[32, 64], compile_cache=False,
                                                      auto_cast_type="bf16" if dtype == torch.bfloat16 else None)


@pytest.fixture(scope="module")
def tiled_llama(tiny_checkpoint):
    return _tiled_export(tiny_checkpoint("llama"), torch.float32, batch_size=2)


def _wrappers(model) -> dict:
    with zipfile.ZipFile(model.artifact_dir / "model.pt2") as package:
        return {name: package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp")}


def _assert_tiled_graphs(model):
    # prefill through our tiled_linear kernel (a direct call, not the dispatcher); decode through the dot kernel,
    # every projection (no width past which one row leaves it)
    call = "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_tiled_linear("
    wrappers = _wrappers(model)
    assert all(call in text and '"optimum_neuronx::tiled_linear"' not in text
               for name, text in wrappers.items() if "context" in name)
    # definition + calls: QKV, O, gate/up and down in the layer loop, the LM head
    assert all(call not in text and text.count("aoti_torch_cpu_rows_matvec(") == 1 + 5
               for name, text in wrappers.items() if "token" in name)


def test_export_stores_tiles_and_generates_as_transformers(tiled_llama, reference_model, left_padded_batch, tmp_path):
    from optimum_neuronx.verification import reference_from_artifact

    stamp = json.loads((tiled_llama.artifact_dir / "neuron_config.json").read_text())["versions"]["compiler"]
    assert stamp["lowering"]["weight_tile"] == 32
    with safe_open(str(tiled_llama.artifact_dir / "neuronx_weights.safetensors"), "pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    # 2 stacked layers of tiles; the LM head (untied) too; the embedding, norms and biases plain
    assert shapes["layers.qkv_proj.weight"] == (2, 128 // 32, 64, 32)
    assert shapes["layers.gate_up_proj.weight"] == (2, 2176 // 32, 64, 32)
    assert shapes["layers.down_proj.weight"] == (2, 64 // 32, 1088, 32)
    assert shapes["lm_head.weight"] == (256 // 32, 64, 32)
    assert shapes["embed_tokens.weight"] == (256, 64) and shapes["layers.qkv_proj.bias"] == (2, 128)
    _assert_tiled_graphs(tiled_llama)

    # prompts of 9 and 14 tokens, 44 new tokens: through the 16-token context graph, then token buckets 32 and 64
    input_ids, attention_mask = (t[1:] for t in left_padded_batch)
    reference = reference_model("llama")
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=44, do_sample=False)
    out = tiled_llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=44, do_sample=False)
    assert torch.equal(out, expected)
    with torch.no_grad():
        eager = reference(input_ids, attention_mask=attention_mask).logits[:, -1]
    compiled = tiled_llama(input_ids, attention_mask=attention_mask).logits[:, -1]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    # the artifact's own weights rebuild the Transformers model (tiles back to rows)
    rebuilt = reference_from_artifact(tiled_llama.artifact_dir)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(rebuilt.state_dict()[name], value)
    # and a reload runs the tiles without compiling
    tiled_llama.save_pretrained(tmp_path / "saved")
    reloaded = NeuronModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20,
                                         do_sample=False), expected[:, :input_ids.shape[1] + 20])


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 2])
def test_bfloat16_tiles_export_within_bfloat16s_rounding(tiny_checkpoint, reference_model, left_padded_batch,
                                                         batch_size):
    # bfloat16 tiles of 64 (two lines per input, the tiny llama's qkv bias added after the kernel at decode and
    # inside it at prefill); batch 1: the 14-token prompt alone, its down projection (1088 inputs) tiled too
    from conftest import assert_bf16_logits_within_tolerance

    model = _tiled_export(tiny_checkpoint("llama"), torch.bfloat16, batch_size, tile=64)
    stamp = json.loads((model.artifact_dir / "neuron_config.json").read_text())["versions"]["compiler"]
    assert stamp["lowering"]["weight_tile"] == 64
    with safe_open(str(model.artifact_dir / "neuronx_weights.safetensors"), "pt") as weights:
        down = weights.get_slice("layers.down_proj.weight")
        assert tuple(down.get_shape()) == (2, 1, 1088, 64) and down.get_dtype() == "BF16"
    _assert_tiled_graphs(model)
    input_ids, attention_mask = (t[3 - batch_size:] for t in left_padded_batch)
    assert_bf16_logits_within_tolerance(model, tiny_checkpoint, reference_model, input_ids, attention_mask)
    # greedy decoding through both token buckets: Transformers' tokens in bfloat16, or a step where they differ only
    # between tokens within bfloat16's rounding of each other
    from transformers import AutoModelForCausalLM

    from optimum_neuronx.verification import compare_generation

    eager = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.bfloat16).eval()
    result = compare_generation(eager, model, input_ids, attention_mask, max_new_tokens=44, min_new_tokens=44)
    assert result.new_tokens == 44 and (result.tokens_match or result.near_tie), result.summary()
