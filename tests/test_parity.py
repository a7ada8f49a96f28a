"""Compiled graphs vs Transformers eager, for every supported architecture."""

import contextlib
import gc
from dataclasses import replace
import weakref

import pytest
import torch

from conftest import (ARCHITECTURES, BF16_BLOCK_KINDS, BF16_EXPORT, assert_bf16_logits_within_tolerance,
                      assert_staggered_requests_match_generate_alone, build_tiny_checkpoint, left_padded_prompts,
                      tiny_export, tune)
from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.verification import compare_generation


def family_params(exclude: str = ""):
    """Every family: llama in the inner loop (`-m "not slow"`), the others with the slow tests."""
    return [a if a == "llama" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHITECTURES if a != exclude]


# fp32: compiled and eager differ by ~1e-5; the bound leaves room for kernel reordering only.
LOGIT_TOLERANCE = 1e-3


@pytest.mark.parametrize("model_type", family_params())
def test_greedy_batch_crosses_token_bucket(model_type, reference_model, compiled_model, left_padded_batch,
                                           record_property):
    input_ids, attention_mask = left_padded_batch
    new_tokens = 45  # prompts of 5..14 tokens + 45 > 32: decode crosses the 32 -> 64 token bucket
    result = compare_generation(reference_model(model_type), compiled_model(model_type), input_ids, attention_mask,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    record_property("max_logit_diff", result.max_logit_diff)
    record_property("min_top2_gap", result.min_top2_gap)
    print(f"{model_type}: {result.summary()}")
    assert result.new_tokens == new_tokens
    assert result.max_logit_diff < LOGIT_TOLERANCE, result
    assert result.tokens_match, result
    if model_type == "gemma3_text":  # two 8-token local layers' rings share one row of 64 slots beside the global layer
        model = compiled_model(model_type)
        assert model._engine.cache.kv.shape[0] == 2 and len(model._engine.handle) == 3  # the handle counts 3 layers


@pytest.mark.parametrize("model_type", family_params())
def test_staggered_requests_through_the_engine_match_generate_alone(model_type, compiled_model, tiny_checkpoint):
    # phi3's family export keeps context graphs (its static batches switch LongRoPE together): its own export here.
    model = compiled_model(model_type) if model_type != "phi3" else NeuronModelForCausalLM.from_pretrained(
        tiny_checkpoint(model_type), export=True, **tiny_export(model_type, continuous_batching=True))
    assert_staggered_requests_match_generate_alone(model)


def test_a_prompt_three_times_the_largest_context_bucket_matches_transformers(compiled_model, reference_model):
    # continuous batching: 48 tokens prefilled in three chunks of 16 (each attending to the chunks before it), then
    # decoded across the 32 -> 64 token bucket; through generate and through the scheduler's slots
    from optimum_neuronx.scheduler import Request, Scheduler

    model = compiled_model("llama")
    prompt = torch.randint(3, 256, (1, 3 * max(model.neuron_config.context_buckets)),
                           generator=torch.Generator().manual_seed(5))
    expected = reference_model("llama").generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False), expected)
    served = Scheduler(model._engine).generate([Request(prompt[0].tolist(), 12, request_id="long")])["long"]
    assert [t for output in served for t in output.token_ids] == expected[0, prompt.shape[1]:].tolist()


# phi3 left out: LongRoPE picks its frequencies by the longest position of the whole batch (in Transformers too), so
# a short prompt switches earlier in a batch than alone.
@pytest.mark.parametrize("model_type", family_params(exclude="phi3"))
def test_prompt_alone_matches_prompt_in_padded_batch(model_type, compiled_model, left_padded_batch):
    model = compiled_model(model_type)
    input_ids, attention_mask = left_padded_batch
    batched = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool()
        alone = model.generate(input_ids=input_ids[row:row + 1, real], max_new_tokens=20, do_sample=False)
        new_alone, new_batched = alone[0, int(real.sum()):], batched[row, input_ids.shape[1]:]
        # alone, a row that reaches EOS stops there; in the batch it is padded after it
        assert torch.equal(new_alone, new_batched[:len(new_alone)]), f"row {row} differs alone vs in the batch"
        assert (new_batched[len(new_alone):] == model.generation_config.pad_token_id).all()


