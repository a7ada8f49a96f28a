"""The backend interface: compile one graph per bucket into a directory, load them back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import torch

from ..configuration import GraphSpec, NeuronConfig
from ..modeling.kernels import Kernels


class CompiledGraph(Protocol):
    """A graph a backend loaded. Called with the decoder's flat inputs (StaticDecoder.INPUT_NAMES' order: the KV
    cache as `Backend.new_kv_cache` made it), it returns the logits; a graph that samples on the device returns
    (logits, tokens), its logits possibly DeviceLogits. `input_signature`: each input's [shape, dtype] as compiled,
    which loading checks against the inputs the export's configs give."""

    input_signature: list

    def __call__(self, inputs: list): ...


class DeviceLogits:
    """A sampling graph's logits left on the device that computed them, copied to the host only when read: a step
    whose tokens were picked on the device moves token ids only, not [batch, vocab] logits."""

    def __init__(self, fetch: Callable[[], torch.Tensor]):
        self._fetch = fetch

    def to_torch(self) -> torch.Tensor:
        return self._fetch()


def host_logits(logits) -> torch.Tensor:
    """Logits on the host: DeviceLogits copied over, a tensor as it is."""
    return logits.to_torch() if isinstance(logits, DeviceLogits) else logits


class Backend(ABC):
    name: str
    # True when graphs run on NeuronCores, whose per-core memory bounds the model (see memory.py).
    targets_neuron_cores: bool = False
    # True when graphs read the weights from host memory at every decode step: loading puts them in huge pages
    # there by default (huge_pages.py).
    streams_host_weights: bool = False

    def uses_host_memory(self) -> bool:
        """Whether the weights and the KV cache live in this machine's memory when the graphs run here (checked
        against what it has available before allocating)."""
        return True

    # Whether graphs may be sharded across several cores (tensor parallelism, NeuronConfig.tp_degree > 1).
    shards: bool = False

    # Weight-only quantizations (NeuronConfig.quantization) whose weights this backend's graphs compute with.
    quantizations: tuple[str, ...] = ()

    def kernels(self, dtype: torch.dtype, batch_size: int, quantization: str | None = None) -> Kernels:
        """How the decoder computes its projections, attention and cache write (modeling/kernels.py `Kernels`)."""
        return Kernels()

    def packable_weight_names(self, decoder: torch.nn.Module) -> list[str]:
        """Weights the runtime may reorder at load for this backend's kernels (`pack_weight`); stamped at export."""
        return []

    def pack_weight(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        """`weight` reordered at load for the kernels that read it."""
        raise NotImplementedError(f"The {self.name} backend does not pack weights.")

    def check_compiler_args(self, compiler_args: Sequence[str]) -> None:
        """Raise ValueError naming any option this backend does not take from an export (an allow-list of what
        cannot run code: numbers, booleans, known enums)."""
        if compiler_args:
            raise ValueError(f"The {self.name} backend takes no compiler_args, got {list(compiler_args)}.")

    def environment_compiler_args(self) -> tuple[str, ...]:
        """Compiler options this machine's environment adds to every export (checked like compiler_args)."""
        return ()

    @abstractmethod
    def check_toolchain(self) -> None:
        """Raise a clear error, before any work, when the compiler cannot run here."""

    @abstractmethod
    def compiler_version(self) -> str: ...

    def codegen_options(self) -> dict:
        """Code-generation choices of this backend beyond the lowering (stamped: a change recompiles)."""
        return {}

    def target(self, kernels: Kernels | None = None, dtype: torch.dtype | None = None) -> str:
        """What graphs compiled with `kernels` for weights of `dtype` need of the machine that runs them (stamped
        in the export and the cache key)."""
        return ""

    def missing_target_support(self, target: str) -> str:
        """Why graphs compiled for `target` cannot run on this machine, or "" when they can."""
        return ""

    @abstractmethod
    def graph_files(self, out_dir: Path) -> tuple[str, ...]:
        """Files (relative to `out_dir`, where `compile` wrote them) that hold the compiled graphs."""

    @abstractmethod
    def compile(
        self,
        decoder: torch.nn.Module,
        graphs: Sequence[GraphSpec],
        example_inputs: Callable[[GraphSpec], tuple],
        out_dir: Path,
        neuron_config: NeuronConfig,
    ) -> dict[str, float]:
        """Compile every graph into `out_dir` for `neuron_config` (its compiler_args, tp_degree, instance_type);
        return the compile time of each, in seconds."""

    @abstractmethod
    def load(
        self, artifact_dir: Path, graphs: Sequence[GraphSpec], weights: Mapping[str, torch.Tensor]
    ) -> dict[str, CompiledGraph]:
        """Load the graphs, sharing `weights` (the caller keeps them alive) between all of them."""

    def new_kv_cache(self, graphs: Mapping[str, CompiledGraph], shape: tuple[int, ...], dtype: torch.dtype):
        """The zeroed KV cache the loaded `graphs` take as an input and write in place: a host tensor of `shape`
        here; a backend whose graphs keep the cache on a device returns its own handle."""
        return torch.zeros(shape, dtype=dtype)

    def reorder_kv_cache(self, kv, rows: torch.Tensor) -> None:
        """Batch rows 0 .. n - 1 of `kv` (as `new_kv_cache` made it) become rows `rows` (beam search)."""
        kv[:, :, :rows.numel()] = kv[:, :, rows]
