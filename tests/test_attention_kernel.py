"""Our decode attention kernel inside AOTInductor graphs (decode_attention), against the same math in float64."""

import zipfile

import pytest
import torch

import kernel_packages

from optimum_neuronx.backends import get_backend
from optimum_neuronx.backends.inductor.backend import X86_FEATURE_PROBES, cpu_has
from optimum_neuronx.modeling.attention import additive_mask
from optimum_neuronx.backends.inductor.ops import decode_attention

BACKEND = get_backend("inductor")
DTYPES = [torch.bfloat16, torch.float32]
ISA_NEEDS = {"avx512_bf16": ["avx512"], "avx512": ["avx512"], "avx2": ["avx2"]}

# (batch, KV heads, query rows per KV head, head dim, window, new tokens, cache slots). SmolLM2's decode step (3
# query heads of 64 per KV head over a 192-slot window), a group of 8 (the 1.1B shape) over a window whose scores
# end in a tail past whole vectors (37 + 1), a head dim past whole vectors (80), two new tokens (6 rows), and a
# single sequence, head and key; and windows whose ends every row masks; a head dim of 128 with 5 rows (groups of 4
# and 1 in the bfloat16 rows' loops) and two new tokens, whose rows are not back to back.
CASES = [(4, 3, 3, 64, 192, 1, 256), (2, 4, 8, 64, 37, 1, 64), (3, 2, 6, 80, 50, 2, 64), (1, 1, 1, 16, 1, 1, 8),
         (3, 2, 3, 64, 100, 1, 128), (3, 2, 5, 128, 45, 2, 64)]
# Per case, each sequence's window slots [first, last) that its rows may see (left padding before, the bucket's
# unused slots after). Slots outside hold NaN: the kernel must not read them (a NaN key or value would poison
# every row's sum even at weight 0); the reference reads zeros there.
SEEN = {4: [(0, 61), (17, 100), (40, 45)]}


class _Attention(torch.nn.Module):
    def forward(self, cases):
        out = []
        for q, cache, cache_mask, new_kv, new_mask in cases:
            window = cache_mask.shape[-1]
            # the window as the decoder passes it, a strided view of the cache; the new tokens permuted as it
            # makes them
            new = new_kv.permute(0, 1, 3, 2, 4)
            out.append(decode_attention(q, cache[0, :, :, :window], cache[1, :, :, :window], cache_mask,
                                        new[0], new[1], new_mask))
        return out


def _cases(dtype):
    generator = torch.Generator().manual_seed(0)
    cases = []
    for index, (batch, heads, rows, d, window, fresh, slots) in enumerate(CASES):
        q = torch.randn(batch, heads, rows, d, generator=generator) * d**-0.5
        cache = torch.randn(2, batch, heads, slots, d, generator=generator).to(dtype)
        new_kv = torch.randn(2, batch, fresh, heads, d, generator=generator).to(dtype)
        cached = torch.rand(batch, 1, rows, window, generator=generator) < 0.8
        cached[0, :, :, :] = True
        if batch > 1:
            cached[1, :, :, :] = False  # a sequence with nothing cached (left padding): only its new tokens
        fresh_allowed = torch.ones(batch, 1, rows, fresh, dtype=torch.bool)
        if batch > 2:
            cached[2], fresh_allowed[2] = False, False  # a padding row: nothing at all, uniform weights
        for b, (first, last) in enumerate(SEEN.get(index, ())):
            cached[b, ..., :first] = cached[b, ..., last:] = False
            cached[b, ..., first] = cached[b, ..., last - 1] = True
            cache[:, b, :, :first] = cache[:, b, :, last:] = float("nan")
        cases.append((q, cache, additive_mask(cached, dtype), new_kv, additive_mask(fresh_allowed, dtype)))
    return cases


def _rounds_query(isa, case):
    # With avx512_bf16, bfloat16 rows of 64 or 128 are multiplied by vdpbf16ps against the query rounded to
    # bfloat16 (as Transformers' bfloat16 attention has it), for both parts.
    q, cache = case[:2]
    return isa == "avx512_bf16" and cache.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)


def _expected(case, round_query=False):
    # float64 of the same operands, rounded once to the keys' dtype
    q, cache, cache_mask, new_kv, new_mask = case
    if round_query:
        q = q.bfloat16()
    window = cache_mask.shape[-1]
    cache = cache.nan_to_num(0.0)
    keys = torch.cat((cache[0, :, :, :window], new_kv[0].transpose(1, 2)), dim=2).double()
    values = torch.cat((cache[1, :, :, :window], new_kv[1].transpose(1, 2)), dim=2).double()
    scores = q.double() @ keys.transpose(-1, -2) + torch.cat((cache_mask, new_mask), dim=-1).double()
    return (scores.softmax(-1) @ values).to(cache.dtype)


