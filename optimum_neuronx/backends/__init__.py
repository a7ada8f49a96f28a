"""Compiler backends behind one small interface (see base.Backend)."""

from __future__ import annotations

import importlib

from .base import Backend, GraphSpec

# name -> module; imported only when asked for (the neuron toolchain is an optional extra).
_BACKEND_MODULES = {"inductor": "inductor"}
SUPPORTED_BACKENDS = tuple(_BACKEND_MODULES)


def get_backend(name: str) -> Backend:
    module = _BACKEND_MODULES.get(name)
    if module is None:
        raise ValueError(f"Unknown backend {name!r}; supported backends: {', '.join(SUPPORTED_BACKENDS)}.")
    return importlib.import_module(f"{__package__}.{module}").BACKEND


__all__ = ["Backend", "GraphSpec", "SUPPORTED_BACKENDS", "get_backend"]
