"""Run a StableHLO graph through PJRT (jaxlib): compile it for a device, feed it torch tensors, keep the KV cache on
the device between calls (its buffer is donated each call and the new one returned), serialize the executable so
that a reload does not compile.

Here the device is the XLA CPU client that jaxlib ships; on Inf2 / Trn1 / Trn2 / Trn3 it would be the Neuron PJRT
plugin (libneuronxla), which no machine here has.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from .stablehlo import StableHLOGraph


def cpu_client():
    """jaxlib's PJRT client for the XLA CPU device."""
    from jax._src import xla_bridge

    return xla_bridge.get_backend("cpu")


def _x64():
    # 64-bit integer inputs (token ids, positions) stay 64-bit on the device, without changing jax's global setting.
    import jax

    return jax.enable_x64(True) if hasattr(jax, "enable_x64") else contextlib.nullcontext()


def _first_device(client):
    from jax._src.lib import xla_client

    return xla_client.DeviceList(tuple(client.devices()[:1]))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array) -> torch.Tensor:
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


class PjrtGraph:
    """One lowered graph, compiled for one PJRT device."""

    def __init__(self, graph: StableHLOGraph, executable, client):
        self.graph, self.executable, self.client = graph, executable, client
        self.device = client.devices()[0]

    @classmethod
    def compile(cls, graph: StableHLOGraph, client=None) -> "PjrtGraph":
        from jax._src.lib import xla_client

        client = client or cpu_client()
        return cls(graph, client.compile_and_load(graph.text, _first_device(client), xla_client.CompileOptions()),
                   client)

    def serialize(self) -> bytes:
        return self.client.serialize_executable(self.executable)

    @classmethod
    def deserialize(cls, graph: StableHLOGraph, blob: bytes, client=None) -> "PjrtGraph":
        from jax._src.lib import xla_client

        client = client or cpu_client()
        return cls(graph, client.deserialize_executable(blob, _first_device(client), xla_client.CompileOptions()),
                   client)

    def put(self, tensor: torch.Tensor):
        """`tensor` as a buffer on this graph's device."""
        import jax

        with _x64():
            return jax.device_put(to_numpy(tensor), self.device)

    def __call__(self, arguments: Sequence) -> list:
        """Run with one device buffer (or torch tensor) per argument, in `graph.arguments` order; returns the output
        buffers in `graph.outputs` order. Donated arguments (the cache) are consumed: pass the returned one next."""
        if len(arguments) != len(self.graph.arguments):
            raise ValueError(f"graph {self.graph.name} takes {len(self.graph.arguments)} arguments, got {len(arguments)}")
        buffers = [self.put(a) if isinstance(a, torch.Tensor) else a for a in arguments]
        return self.executable.execute(buffers)
