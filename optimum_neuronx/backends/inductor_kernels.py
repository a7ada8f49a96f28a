"""Hand-written C++ kernels that AOTInductor compiles into our graphs, for the custom ops of modeling/ops.py.

AOTInductor calls a custom op either through the dispatcher (the op must then be registered in the process that
runs the graph, and every call pays for an IValue stack) or, when the op is listed in
`aot_inductor.custom_ops_to_c_shims`, as a plain C function `aoti_torch_cpu_<op>` that the graph's wrapper
declares from the strings given there. We give the function's whole source as that "declaration": it lands in the
wrapper's C++ file and is compiled with it, so every graph carries its kernel and loading one needs no extra
library, no op registration and no compiler.

The kernel sources live next to this file in kernels/; their digest is stamped into every export
(`kernel_digests`), so an edited kernel never reuses a cached compile.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..modeling import ops  # noqa: F401  (registers torch.ops.optimum_neuronx)
from .inductor_codegen import ROW_PREFETCH_BYTES

KERNELS_DIR = Path(__file__).with_name("kernels")
ROWS_MATVEC = "rows_matvec.cpp"
DECODE_ATTENTION = "decode_attention.cpp"  # spliced after rows_matvec.cpp, whose helpers it uses
# decode_attention's function is defined in that one source; its own entry only declares it.
DECODE_ATTENTION_DECLARATION = ('"C" AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle, AtenTensorHandle, '
                                "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
                                "AtenTensorHandle, AtenTensorHandle*)")
# tiled_linear's function (prefill over tiled weights) is defined in rows_matvec.cpp too.
TILED_LINEAR_DECLARATION = ('"C" AOTITorchError aoti_torch_cpu_tiled_linear(AtenTensorHandle, AtenTensorHandle, '
                            "AtenTensorHandle*, AtenTensorHandle*)")


def kernel_source(name: str) -> str:
    return (KERNELS_DIR / name).read_text()


def kernel_digests() -> dict:
    return {name: hashlib.sha256(kernel_source(name).encode()).hexdigest()[:16]
            for name in (ROWS_MATVEC, DECODE_ATTENTION)}


@dataclass(frozen=True)
class CpuTuned:
    """A kernel constant that depends on the CPU: its value per (vendor, family) where measured, else `default`."""

    per_cpu: dict[tuple[str, int], int]
    default: int


# __builtin_prefetch's locality for weights streamed against one row of input (rows_matvec at one row of x, and
# Inductor's multiply + sum, inductor_codegen.py), per CPU (vendor, family) where measured, else the default: 0,
# non-temporal. Weights are read once per decode step and should push nothing else out of the caches: on the AMD
# hosts (t0, Zen 3-5) the 1.1B shape's bf16 token graph ran 9% faster than with 3. On an Intel Xeon (family 6,
# model 207, 2 vCPUs) non-temporal prefetches held a stream from memory to ~11 GB/s where 1, 2 and 3 read 27-30
# GB/s, both dtypes (C harness, 1 GiB of weights, 2 threads), and the 1.1B shape's batch-1 token steps ran 1.5x
# (bf16) and 2.5x (fp32) faster with 1 (docs/performance.md, "An Intel Xeon host").
ROW_PREFETCH_LOCALITY = CpuTuned({("GenuineIntel", 6): 1}, default=0)
# The same for several rows of x per pass, where measured, else the default: 1 (into L2). Zen 4 (AVX-512):
# its slower loop at several rows lost non-temporal lines before it reached them; into L2 streamed SmolLM2's
# projections 1.1-1.3x faster (C harness). Zen 5 (AMD family 26): the other way round, non-temporal streamed 4 rows
# of the 1.1B shape's and SmolLM2's projections 1.06-1.13x faster (C harness, both dtypes) and ran batch-4 token
# steps 1.07x (1.1B shape fp32), 1.10x (SmolLM2 fp32) and 1.13x (1.1B shape bf16) faster (docs/performance.md).
# The Intel Xeon above keeps the default: 2 streamed 4 rows of 2048 1.03-1.12x faster than 1 in the C harness (3
# rounds), but batch-4 token steps with either, in processes taking turns, could not be told apart (0.87-1.21x).
ROWS_PREFETCH_LOCALITY = CpuTuned({("AuthenticAMD", 26): 0}, default=1)
# float32 at several rows of x on AVX-512, per CPU where measured, else the default: 0, blocks of 4 weight rows with
# x's rows whole; > 0, one weight row at a time with x in pieces of at most that many bytes (all rows together). Zen 4
# (AMD family 25; its AVX-512 CPUs): the 1.1B shape's projections at 4 rows streamed ~1.09x faster in pieces of 16
# KiB (C harness, 2 threads, fast memory phases; 24 KiB 1.05x, 32 KiB 0.7x), SmolLM2's within noise
# (docs/performance.md, "Float32 at 4 rows on Zen 4").
FLOAT32_ROWS_PIECE_BYTES = CpuTuned({("AuthenticAMD", 25): 16384}, default=0)
# The same for bfloat16 through avx512_bf16's dot products, at several rows of x longer than 24 KiB (shorter ones take
# one weight row at a time, whole, either way). Zen 4: 24576. There the 1.1B shape's down projection at 4 rows (5632
# inputs, 45 KiB of x, more than L1) streamed at 0.61x a plain read of its weights in blocks in fast memory phases,
# in 2 pieces of 22 KiB 1.36x faster (pieces of 16 or 20 KiB: less), and the 4-row projections of a whole step
# 1.12x faster (C harness, 2 threads; slow phases ~1.0x). Zen 5 keeps blocks: there they were 1.04-1.15x faster
# than pieces of 24 KiB (docs/performance.md).
BFLOAT16_ROWS_PIECE_BYTES = CpuTuned({("AuthenticAMD", 25): 24576}, default=0)
# float32 at one row of x on AVX-512, per CPU where measured, else the default: 0, one weight row at a time; > 0, a row
# of x longer than that many bytes in blocks of 4 weight rows, the next block prefetched with ROWS_PREFETCH_LOCALITY's
# hint. Zen 4 (AMD family 25): 16384 (half of its L1, as FLOAT32_ROWS_PIECE_BYTES). There the 1.1B shape's down
# projection (5632 inputs, 22 KiB of x) one weight row at a time streamed at 0.70x a plain read of its weights in fast
# memory phases, in blocks 1.39x faster, near the plain read (C harness, 2 threads); its rows of 2048 inputs (8 KiB)
# gained 1.05x in blocks against 1.08x one at a time without prefetch and x out of order (below), SmolLM2's (576 and
# 1536 inputs) lost 0.75x in blocks (docs/performance.md, "Long float32 rows in blocks").
FLOAT32_ROW_BLOCK_BYTES = CpuTuned({("AuthenticAMD", 25): 16384}, default=0)
# Whether rows_matvec on AVX-512 prefetches the weights when it takes them one row at a time against one whole row
# of x (both dtypes), per CPU where measured, else the default: 1, with ROW_PREFETCH_LOCALITY's hint. Zen 4 (AMD
# family 25): 0, its hardware prefetchers alone. In fast memory phases the bfloat16 kernel without its prefetch
# streamed the 1.1B shape's weights 1.06-1.10x faster than with it (C harness, 2 threads; SmolLM2's shapes 1.12x, slow
# phases ~1.0x) and ran token steps 1.04x (1.1B shape) and 1.05x (SmolLM2) faster, exports taking turns in one
# process; with x out of order (ROW_SWIZZLED_X) the prefetch still costs (0.90x, SmolLM2's shapes 0.96x). float32 rows
# of at most 16 KiB without it and with x out of order streamed 1.06-1.08x faster than with it and in order (fast
# phases; 0.98-1.04x slow) (docs/performance.md).
ROW_PREFETCH = CpuTuned({("AuthenticAMD", 25): 0}, default=1)
# The dtypes for which rows_matvec on AVX-512 keeps one row of x with its 64-byte lines out of order (x_line_slot in
# rows_matvec.cpp): 1 float32, 2 bfloat16, 3 both; per CPU where measured, else the default: 0, in order. Zen 4 (AMD
# family 25): 3. There bfloat16 x read in order beside the weights held the stream at ~0.88x a plain read of the
# weights in fast memory phases; out of order the kernel streamed the 1.1B shape's projections 1.13-1.17x and
# SmolLM2's 1.12-1.19x faster (two runs), as fast as the plain read (C harness, 2 threads; slow phases 1.03-1.04x)
# (docs/performance.md, "x's lines out of order"); float32: see ROW_PREFETCH. Zen 5 (AMD family 26): 2, bfloat16 only,
# the prefetch kept. There the 1.1B shape's bfloat16 projections at one row streamed 1.03x faster with the CPUs apart
# (0.965x a plain read against 0.936x; 1.00x near) and its batch-1 token graph ran 1.018x and 1.026x faster apart
# (0.995x near), exports taking turns in one process (without the prefetch too: 0.89x); float32 (the 1.1B shape's and
# SmolLM2's shapes) 0.97x, SmolLM2's bfloat16 shapes 0.98x (C harness) (docs/performance.md, "Back on Zen 5").
ROW_SWIZZLED_X = CpuTuned({("AuthenticAMD", 25): 3, ("AuthenticAMD", 26): 2}, default=0)

# kernel_tuning's entries, by the names exports stamp them under (and c_shim_options compiles them in under).
KERNEL_TUNING = {"row_prefetch_locality": ROW_PREFETCH_LOCALITY, "rows_prefetch_locality": ROWS_PREFETCH_LOCALITY,
                 "float32_rows_piece_bytes": FLOAT32_ROWS_PIECE_BYTES,
                 "bfloat16_rows_piece_bytes": BFLOAT16_ROWS_PIECE_BYTES,
                 "float32_row_block_bytes": FLOAT32_ROW_BLOCK_BYTES, "row_prefetch": ROW_PREFETCH,
                 "row_swizzled_x": ROW_SWIZZLED_X}


@functools.lru_cache(maxsize=None)
def cpu_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's `name: value` fields of /proc/cpuinfo; {} where it cannot be read."""
    fields = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            name, sep, value = line.partition(":")
            if not sep:
                break  # end of the first processor's block
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, int]:
    """(vendor, family) of this x86 CPU from /proc/cpuinfo; ("", -1) where it cannot be read."""
    fields = cpu_fields(cpuinfo)
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else -1


