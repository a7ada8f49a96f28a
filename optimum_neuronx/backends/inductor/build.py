"""The order in which AOTInductor runs the C++ compiler for our graphs.

A graph's package is three object files linked together: the wrapper (the graph's entry point: input checks,
buffer allocation, one call per kernel), the kernels, and the constants' table. AOTInductor runs the compiler for
each in turn; they do not depend on each other, so `objects_compiled_together` lets them run at the same time and
only the link waits.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

# A graph's C++ sources: the wrapper and the kernels (the constants' table is assembly, built in order).
MAX_OBJECTS_AT_ONCE = 2


@contextlib.contextmanager
def objects_compiled_together() -> Iterator[None]:
    """Compile each C++ source into its object file (.o) in a thread of its own, and run every other build (a
    precompiled header, the constants' table, the link) only once the compiles before it are done. A failed compile
    raises at that next build, or on leaving the context."""
    from torch._inductor import cpp_builder

    builder = getattr(cpp_builder, "CppBuilder", None)
    original = getattr(builder, "build", None)
    if original is None:  # Inductor internals differ between releases: keep its own order
        yield
        return
    pending: list[Future] = []

    def finish_pending() -> None:
        done, pending[:] = list(pending), []
        for future in done:  # each waited for; the first failure raised
            future.result()

    with ThreadPoolExecutor(MAX_OBJECTS_AT_ONCE, thread_name_prefix="optimum-neuronx-cxx") as pool:

        def build(self) -> None:
            if compiles_cpp_to_object(self):
                pending.append(pool.submit(original, self))
                return
            finish_pending()
            original(self)

        builder.build = build
        try:
            yield
            finish_pending()
        finally:
            builder.build = original  # the pool's exit waits for any compile still running


def compiles_cpp_to_object(builder) -> bool:
    """Whether an Inductor CppBuilder compiles C++ sources into an object file, which nothing reads before the link
    (the constants' table, an assembler source, is read back and patched right after its build)."""
    sources = str(getattr(builder, "_sources_args", "")).split()
    return bool(getattr(builder, "_compile_only", False) and sources) and all(s.endswith(".cpp") for s in sources)