@pytest.mark.slow
def test_context_logits_match_eager(reference_model, compiled_model, left_padded_batch):
    model_type = "qwen3"
    input_ids, attention_mask = left_padded_batch
    with torch.no_grad():
        expected = reference_model(model_type)(input_ids=input_ids, attention_mask=attention_mask).logits[:, -1]
    actual = compiled_model(model_type)(input_ids=input_ids, attention_mask=attention_mask).logits[:, -1]
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.slow
def test_smaller_runtime_batch_is_padded(reference_model, compiled_model):
    model_type = "mistral"
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3]])
    expected = reference_model(model_type).generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    actual = compiled_model(model_type).generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    assert torch.equal(actual, expected)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """The Llama block in bfloat16 with heads of 64 (SmolLM2's, the 1.1B shape's; 3 query heads per KV head, as
    SmolLM2): with avx512_bf16 decode attention reads the bfloat16 cache with vdpbf16ps against the query rounded to
    bfloat16 (decode_attention.cpp, DenseRows), where the other tiny models' heads of 16 take the loops that widen
    each block of rows. Plain weight rows, where this CPU's tuning would tile them (tiles: test_tiled_weights.py).
    Returns (model, checkpoint, eager float32 reference)."""
    from transformers import AutoModelForCausalLM

    checkpoint = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("heads-of-64"), hidden_size=96, head_dim=64,
                                       num_attention_heads=6, num_key_value_heads=2)
    with pytest.MonkeyPatch.context() as patch:
        tune(patch, weight_tile={})
        model = NeuronModelForCausalLM.from_pretrained(checkpoint, export=True, **BF16_EXPORT)
    return model, checkpoint, AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.mark.slow
def test_bf16_export_runs_decode_projections_through_the_dot_kernel(bf16_llama):
    # The teacher-forced test below checks this export's numbers: it must be the kernel's path that it checks.
    import json

    from optimum_neuronx.backends import get_backend

    from optimum_neuronx.backends.inductor.custom_kernels import DOT_KERNEL_ISAS

    isa = get_backend("inductor").dot_kernel_isa(torch.bfloat16)
    if not isa:
        pytest.skip("no bfloat16 dot kernel on this machine (it needs AVX2 or AVX-512, and GCC or Clang)")
    model = bf16_llama[0]
    stamp = json.loads((model.artifact_dir / "neuron_config.json").read_text())["versions"]["compiler"]
    assert stamp["lowering"]["dot_rows"] == 4 and stamp["packable_weights"] == []  # all read by the kernel
    assert stamp["lowering"]["dot_isa"] == isa and stamp["codegen"]["kernels"]
    assert set(DOT_KERNEL_ISAS[isa][torch.bfloat16]) <= set(stamp["target"].split())


@pytest.mark.slow
def test_bf16_logits_within_tolerance_teacher_forced(bf16_llama, left_padded_batch):
    """bf16 greedy paths diverge between any two implementations: compare logits on the same tokens instead.

    The yardstick is bf16's own rounding noise: Transformers eager in bf16 vs the fp32 reference.
    """
    model, checkpoint, reference = bf16_llama
    input_ids, attention_mask = (t[1:] for t in left_padded_batch)  # 2 rows: lengths 9 and 14
    assert_bf16_logits_within_tolerance(model, lambda _: checkpoint, lambda _: reference, input_ids, attention_mask)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", BF16_BLOCK_KINDS)
