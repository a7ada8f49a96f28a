"""The inductor backend: torch.export + AOTInductor for the CPU, with our own C++ kernels compiled into the graphs.

backend.py         InductorBackend: compile, load, the CPU target an export needs
lowering.py        Lowering: the decoder's projections and attention as this backend computes them
ops.py             the custom ops our kernels implement (eager definitions for tracing and reference)
custom_kernels.py  the kernels' C++ sources (kernels/*.cpp) spliced into the graphs as C shims
codegen.py         two changes to the C++ Inductor writes for decode
tuning.py          per-CPU constants, from the table kernels/tuning.json
build.py           a graph's object files compiled side by side
"""

from .backend import BACKEND, InductorBackend

__all__ = ["BACKEND", "InductorBackend"]
