"""Run a StableHLO graph through PJRT (jaxlib): compile it for one device or, partitioned by XLA SPMD, for several;
feed it torch tensors; keep the KV cache on the device(s) between calls (its buffer is donated each call and the new
one returned); serialize the executable so that a reload does not compile.

The device is the Neuron PJRT plugin's (libneuronxla: Inf2 / Trn1 / Trn2 / Trn3) where it is installed, else the XLA
CPU device that jaxlib ships. `XLA_FLAGS=--xla_force_host_platform_device_count=N` gives the CPU client N devices,
which is how tensor-parallel graphs run on one machine without Neuron devices.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence

import numpy as np
import torch

from .stablehlo import StableHLOGraph

logger = logging.getLogger(__name__)

NEURON_PLATFORM = "neuron"


def cpu_client():
    """jaxlib's PJRT client for the XLA CPU device."""
    from jax.extend.backend import get_backend

    return get_backend("cpu")


def neuron_client():
    """The Neuron PJRT plugin's client, or None where the plugin (libneuronxla) is not installed or finds no device."""
    import importlib.util

    if importlib.util.find_spec("libneuronxla") is None:
        return None
    from jax.extend.backend import get_backend

    try:
        return get_backend(NEURON_PLATFORM)
    except RuntimeError as err:
        logger.info("The Neuron PJRT plugin is installed but gave no device (%s)", err)
        return None


def default_client():
    """The client graphs run on: a Neuron device's where there is one, else the XLA CPU device's (said once)."""
    client = neuron_client()
    if client is None:
        logger.info("No Neuron PJRT device here (the libneuronxla plugin is not installed or found none): the neuron "
                    "graphs run on the XLA CPU device.")
        client = cpu_client()
    return client


def platform_version(client) -> str:
    """What a serialized executable is tied to: the platform and its version (the plugin's, or jaxlib's for the CPU)."""
    return f"{client.platform} {client.platform_version}"


def _x64():
    # 64-bit integer inputs (token ids, positions) stay 64-bit on the device, without changing jax's global setting.
    import jax

    return jax.enable_x64(True) if hasattr(jax, "enable_x64") else contextlib.nullcontext()


def devices_for(client, shards: int) -> list:
    devices = client.devices()
    if len(devices) < shards:
        hint = (f" On the XLA CPU device, start Python with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{shards} for {shards} virtual devices." if client.platform == "cpu" else "")
        raise ValueError(f"The graphs are partitioned across {shards} devices (tp_degree) but the {client.platform} "
                         f"PJRT client has {len(devices)}.{hint}")
    return list(devices[:shards])


def _compile_options(devices: Sequence):
    from jaxlib import xla_client

    options = xla_client.CompileOptions()
    if len(devices) > 1:
        build = options.executable_build_options
        build.num_replicas, build.num_partitions = 1, len(devices)
        build.use_spmd_partitioning = True
        build.device_assignment = xla_client.DeviceAssignment.create(np.array([[d.id for d in devices]]))
    return options


def _device_list(devices: Sequence):
    from jaxlib import xla_client

    return xla_client.DeviceList(tuple(devices))


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


class Placement:
    """The devices a graph runs on, and how an array is laid out over them (split along one axis, or copied)."""

    def __init__(self, devices: Sequence):
        from jax.sharding import Mesh

        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), ("tp",))

    def sharding(self, rank: int, axis: Optional[int]):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(*("tp" if i == axis else None for i in range(rank))))

    def put(self, value, axis: Optional[int] = None):
        """`value` (torch tensor or numpy array) on the devices, split along `axis` (None: a copy on each)."""
        import jax

        array = to_numpy(value) if isinstance(value, torch.Tensor) else value
        with _x64():
            return jax.device_put(array, self.sharding(array.ndim, axis))


class PjrtGraph:
    """One lowered graph, compiled for its devices (`graph.shards` of them)."""

    def __init__(self, graph: StableHLOGraph, executable, client, devices: Sequence):
        self.graph, self.executable, self.client = graph, executable, client
        self.placement = Placement(devices)

    @classmethod
    def compile(cls, graph: StableHLOGraph, client=None) -> "PjrtGraph":
        client = client or cpu_client()
        devices = devices_for(client, graph.shards)
        return cls(graph, client.compile_and_load(graph.text, _device_list(devices), _compile_options(devices)),
                   client, devices)

    def serialize(self) -> bytes:
        return self.client.serialize_executable(self.executable)

    @classmethod
    def deserialize(cls, graph: StableHLOGraph, blob: bytes, client=None) -> "PjrtGraph":
        client = client or cpu_client()
        devices = devices_for(client, graph.shards)
        return cls(graph, client.deserialize_executable(blob, _device_list(devices), _compile_options(devices)),
                   client, devices)

    def __call__(self, arguments: Sequence) -> list:
        """Run with one device buffer (or torch tensor) per argument, in `graph.arguments` order; returns the output
        buffers in `graph.outputs` order. Donated arguments (the cache) are consumed: pass the returned one next."""
        import jax

        graph = self.graph
        if len(arguments) != len(graph.arguments):
            raise ValueError(f"graph {graph.name} takes {len(graph.arguments)} arguments, got {len(arguments)}")
        buffers = [self.placement.put(a, spec.sharded_axis) if isinstance(a, torch.Tensor) else a
                   for a, spec in zip(arguments, graph.arguments)]
        per_device = self.executable.execute_sharded(buffers).disassemble_into_single_device_arrays()
        outputs = []
        for index, shards in enumerate(per_device):
            if len(shards) == 1:
                outputs.append(shards[0])
                continue
            axis = graph.output_axis(index)
            shape = list(shards[0].shape)
            if axis is not None:
                shape[axis] *= len(shards)
            outputs.append(jax.make_array_from_single_device_arrays(
                tuple(shape), self.placement.sharding(len(shape), axis), shards))
        return outputs