def test_bf16_logits_of_every_block_kind_within_tolerance(model_type, tiny_checkpoint, reference_model, left_padded_batch):
    # its own export: bfloat16 (the shared exports are float32)
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), export=True, **BF16_EXPORT)
    if model_type == "gpt2":
        # As many KV heads as query heads (gpt2, Llama-2, Phi-3-mini): AOTInductor's layer loop crashed the process at
        # the first bfloat16 decode step; the inductor backend unrolls such models' layers.
        assert not _scans_layers(model, tiny_checkpoint(model_type))
    input_ids, attention_mask = (t[1:] for t in left_padded_batch)
    assert_bf16_logits_within_tolerance(model, tiny_checkpoint, reference_model, input_ids, attention_mask,
                                        model_type)


def _scans_layers(model, checkpoint) -> bool:
    """Whether the inductor backend compiled `model`'s layers as one loop (else unrolled)."""
    from transformers import AutoConfig

    from optimum_neuronx.backends import get_backend
    from optimum_neuronx.exporters import get_export_config

    config = AutoConfig.from_pretrained(checkpoint)
    spec = get_export_config(config.model_type).decoder_spec(config, model.neuron_config)
    return get_backend("inductor").kernels(torch.bfloat16, model.neuron_config.batch_size).scans(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_projection_as_reduction_matches_linear(rows, dtype):
    # The decode graphs write few-row projections as one multiply + sum per row: each output row must be
    # that row's F.linear (no mixed-up rows or transposed layout) on both sides of the row limit, eager and
    # compiled. bfloat16 is checked against float32 math on the same rounded inputs, within its rounding.
    from optimum_neuronx.backends import get_backend
    from optimum_neuronx.backends.inductor.lowering import project

    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 48, generator=generator).to(dtype)
    weight = torch.randn(80, 48, generator=generator).to(dtype)
    bias = torch.randn(80, generator=generator).to(dtype)
    # bfloat16 decode uses the dot kernel where the CPU has avx512_bf16 (test_kernels.py); elsewhere this path
    lowering = replace(get_backend("inductor").kernels(dtype, batch_size=1), dot_rows=0)
    assert lowering.matvec_rows == 4 and not lowering.packed_rows
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    out = project(x, weight, bias, lowering)
    assert out.shape == (rows, 1, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **tolerance)
    if rows > lowering.matvec_rows:
        return  # oneDNN's linear; Inductor lowers it only with the weight a graph constant (exports: parity tests)
    with torch.no_grad():
        compiled = torch.compile(project, fullgraph=True)(x, weight, bias, lowering)
    assert compiled.dtype == dtype
    torch.testing.assert_close(compiled.float(), expected, **tolerance)


@pytest.mark.parametrize("native", [False, True])
def test_half_precision_gemm_upcasts_only_without_native_support(monkeypatch, native):
    # Without avx512_bf16/AMX the BLAS emulates bf16 GEMMs (8x slower than float32): the inductor backend then
    # multiplies in float32 and rounds the result, which equals a float32 GEMM of the same operands.
    from optimum_neuronx.backends import get_backend
    from optimum_neuronx.backends.inductor.lowering import project

    backend = get_backend("inductor")
    really_native = backend.gemm_dtype(torch.bfloat16) == torch.bfloat16
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: native, raising=False)
    assert backend.gemm_dtype(torch.float32) == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        assert backend.gemm_dtype(dtype) == (dtype if native else torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 48, generator=generator).bfloat16()
    weight = torch.randn(80, 48, generator=generator).bfloat16()
    lowering = backend.kernels(torch.bfloat16, batch_size=1)
    assert lowering.onednn == native  # without native dot products, no oneDNN bf16 either
    if native and not really_native:
        pytest.skip("oneDNN has no bfloat16 GEMM on this CPU (no avx512_bf16 or AMX): only the choice was checked")
    out = project(x, weight, None, lowering)
    assert out.dtype == torch.bfloat16
    reference = torch.nn.functional.linear(x.float(), weight.float()).bfloat16() if not native else \
        torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_projection_with_packed_weight_matches_linear(rows, dtype):
    # Exports with a batch past the dot kernel's rows (or without it) run the layer projections through oneDNN
    # with the weight reordered at load (packed): whatever the row count, the result is F.linear's. (Compiled: the
    # batch-5 export below.)
    from optimum_neuronx.backends import get_backend
    from optimum_neuronx.backends.inductor.lowering import project

    backend = get_backend("inductor")
    lowering = replace(backend.kernels(dtype, batch_size=8).for_layers(), dot_rows=0)
    if not lowering.packed_rows:
        pytest.skip(f"this CPU has no native {dtype} dot products: no oneDNN path")
    assert lowering.onednn and lowering.matvec_rows == 0
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 48, generator=generator).to(dtype)
    weight = torch.randn(80, 48, generator=generator).to(dtype)
    bias = torch.randn(80, generator=generator).to(dtype)
    packed = backend.pack_weight(weight, lowering.packed_rows)
    assert packed.is_mkldnn
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    for weight_given in (weight, packed):
        out = project(x, weight_given, bias, lowering)
        assert out.shape == (rows, 1, 80) and out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, **tolerance)


