"""Compiler backends behind one small interface (see base.Backend)."""

from __future__ import annotations

import importlib

from ..configuration import SUPPORTED_BACKENDS, GraphSpec
from .base import Backend


def get_backend(name: str) -> Backend:
    if name not in SUPPORTED_BACKENDS:
        raise ValueError(f"Unknown backend {name!r}; supported backends: {', '.join(SUPPORTED_BACKENDS)}.")
    # Imported only when asked for: a backend's toolchain may be an optional extra.
    return importlib.import_module(f"{__package__}.{name}").BACKEND


__all__ = ["Backend", "GraphSpec", "SUPPORTED_BACKENDS", "get_backend"]
