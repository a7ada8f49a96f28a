"""Memory planner: how much a compiled model needs and how many NeuronCores that takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .configuration import SUPPORTED_TP_DEGREES, NeuronConfig
from .modeling.decoder import DecoderSpec, StaticDecoder

GIB = 1024**3
NEURON_CORE_MEMORY = 16 * GIB  # HBM per NeuronCore on Inf2 / Trn1


def parameter_count(spec: DecoderSpec) -> int:
    """Exact count, from the decoder itself built on the meta device (no memory is allocated)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in StaticDecoder(spec).parameters())


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int
    kv_cache_bytes: int
    tp_degree: int
    min_tp_degree: Optional[int]  # None: no supported degree fits

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    def per_core_bytes(self, tp_degree: int, spec: DecoderSpec) -> float:
        # With more cores than KV heads, KV heads are replicated so that every core holds at least one.
        kv_replication = max(1, tp_degree // spec.num_kv_heads)
        return (self.weight_bytes + self.kv_cache_bytes * kv_replication) / tp_degree

    def summary(self) -> str:
        need = "none fits" if self.min_tp_degree is None else str(self.min_tp_degree)
        return (f"weights {self.weight_bytes / GIB:.2f} GiB + KV cache {self.kv_cache_bytes / GIB:.2f} GiB = "
                f"{self.total_bytes / GIB:.2f} GiB; NeuronCores needed at 16 GiB each: {need} "
                f"(tp_degree={self.tp_degree})")


def estimate_memory(spec: DecoderSpec, neuron_config: NeuronConfig) -> MemoryEstimate:
    size = neuron_config.torch_dtype.itemsize
    weights = parameter_count(spec) * size
    kv = 2 * spec.num_layers * neuron_config.batch_size * neuron_config.sequence_length
    kv *= spec.num_kv_heads * spec.head_dim * size
    estimate = MemoryEstimate(weights, kv, neuron_config.tp_degree, None)
    fitting = [tp for tp in SUPPORTED_TP_DEGREES
               if spec.num_heads % tp == 0 and estimate.per_core_bytes(tp, spec) <= NEURON_CORE_MEMORY]
    return MemoryEstimate(weights, kv, neuron_config.tp_degree, fitting[0] if fitting else None)


def check_fits_neuron_cores(estimate: MemoryEstimate, spec: DecoderSpec) -> None:
    """Refuse a tp_degree whose per-core share does not fit in a NeuronCore's memory."""
    per_core = estimate.per_core_bytes(estimate.tp_degree, spec)
    if per_core > NEURON_CORE_MEMORY:
        fix = (f"use num_cores={estimate.min_tp_degree}" if estimate.min_tp_degree
               else "lower batch_size or sequence_length")
        raise ValueError(f"tp_degree (num_cores) = {estimate.tp_degree} needs {per_core / GIB:.1f} GiB per NeuronCore, "
                         f"more than its {NEURON_CORE_MEMORY // GIB} GiB ({estimate.summary()}); {fix}.")