def test_weights_file_puts_whole_line_tensors_on_cache_lines(tmp_path):
    # The dot kernel streams weights straight from the mapped file: each tensor that is a whole number of 64-byte
    # lines must start on a line (odd-sized ones go last), and the library must read every tensor back unchanged.
    import json
    import struct

    from safetensors import safe_open
    from safetensors.torch import load_file

    from optimum_neuronx.weights_io import WEIGHTS_ALIGNMENT, save_weights

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.odd": torch.randn(3, generator=generator).to(torch.bfloat16),  # 6 bytes: would shift what follows it
        "b.matrix": torch.randn(3, 48, generator=generator),
        "c.half": torch.randn(5, 32, generator=generator).to(torch.bfloat16),
        "d.flags": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(7, dtype=torch.int64),
        "f.empty": torch.zeros(0, 4),
        "g.rows": torch.randn(16, 7, generator=generator).t(),  # not contiguous
    }
    path = tmp_path / "model.safetensors"
    save_weights(tensors, path)
    with open(path, "rb") as f:
        header_size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_size))
    assert header.pop("__metadata__") == {"format": "pt"}
    for name in ("b.matrix", "c.half", "g.rows", "f.empty"):
        assert (8 + header_size + header[name]["data_offsets"][0]) % WEIGHTS_ALIGNMENT == 0, name
    assert header["a.odd"]["data_offsets"][0] > header["g.rows"]["data_offsets"][0]  # odd sizes after whole lines
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("g.rows"), tensors["g.rows"])
    with pytest.raises(TypeError, match="complex64"):
        save_weights({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "other.safetensors")


def test_packing_reads_the_weights_file_ahead_front_to_back(tmp_path, monkeypatch):
    # While packable weights are packed, a thread asks the kernel to read the file ahead in large requests, in file
    # order, and stops with the packing.
    import os
    import threading
    import time

    from optimum_neuronx import weights_io as artifacts

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(5 * 1024 + 1))
    calls = []
    monkeypatch.setattr(artifacts.os, "posix_fadvise", lambda fd, offset, length, advice: calls.append(
        (offset, length, advice)))
    with artifacts._reading_ahead(str(path), chunk_bytes=1024):
        deadline = time.monotonic() + 10
        while len(calls) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert calls == [(i * 1024, 1024, os.POSIX_FADV_WILLNEED) for i in range(5)] + [(5120, 1, os.POSIX_FADV_WILLNEED)]
    assert not any(thread.name == "optimum-neuronx-read-ahead" for thread in threading.enumerate())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_attention_matches_sdpa(dtype):
    # Token-generation graphs compute attention as multiply + sum reductions (Lowering.attention_tokens): it
    # must equal SDPA over the same cache and mask, with padding, GQA row folding and a row that sees nothing
    # (a padding row: finite minimum mask, no NaN), eager and compiled; over the keys in one part, and split in
    # two (decode: the cache window and the new tokens beside it) under one softmax.
    from optimum_neuronx.backends import get_backend
    from optimum_neuronx.backends.inductor.lowering import reduced_attention

    assert get_backend("inductor").kernels(dtype, batch_size=1).attention_tokens == 1
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, rows, window, head_dim = 3, 2, 4, 24, 16
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=generator).to(dtype)
    keys, values = (torch.randn(batch, kv_heads, window, head_dim, generator=generator).to(dtype) for _ in range(2))
    allowed = torch.ones(batch, 1, rows, window, dtype=torch.bool)
    allowed[0, ..., :7] = False  # left padding
    allowed[1, ..., 20:] = False  # slots not written yet
    allowed[2] = False  # nothing to attend to
    mask = torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                                                attn_mask=mask.float(), scale=0.25)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        whole = [(keys, values, mask)]
        split = [(keys[:, :, :18], values[:, :, :18], mask[..., :18]), (keys[:, :, 18:], values[:, :, 18:],
                                                                        mask[..., 18:])]
        compiled = torch.compile(reduced_attention, fullgraph=True)
        outputs = [attend(q, parts, 0.25) for attend in (reduced_attention, compiled) for parts in (whole, split)]
    for out in outputs:
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [0, 64])
def test_blocked_causal_attention_matches_sdpa(dtype, block):
    # Context graphs fold each KV group's query heads into the query axis and, with Lowering.causal_block, run
    # SDPA per block of queries against only the keys up to the block's end. For every real query that must
    # equal plain SDPA with K/V repeated per head over the whole causal + padding mask: with a last block shorter
    # than the others and left padding filling a whole block. Padding queries see no key: their outputs (never
    # read) may differ, but are not NaN.
    from optimum_neuronx.modeling.attention import attention, attention_masks
    from optimum_neuronx.modeling.kernels import Kernels

    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, n_rep, tokens, head_dim = 3, 2, 3, 150, 16
    q = torch.randn(batch, kv_heads * n_rep, tokens, head_dim, generator=generator).to(dtype)
    keys, values = (torch.randn(batch, kv_heads, tokens, head_dim, generator=generator).to(dtype) for _ in range(2))
    valid = torch.ones(batch, tokens, dtype=torch.bool)
    valid[0, :70] = False  # left padding covering the first block
    valid[2] = False
    allowed = valid[:, None, None, :] & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    mask = torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)  # [B, 1, T, T]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float().repeat_interleave(n_rep, 1), values.float().repeat_interleave(n_rep, 1),
        attn_mask=mask.float(), scale=0.25)
    folded = q.view(batch, kv_heads, n_rep, tokens, head_dim).transpose(2, 3).reshape(batch, kv_heads, -1, head_dim)
    masks = attention_masks(mask, n_rep, block)
    assert len(masks) == (3 if block else 1)
    with torch.no_grad():
        out = attention(Kernels(), folded, keys, values, masks, 0.25, tokens)
    out = out.view(batch, kv_heads, tokens, n_rep, head_dim).transpose(2, 3).reshape(q.shape)
    assert out.dtype == dtype and not out.isnan().any()
    real = valid[:, None, :, None].expand(q.shape)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float()[real], expected[real], **tolerance)