def _assert_close(out, expected):
    if out.dtype == torch.bfloat16:  # one bfloat16 rounding step apart at most
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _runs_here(isa):
    return all(cpu_has(feature) for feature in ISA_NEEDS[isa]) and bool(BACKEND.dot_kernel_isa(torch.float32))


kernel_packages.register("decode_attention", lambda isa, dtype: _runs_here(isa),
                         lambda dtype: (_Attention(), (_cases(dtype),)))


@pytest.fixture(scope="module", params=[(isa, dtype) for isa in ISA_NEEDS for dtype in DTYPES],
                ids=[f"{isa}-{name}" for isa in ISA_NEEDS for name in ("bf16", "fp32")])
def attention_package(request, tmp_path_factory):
    """This variant's graph, in the package shared with the other kernels' tests (kernel_packages.py)."""
    isa, dtype = request.param
    if not _runs_here(isa):
        pytest.skip(f"decode_attention's {isa} kernel needs {' and '.join(ISA_NEEDS[isa])} and GCC or Clang")
    part = kernel_packages.kernel_part("decode_attention", isa, dtype, lambda: tmp_path_factory.mktemp("kernels"))
    return part, isa


def test_kernel_matches_float64_attention(attention_package):
    part, isa = attention_package
    module, args = part.module, part.args
    outs = part.run()
    assert len(outs) == len(CASES)
    for out, case, eager in zip(outs, args[0], module(*args)):
        rounds_query = _rounds_query(isa, case)
        expected = _expected(case, rounds_query)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        _assert_close(out, expected)
        if rounds_query:  # measurably closer to the rounded query than to the exact one: not noise in the tolerance
            error = (out.double() - expected.double()).abs().mean()
            assert error < (out.double() - _expected(case).double()).abs().mean()
        if not case[1].isnan().any():  # (the eager definition reads every slot)
            _assert_close(eager, _expected(case))  # the op's eager definition: what other backends and export trace


def test_graph_calls_the_kernel_directly(attention_package):
    with zipfile.ZipFile(attention_package[0].path) as package:
        wrapper = next(package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_decode_attention(") == len(CASES) + 2  # definition, declaration, calls
    assert "proxy_executor_call_function" not in wrapper and "call_dispatcher" not in wrapper


def test_fake_kernel_names_bad_operands():
    with torch._subclasses.FakeTensorMode():
        q = torch.empty(2, 3, 3, 64)
        keys = torch.empty(2, 3, 10, 64, dtype=torch.bfloat16)
        new = torch.empty(2, 3, 1, 64, dtype=torch.bfloat16)
        mask = torch.empty(2, 1, 3, 10, dtype=torch.bfloat16)
        new_mask = torch.empty(2, 1, 3, 1, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"float32 query and bfloat16 or float32 keys; got torch.bfloat16"):
            decode_attention(q.bfloat16(), keys, keys, mask, new, new, new_mask)
        with pytest.raises(ValueError, match=r"cache_v \(2, 3, 9, 64\) torch.bfloat16 does not match"):
            decode_attention(q, keys, keys[:, :, :9], mask, new, new, new_mask)
        with pytest.raises(ValueError, match=r"new_mask must be \[2, 1, 3, 1\] torch.bfloat16; got \(2, 1, 3, 1\) "
                                             r"torch.float32"):
            decode_attention(q, keys, keys, mask, new, new, new_mask.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_decode_lowering_uses_the_attention_kernel_where_the_dot_kernel_builds(dtype, monkeypatch):
    if not BACKEND.dot_kernel_isa(dtype):
        pytest.skip(f"no {dtype} kernels on this machine")
    for batch in (1, 4):
        lowering = BACKEND.kernels(dtype, batch_size=batch)
        assert lowering.attention_kernel and lowering.dot_isa == BACKEND.dot_kernel_isa(dtype)
        assert set(ISA_NEEDS[lowering.dot_isa]) <= set(BACKEND.target(lowering, dtype).split())
    assert not BACKEND.kernels(torch.float16, batch_size=4).attention_kernel
    for probe in {X86_FEATURE_PROBES["avx512"], X86_FEATURE_PROBES["avx2"]}:
        monkeypatch.setattr(torch.cpu, probe, lambda: False)
    assert not BACKEND.kernels(dtype, batch_size=4).attention_kernel