def kernel_tuning() -> dict:
    """The kernels' CPU-dependent constants; stamped into exports next to the kernels' digests."""
    identity = cpu_identity()
    return {name: tuned.per_cpu.get(identity, tuned.default) for name, tuned in KERNEL_TUNING.items()}


# The instruction sets rows_matvec.cpp has a variant for, best first: per dtype, what a CPU needs to run it (x86
# feature names of backends/inductor.py). "avx512_bf16": bfloat16 through avx512_bf16's dot products; "avx512":
# float32, and bfloat16 widened to float32 on AVX-512 CPUs without them.
DOT_KERNEL_ISAS = {
    "avx512_bf16": {torch.bfloat16: ("avx512", "avx512_bf16")},
    "avx512": {torch.bfloat16: ("avx512",), torch.float32: ("avx512",)},
    "avx2": {torch.bfloat16: ("avx2",), torch.float32: ("avx2",)},
}


def c_shim_options(dot_rows: int, isa: str, attention: bool = False, piece_bytes: int = -1,
                   chunk_bytes: int = 0) -> dict:
    """Inductor options that compile our kernels' variant for `isa` (a DOT_KERNEL_ISAS key) into the graph:
    `rows_matvec` (when the lowering uses it, dot_rows > 0) and, with `attention`, `decode_attention`.
    `piece_bytes` >= 0 overrides the variant's piece size of the input rows (0: whole rows); the tests use it to
    run the pieces' partial sums on a CPU whose variant takes rows whole. `chunk_bytes` > 0 overrides the size of the
    chunks of weight rows the threads take (rounded down to whole blocks, at least one); the tests use it to cut
    many chunks from small weights."""
    if not dot_rows and not attention:
        return {}
    if isa not in DOT_KERNEL_ISAS:
        raise ValueError(f"our kernels have no {isa!r} variant; they have {sorted(DOT_KERNEL_ISAS)}.")
    # Inductor writes each string as `extern <string>;` inside an `extern "C" { ... }` block: `extern "C++" { ... }`
    # gives the source its own linkage block, in which the shim functions declare themselves extern "C".
    defines = {"OPTIMUM_NEURONX_ROW_PREFETCH_BYTES": ROW_PREFETCH_BYTES,
               "OPTIMUM_NEURONX_DOT_AVX512": int(isa.startswith("avx512")),
               "OPTIMUM_NEURONX_DOT_BF16_NATIVE": int(isa == "avx512_bf16"),
               "OPTIMUM_NEURONX_DOT_PIECE_BYTES": piece_bytes,
               "OPTIMUM_NEURONX_DOT_CHUNK_BYTES": chunk_bytes}
    # Each kernel_tuning entry is compiled in under its own name: "row_prefetch_locality" ->
    # OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY.
    defines.update({f"OPTIMUM_NEURONX_{name.upper()}": value for name, value in kernel_tuning().items()})
    names = (ROWS_MATVEC, DECODE_ATTENTION) if attention else (ROWS_MATVEC,)
    source = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    source += "".join(kernel_source(name) for name in names)
    source = '"C++" {\n' + source + "".join(f"\n#undef {name}" for name in defines) + "\n}"
    shims = {torch.ops.optimum_neuronx.rows_matvec.default: [source],
             torch.ops.optimum_neuronx.tiled_linear.default: [TILED_LINEAR_DECLARATION]}
    if attention:
        shims[torch.ops.optimum_neuronx.decode_attention.default] = [DECODE_ATTENTION_DECLARATION]
    return {"aot_inductor.custom_ops_to_c_shims": shims}