@pytest.mark.slow
def test_wide_batch_long_prompts_and_another_cache_length_match_eager(compiled_model, tiny_checkpoint, reference_model):
    """One llama export of its own shapes shows what the shared exports cannot:
    - a batch of 5, past the dot kernel's 4 rows: the layer projections and the untied LM head run through oneDNN on
      weights packed at load;
    - prompts left-padded into a context bucket of 1.75 attention blocks: the context graph's attention runs in a
      full block and a shorter one, one row's padding fills the first block, another spans both;
    - a graph name of the shared llama export (token_32) with another KV-cache length: without a fresh
      build directory per graph AOTInductor (keyed by the FX code, not shapes) silently reused the S=64 kernels."""
    import json

    from optimum_neuronx.backends import get_backend

    compiled_model("llama")  # the S=64 graphs first, in this process
    block = get_backend("inductor").kernels(torch.float32, batch_size=5).causal_block
    assert 0 < block <= 128  # the tiny models hold 256 positions
    bucket = block * 7 // 4
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), export=True, batch_size=5,
                                                   sequence_length=bucket + 32, context_buckets=[16, bucket],
                                                   token_buckets=[32, bucket + 32])
    stamp = json.loads((model.artifact_dir / "neuron_config.json").read_text())["versions"]["compiler"]
    if stamp["lowering"]["packed_rows"]:  # (a CPU without oneDNN's path runs the same graphs on plain weights)
        assert stamp["lowering"]["packed_rows"] == 5
        names = stamp["packable_weights"]
        assert len(names) == 2 * 4 + 1 and "lm_head.weight" in names and "embed_tokens.weight" not in names
        assert all(model._weights[name].is_mkldnn for name in names)
        assert not model._weights["embed_tokens.weight"].is_mkldnn
    reference = reference_model("llama")
    # short prompts: the 16-token context graph, then 45 new tokens across the 32 -> bucket + 32 token graphs
    input_ids, attention_mask = left_padded_prompts((3, 16, 7, 11, 1), seed=5)
    result = compare_generation(reference, model, input_ids, attention_mask, max_new_tokens=45, min_new_tokens=45)
    assert result.new_tokens == 45 and result.max_logit_diff < LOGIT_TOLERANCE and result.tokens_match, result
    # long prompts: the context graph of 1.75 blocks
    lengths = (bucket - block - 8, block + 20, bucket - 14, 40, 17)
    input_ids, attention_mask = left_padded_prompts(lengths, seed=2)
    result = compare_generation(reference, model, input_ids, attention_mask, max_new_tokens=20, min_new_tokens=20)
    assert result.max_logit_diff < LOGIT_TOLERANCE and result.tokens_match, result


