"""Our C++ kernels, which AOTInductor compiles into the graphs, for the custom ops of ops.py.

AOTInductor calls a custom op either through the dispatcher (the op must then be registered in the process that
runs the graph, and every call pays for an IValue stack) or, when the op is listed in
`aot_inductor.custom_ops_to_c_shims`, as a plain C function `aoti_torch_cpu_<op>` that the graph's wrapper
declares from the strings given there. We give the function's whole source as that "declaration": it lands in the
wrapper's C++ file and is compiled with it, so every graph carries its kernel and loading one needs no extra
library, no op registration and no compiler.

The kernel sources live next to this file in kernels/ (common.h: what the kernels share; harness.cpp times the dot
kernel alone, tools/kernel_harness.py); their digest is stamped into every export (`kernel_digests`), so an edited
kernel never reuses a cached compile.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from . import ops  # noqa: F401  (registers torch.ops.optimum_neuronx)
from .tuning import ROW_PREFETCH_BYTES, kernel_tuning

KERNELS_DIR = Path(__file__).with_name("kernels")
COMMON = "common.h"  # included by every kernel; spliced once in front of them
ROWS_MATVEC = "rows_matvec.cpp"
DECODE_ATTENTION = "decode_attention.cpp"
INT8_MATVEC = "int8_matvec.cpp"
# decode_attention's function is defined in that one source; its own entry only declares it.
DECODE_ATTENTION_DECLARATION = ('"C" AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle, AtenTensorHandle, '
                                "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
                                "AtenTensorHandle, AtenTensorHandle*)")
# tiled_linear's function (prefill over tiled weights) is defined in rows_matvec.cpp too.
TILED_LINEAR_DECLARATION = ('"C" AOTITorchError aoti_torch_cpu_tiled_linear(AtenTensorHandle, AtenTensorHandle, '
                            "AtenTensorHandle*, AtenTensorHandle*)")


# int8_matvec's function (int8 weights) is defined in int8_matvec.cpp, spliced after the others.
INT8_MATVEC_DECLARATION = ('"C" AOTITorchError aoti_torch_cpu_int8_matvec(AtenTensorHandle, AtenTensorHandle, '
                           "AtenTensorHandle, AtenTensorHandle*)")


_LOCAL_PART = re.compile(r'^#include "(rows_matvec_\w+\.h)"\n', re.MULTILINE)


def kernel_source(name: str) -> str:
    """A kernel's text with its parts (`#include "rows_matvec_*.h"`) spliced in where it includes them."""
    return _LOCAL_PART.sub(lambda match: kernel_source(match.group(1)), (KERNELS_DIR / name).read_text())


def spliced_source(names: tuple[str, ...]) -> str:
    """common.h, then each kernel without its own `#include "common.h"`: one translation unit for the wrapper."""
    include = f'#include "{COMMON}"'
    return kernel_source(COMMON) + "".join(
        "".join(line for line in kernel_source(name).splitlines(keepends=True) if line.strip() != include)
        for name in names)


def kernel_digests() -> dict:
    return {name: hashlib.sha256(kernel_source(name).encode()).hexdigest()[:16]
            for name in (COMMON, ROWS_MATVEC, DECODE_ATTENTION, INT8_MATVEC)}


# The instruction sets rows_matvec.cpp has a variant for, best first: per dtype, what a CPU needs to run it (x86
# feature names of backend.py). "avx512_bf16": bfloat16 through avx512_bf16's dot products; "avx512":
# float32, and bfloat16 widened to float32 on AVX-512 CPUs without them.
DOT_KERNEL_ISAS = {
    "avx512_bf16": {torch.bfloat16: ("avx512", "avx512_bf16")},
    "avx512": {torch.bfloat16: ("avx512",), torch.float32: ("avx512",)},
    "avx2": {torch.bfloat16: ("avx2",), torch.float32: ("avx2",)},
}


def kernel_defines(isa: str, piece_bytes: int = -1, chunk_bytes: int = 0, tuning_overrides: dict | None = None) -> dict:
    """The macros our kernels are compiled with for the variant `isa` (a DOT_KERNEL_ISAS key) on this CPU: the
    variant, this CPU's tuning-table constants (`tuning_overrides` replaces some), and the test overrides below."""
    if isa not in DOT_KERNEL_ISAS:
        raise ValueError(f"our kernels have no {isa!r} variant; they have {sorted(DOT_KERNEL_ISAS)}.")
    tuning = kernel_tuning()
    unknown = set(tuning_overrides or {}) - set(tuning)
    if unknown:
        raise ValueError(f"unknown tuning constants {sorted(unknown)}; the kernels take {sorted(tuning)}.")
    tuning.update(tuning_overrides or {})
    defines = {"OPTIMUM_NEURONX_ROW_PREFETCH_BYTES": ROW_PREFETCH_BYTES,
               "OPTIMUM_NEURONX_DOT_AVX512": int(isa.startswith("avx512")),
               "OPTIMUM_NEURONX_DOT_BF16_NATIVE": int(isa == "avx512_bf16"),
               "OPTIMUM_NEURONX_DOT_PIECE_BYTES": piece_bytes,
               "OPTIMUM_NEURONX_DOT_CHUNK_BYTES": chunk_bytes}
    # Each tuning constant under its own name: "row_prefetch_locality" -> OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY.
    defines.update({f"OPTIMUM_NEURONX_{name.upper()}": value for name, value in tuning.items()})
    return defines


def c_shim_options(dot_rows: int, isa: str, attention: bool = False, piece_bytes: int = -1,
                   chunk_bytes: int = 0, int8: bool = False) -> dict:
    """Inductor options that compile our kernels' variant for `isa` (a DOT_KERNEL_ISAS key) into the graph:
    `rows_matvec` (when the lowering uses it, dot_rows > 0) and, with `attention`, `decode_attention`.
    `piece_bytes` >= 0 overrides the variant's piece size of the input rows (0: whole rows); the tests use it to
    run the pieces' partial sums on a CPU whose variant takes rows whole. `chunk_bytes` > 0 overrides the size of the
    chunks of weight rows the threads take (rounded down to whole blocks, at least one); the tests use it to cut
    many chunks from small weights. `int8`: `int8_matvec` too (int8 weights)."""
    if not dot_rows and not attention:
        return {}
    defines = kernel_defines(isa, piece_bytes, chunk_bytes)
    # Inductor writes each string as `extern <string>;` inside an `extern "C" { ... }` block: `extern "C++" { ... }`
    # gives the source its own linkage block, in which the shim functions declare themselves extern "C".
    names = (ROWS_MATVEC, DECODE_ATTENTION) if attention else (ROWS_MATVEC,)
    if int8:
        names += (INT8_MATVEC,)
    source = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    source += spliced_source(names)
    source = '"C++" {\n' + source + "".join(f"\n#undef {name}" for name in defines) + "\n}"
    shims = {torch.ops.optimum_neuronx.rows_matvec.default: [source],
             torch.ops.optimum_neuronx.tiled_linear.default: [TILED_LINEAR_DECLARATION]}
    if attention:
        shims[torch.ops.optimum_neuronx.decode_attention.default] = [DECODE_ATTENTION_DECLARATION]
    if int8:
        shims[torch.ops.optimum_neuronx.int8_matvec.default] = [INT8_MATVEC_DECLARATION]
    return {"aot_inductor.custom_ops_to_c_shims": shims}
