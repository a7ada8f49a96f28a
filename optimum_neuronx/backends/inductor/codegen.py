"""Changes to the C++ kernels Inductor writes, applied while our graphs compile.

Decode at batch 1 runs every projection as one vectorized multiply + sum per weight row, so the speed of
those loops is the speed of decode. Around them, a decode step runs a few small kernels per layer (norms, rotary
embedding, residual adds) over a few thousand elements. No change touches the arithmetic: the kernels compute
the same sums in the same order, bit for bit. The options they take are stamped into every export
(`codegen_options`), so a compile cache entry made without them is never reused.

`decode_codegen()` is also what the benchmark compiles its bandwidth probe under, so the roofline is measured
with the very loop decode runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, Optional

from .tuning import ROW_PREFETCH_BYTES, kernel_tuning

logger = logging.getLogger(__name__)

# Inductor's C++ sums over more than this many elements accumulate through a CascadeSumHelper, which starts
# a new partial sum every CASCADE_CHUNK vector iterations (pairwise summation, for precision).
CASCADE_CHUNK = 4096
# The fewest elements per thread for which Inductor splits a loop between threads (its cpp.min_chunk_size, 512 by
# default): a split of a loop of a microsecond costs more in OpenMP than it saves.
MIN_ELEMENTS_PER_THREAD = 8192


def codegen_options() -> dict:
    return {"plain_vector_sums_up_to": CASCADE_CHUNK, "row_prefetch_bytes": ROW_PREFETCH_BYTES,
            "row_prefetch_locality": row_prefetch_locality(), "min_elements_per_thread": MIN_ELEMENTS_PER_THREAD}


def row_prefetch_locality() -> int:
    """The prefetch hint for weight rows streamed one row of input at a time (this CPU's, tuning.py)."""
    return kernel_tuning()["row_prefetch_locality"]


def inductor_options() -> dict:
    """The Inductor config options our graphs compile with (a user's compiler_args override them)."""
    return {"cpp.min_chunk_size": MIN_ELEMENTS_PER_THREAD}


@contextlib.contextmanager
def decode_codegen() -> Iterator[None]:
    with _vector_sums_without_idle_cascade(), _row_streams_prefetched():
        yield


@contextlib.contextmanager
def _vector_sums_without_idle_cascade() -> Iterator[None]:
    """Compile vectorized sums of at most CASCADE_CHUNK vectors with a plain accumulator.

    Such a sum never reaches a second chunk, so its CascadeSumHelper only adds one heap allocation per output
    element (two vectors allocated and freed per row of a projection wider than 4096 inputs). Longer sums keep
    their helper.
    """
    from torch._inductor.codegen import cpp

    original = getattr(cpp.CppKernel, "need_use_acc_helper", None)
    if original is None or not hasattr(cpp, "CppVecKernel"):
        yield
        return

    def need_use_acc_helper(kernel, reduction_type, dtype, use_scalar):
        if reduction_type == "sum" and not use_scalar and isinstance(kernel, cpp.CppVecKernel):
            size = math.prod(kernel.call_ranges[kernel.reduction_depth:])
            if getattr(size, "is_number", True) and int(size) <= CASCADE_CHUNK * kernel.tiling_factor:
                return False
        return original(kernel, reduction_type, dtype, use_scalar)

    cpp.CppKernel.need_use_acc_helper = need_use_acc_helper
    try:
        yield
    finally:
        cpp.CppKernel.need_use_acc_helper = original


@contextlib.contextmanager
def _row_streams_prefetched() -> Iterator[None]:
    """Prefetch ROW_PREFETCH_BYTES ahead in every vector load that streams rows through a reduction.

    A bf16 row's inner loop spends about a dozen instructions (two loads, four bf16 -> float conversions, the
    multiply-adds) on each 64-byte line, so the out-of-order window holds only a few dozen lines: too few
    misses in flight to keep memory busy once the host's bandwidth is high, whatever the hardware prefetcher
    does. One prefetch per line, a few rows ahead, keeps more in flight. The loads it applies to are those whose address moves with both the
    reduction (stride 1) and an outer loop, i.e. one row after another of a matrix; the vector the rows are
    multiplied with (same elements for every row) is not prefetched. A prefetch never faults, so reaching past
    the last row is harmless.
    """
    from torch._inductor import cpp_builder
    from torch._inductor.codegen import cpp

    original = getattr(getattr(cpp, "CppVecKernel", None), "load", None)
    # __builtin_prefetch is GCC's and Clang's (any architecture); other compilers get the plain loads.
    if original is None or not (cpp_builder.is_gcc() or cpp_builder.is_clang()):
        yield
        return

    def load(kernel, name, index):
        try:
            line = _prefetch_line(kernel, name, index)
        except Exception:  # a hint must never break a compile: Inductor internals differ between releases
            logger.debug("no prefetch for %s[%s]", name, index, exc_info=True)
            line = None
        emitted = kernel.__dict__.setdefault("_optimum_neuronx_prefetches", set())
        if line and line not in emitted:
            emitted.add(line)
            kernel.loads.writeline(line)
        return original(kernel, name, index)

    cpp.CppVecKernel.load = load
    try:
        yield
    finally:
        cpp.CppVecKernel.load = original


def _prefetch_line(kernel, name: str, index) -> Optional[str]:
    from torch._inductor.codegen.cpp_utils import cexpr_index
    from torch._inductor.virtualized import V

    depth = kernel.reduction_depth
    if depth is None or kernel.tiling_idx < depth:  # not a reduction, or vectorized across rows
        return None
    index = kernel.rename_indexing(index)
    if not any(var in index.free_symbols for var in kernel.itervars[:depth]):  # same elements for every row
        return None
    if kernel._try_get_const_stride(index, kernel.itervars[kernel.tiling_idx]) != 1:
        return None
    ahead = ROW_PREFETCH_BYTES // V.graph.get_dtype(name).itemsize
    address = f"{kernel.args.input(name)} + {cexpr_index(index)} + {ahead}"
    return f"__builtin_prefetch({address}, 0, {row_prefetch_locality()});"