@pytest.mark.slow
def test_sliding_window_caches_keep_what_their_windows_need(compiled_model):
    # (Their tokens and logits: test_greedy_batch_crosses_token_bucket[mistral|qwen2].) Every layer sliding: the cache
    # is a ring of the window's 12 slots; some layers: every slot for all layers.
    mistral, qwen2 = compiled_model("mistral"), compiled_model("qwen2")
    assert mistral._engine.cache.kv.shape[4] == 12 < mistral.neuron_config.sequence_length
    assert qwen2._engine.cache.kv.shape[4] == qwen2.neuron_config.sequence_length
    # past the window a ring cannot roll back: assisted decoding is refused
    input_ids, _ = left_padded_prompts((14,), seed=1)
    with pytest.raises(ValueError, match="Assisted decoding requires a cache that can be cropped"):
        mistral.generate(input_ids, prompt_lookup_num_tokens=3, max_new_tokens=4)
    handle = mistral._engine.handle  # the assisted generate's prompt: 14 tokens, 2 of them past the ring
    handle.crop(-1)  # one token back: its slot is rewritten by the next step
    with pytest.raises(ValueError, match=r"cannot roll the cache back from \d+ to \d+ tokens: .* only the last "
                                         r"12 \(its sliding window\)"):
        handle.crop(-2)


def test_dropping_a_model_frees_its_weights(saved_tiny_llama):
    # AOTInductor holds one reference to each user-managed constant that it never drops; unless the backend
    # releases them, every model loaded stays resident after it is gone.
    model = NeuronModelForCausalLM.from_pretrained(saved_tiny_llama)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    storages = [weakref.ref(t.untyped_storage()) for t in model._weights.values() if not t.is_mkldnn]
    assert storages and all(ref() is not None for ref in storages)
    del model
    gc.collect()
    assert [ref() for ref in storages] == [None] * len(storages)


