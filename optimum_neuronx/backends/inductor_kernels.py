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

import hashlib
from pathlib import Path

import torch

from ..modeling import ops  # noqa: F401  (registers torch.ops.optimum_neuronx)
from .inductor_codegen import ROW_PREFETCH_BYTES

KERNELS_DIR = Path(__file__).with_name("kernels")
ROWS_MATVEC = "rows_matvec.cpp"


def kernel_source(name: str) -> str:
    return (KERNELS_DIR / name).read_text()


def kernel_digests() -> dict:
    return {name: hashlib.sha256(kernel_source(name).encode()).hexdigest()[:16] for name in (ROWS_MATVEC,)}


# The instruction sets rows_matvec.cpp has a variant for, best first: per dtype, what a CPU needs to run it (x86
# feature names of backends/inductor.py). bfloat16 on AVX-512 without avx512_bf16 takes the AVX2 variant.
DOT_KERNEL_ISAS = {
    "avx512": {torch.bfloat16: ("avx512", "avx512_bf16"), torch.float32: ("avx512",)},
    "avx2": {torch.bfloat16: ("avx2",), torch.float32: ("avx2",)},
}


def c_shim_options(dot_rows: int, isa: str) -> dict:
    """Inductor options that compile `rows_matvec`'s variant for `isa` (a DOT_KERNEL_ISAS key) into the graph (when
    the lowering uses it)."""
    if not dot_rows:
        return {}
    if isa not in DOT_KERNEL_ISAS:
        raise ValueError(f"rows_matvec has no {isa!r} variant; it has {sorted(DOT_KERNEL_ISAS)}.")
    # Inductor writes each string as `extern <string>;` inside an `extern "C" { ... }` block: `extern "C++" { ... }`
    # gives the source its own linkage block, in which the shim function declares itself extern "C".
    defines = {"OPTIMUM_NEURONX_ROW_PREFETCH_BYTES": ROW_PREFETCH_BYTES, "OPTIMUM_NEURONX_DOT_AVX512": int(isa == "avx512")}
    source = "".join(f"#define {name} {value}\n" for name, value in defines.items()) + kernel_source(ROWS_MATVEC)
    source = '"C++" {\n' + source + "".join(f"\n#undef {name}" for name in defines) + "\n}"
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.optimum_neuronx.rows_matvec.default: [source]}}
