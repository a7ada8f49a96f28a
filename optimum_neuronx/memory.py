"""Memory planner: how much a compiled model needs and how many NeuronCores of an instance type that takes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .configuration import NeuronConfig
from .instances import GIB, InstanceType
from .modeling.decoder import StaticDecoder
from .modeling.spec import DecoderSpec
from .modeling.sharding import kv_heads_fit


def weight_bytes(spec: DecoderSpec, neuron_config: NeuronConfig) -> int:
    """The weights' bytes as the export stores them: quantized projections at their own width (int8: 1 byte, plus a
    float32 scale per output), everything else in the export dtype."""
    import torch

    with torch.device("meta"):
        decoder = StaticDecoder(spec, quantization=neuron_config.quantization)
    size = neuron_config.torch_dtype.itemsize
    return sum(p.numel() * (p.element_size() if p.dtype == torch.int8 or name.endswith(".scale") else size)
               for name, p in decoder.named_parameters())


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int
    kv_cache_bytes: int
    num_heads: int
    num_kv_heads: int
    instance: InstanceType
    tp_degree: int
    min_tp_degree: Optional[int]  # the smallest of the instance's tp degrees that fits; None: none fits

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    def shardable(self, tp_degree: int) -> bool:
        """Whether the heads can be cut `tp_degree` ways (KV heads split, or repeated when fewer than the cores)."""
        return self.num_heads % tp_degree == 0 and kv_heads_fit(self.num_kv_heads, tp_degree)

    def per_core_bytes(self, tp_degree: Optional[int] = None) -> float:
        tp = tp_degree or self.tp_degree
        # With more cores than KV heads, KV heads are repeated so that every core holds at least one.
        kv_repeats = max(1, tp // self.num_kv_heads)
        return (self.weight_bytes + self.kv_cache_bytes * kv_repeats) / tp

    def summary(self) -> str:
        need = "none fits" if self.min_tp_degree is None else str(self.min_tp_degree)
        return (f"weights {self.weight_bytes / GIB:.2f} GiB + KV cache {self.kv_cache_bytes / GIB:.2f} GiB = "
                f"{self.total_bytes / GIB:.2f} GiB; {self.per_core_bytes() / GIB:.2f} GiB per NeuronCore at "
                f"tp_degree={self.tp_degree}; smallest fitting tp_degree on {self.instance.name} "
                f"({self.instance.core_memory_bytes / GIB:g} GiB per core): {need}")


def _estimate(weight_bytes: int, kv_bytes: int, heads: int, kv_heads: int, neuron_config: NeuronConfig):
    instance = neuron_config.instance
    estimate = MemoryEstimate(weight_bytes, kv_bytes, heads, kv_heads, instance, neuron_config.tp_degree, None)
    fitting = [tp for tp in instance.tp_degrees
               if estimate.shardable(tp) and estimate.per_core_bytes(tp) <= instance.core_memory_bytes]
    return MemoryEstimate(weight_bytes, kv_bytes, heads, kv_heads, instance, neuron_config.tp_degree,
                          fitting[0] if fitting else None)


def estimate_memory(spec: DecoderSpec, neuron_config: NeuronConfig) -> MemoryEstimate:
    size = neuron_config.torch_dtype.itemsize
    kv = math.prod(spec.kv_cache_shape(neuron_config.batch_size, neuron_config.sequence_length)) * size
    return _estimate(weight_bytes(spec, neuron_config), kv, spec.num_heads, spec.num_kv_heads, neuron_config)


def estimate_memory_from_config(config, neuron_config: NeuronConfig) -> MemoryEstimate:
    """The same plan for any Transformers config (not only the architectures we export): the parameters counted
    on a model built on the meta device, the KV cache from the config's layer and head counts. No weights loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    size = neuron_config.torch_dtype.itemsize
    kv = 2 * text.num_hidden_layers * neuron_config.batch_size * neuron_config.sequence_length
    kv *= kv_heads * head_dim * size
    return _estimate(parameters * size, kv, heads, kv_heads, neuron_config)


def check_fits_neuron_cores(estimate: MemoryEstimate) -> None:
    """Refuse a tp_degree whose per-core share does not fit in a NeuronCore's memory."""
    per_core, available = estimate.per_core_bytes(), estimate.instance.core_memory_bytes
    if per_core > available:
        fix = (f"use num_cores={estimate.min_tp_degree}" if estimate.min_tp_degree
               else "no tp_degree of this instance type fits: lower batch_size or sequence_length, or pick a larger "
                    "instance_type")
        raise ValueError(f"tp_degree (num_cores) = {estimate.tp_degree} needs {per_core / GIB:.1f} GiB per "
                         f"NeuronCore, more than the {available / GIB:g} GiB of one on {estimate.instance.name} "
                         f"({estimate.summary()}); {fix}.")


def available_host_memory() -> Optional[int]:
    """Bytes of memory this machine can still give (Linux MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_host_memory(needed: int, what: str) -> None:
    """Refuse, before allocating, `needed` bytes this machine does not have available (needed vs available)."""
    available = available_host_memory()
    if available is not None and needed > available:
        raise ValueError(f"{what} needs {needed / GIB:.2f} GiB of this machine's memory, but {available / GIB:.2f} GiB "
                         f"is available: lower batch_size or sequence_length, use fewer layers or a smaller dtype, or "
                         f"free memory.")