def _compiled_kernel(fn, args, context=None):
    """fn's result and the source Inductor generated for it, compiled inside `context`, outside every cache."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with context or contextlib.nullcontext(), inductor_config.patch(force_disable_caches=True):
        out, code = run_and_get_code(torch.compile(fn), *args)
    return out, "\n".join(code)


def _matvec(w, v):
    return (w * v).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_projection_compiles_without_idle_cascade_helper(dtype):
    # Inputs wider than 4096 (the 1.1B shape's down projection) got a heap-allocating sum helper per row that
    # never cascades at this width; without it the kernel must compute the very same sums.
    from optimum_neuronx.backends.inductor.codegen import _vector_sums_without_idle_cascade

    args = torch.randn(64, 5632).to(dtype), torch.randn(5632).to(dtype)
    helped, helped_code = _compiled_kernel(_matvec, args)
    plain, plain_code = _compiled_kernel(_matvec, args, _vector_sums_without_idle_cascade())
    assert "CascadeSumHelper" in helped_code and "CascadeSumHelper" not in plain_code
    assert torch.equal(plain, helped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_streaming_loads_are_prefetched(dtype):
    # Decode's projections stream weight rows through a multiply + sum: the weight load gets one software
    # prefetch ROW_PREFETCH_BYTES ahead, the vector it is multiplied with (same elements every row) none, an
    # elementwise kernel none; the results do not change.
    from optimum_neuronx.backends.inductor.codegen import ROW_PREFETCH_BYTES, decode_codegen, row_prefetch_locality

    args = torch.randn(300, 640).to(dtype), torch.randn(640).to(dtype)
    plain, plain_code = _compiled_kernel(_matvec, args)
    fetched, fetched_code = _compiled_kernel(_matvec, args, decode_codegen())
    prefetches = [line.strip() for line in fetched_code.splitlines() if "__builtin_prefetch" in line]
    assert "__builtin_prefetch" not in plain_code
    # One line, on the weight (the first input), moving along the row (x1) and from row to row (640*x0).
    assert len(prefetches) == 1 and prefetches[0].startswith("__builtin_prefetch(in_ptr0 + ")
    ahead = ROW_PREFETCH_BYTES // dtype.itemsize
    assert "640" in prefetches[0] and prefetches[0].endswith(f" + {ahead}, 0, {row_prefetch_locality()});")
    assert torch.equal(fetched, plain)
    _, elementwise_code = _compiled_kernel(lambda w, v: w * v + 1, args, decode_codegen())
    assert "__builtin_prefetch" not in elementwise_code


def test_small_loops_run_on_one_thread():
    # A decode step's per-layer kernels (an RMSNorm of 4 rows of 576 at batch 4) split between threads cost an
    # OpenMP region each, more than the loop itself: under our options they run on one thread, a prefill-sized loop
    # is still split, and neither result changes.
    from torch._inductor import config as inductor_config

    from optimum_neuronx.backends.inductor.codegen import MIN_ELEMENTS_PER_THREAD, inductor_options

    def rms_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    weight = torch.randn(576)
    decode = torch.randn(4, 576), weight
    prefill = torch.randn(4 * MIN_ELEMENTS_PER_THREAD // 576, 576), weight  # 2 threads x 2 x the minimum
    with inductor_config.patch({"cpp.threads": 2}):  # as on 2 cores (on one, Inductor splits nothing)
        split, split_code = _compiled_kernel(rms_norm, decode)
        with inductor_config.patch(inductor_options()):
            alone, alone_code = _compiled_kernel(rms_norm, decode)
            large, large_code = _compiled_kernel(rms_norm, prefill)
    assert "omp parallel" in split_code and "omp parallel" not in alone_code
    assert "omp parallel" in large_code
    assert torch.equal(alone, split)
    torch.testing.assert_close(large, rms_norm(*prefill))
