"""The AWS instances with Neuron devices an export can be planned and compiled for: their compiler target, devices,
memory and the tensor-parallel degrees they offer. Plain data."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class InstanceType:
    """An AWS instance with Neuron devices, as the compiler and the memory planner see it."""

    name: str
    target: str  # neuronx-cc --target
    devices: int  # Neuron devices (chips)
    device_memory_gib: int  # HBM per device
    cores_per_device: int  # logical NeuronCores per device, at the default logical NeuronCore config (lnc)
    lnc: int  # physical cores per logical core (neuronx-cc --lnc; 1 where the device has no such setting)
    tp_degrees: tuple[int, ...]  # the tensor-parallel degrees graphs can be compiled for

    @property
    def cores(self) -> int:
        return self.devices * self.cores_per_device

    @property
    def core_memory_bytes(self) -> int:
        return self.device_memory_gib * GIB // self.cores_per_device


# Figures from the AWS Neuron architecture pages (awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/
# neuron-hardware/):
#   inf2-arch.html, inferentia2.html: Inferentia2 = 2 NeuronCore-v2 + 32 GiB; inf2.xlarge/8xlarge 1, 24xlarge 6,
#     48xlarge 12 devices. trn1-arch.html, trainium.html: Trainium = 2 NeuronCore-v2 + 32 GiB; trn1.2xlarge 1,
#     trn1(n).32xlarge 16 devices.
#   trainium2.html, trn2-arch.html: Trainium2 = 8 NeuronCore-v3 + 96 GiB, LNC=2 by default (4 logical cores);
#     trn2.3xlarge 1, trn2.48xlarge 16 devices.
#   trainium3.html: Trainium3 = 8 NeuronCore-v4 + 144 GiB, LNC=2 by default. Only one device is listed here: the
#     multi-device Trn3 sizes are not in this table yet.
# tp degrees: those the collective-communication rings support (Neuron's LLM inference guides: Inf2 1, 2, 4, 8, 12,
# 24; Trn1 1, 2, 8, 32), capped by each size's cores.
_INF2_TP, _TRN1_TP, _TRN2_TP = (1, 2, 4, 8, 12, 24), (1, 2, 8, 32), (1, 2, 4, 8, 16, 32, 64)
INSTANCE_TYPES = {
    t.name: t for t in (
        InstanceType("inf2.xlarge", "inf2", 1, 32, 2, 1, (1, 2)),
        InstanceType("inf2.8xlarge", "inf2", 1, 32, 2, 1, (1, 2)),
        InstanceType("inf2.24xlarge", "inf2", 6, 32, 2, 1, (1, 2, 4, 8, 12)),
        InstanceType("inf2.48xlarge", "inf2", 12, 32, 2, 1, _INF2_TP),
        InstanceType("trn1.2xlarge", "trn1", 1, 32, 2, 1, (1, 2)),
        InstanceType("trn1.32xlarge", "trn1", 16, 32, 2, 1, _TRN1_TP),
        InstanceType("trn1n.32xlarge", "trn1", 16, 32, 2, 1, _TRN1_TP),
        InstanceType("trn2.3xlarge", "trn2", 1, 96, 4, 2, (1, 2, 4)),
        InstanceType("trn2.48xlarge", "trn2", 16, 96, 4, 2, _TRN2_TP),
        InstanceType("trn3", "trn3", 1, 144, 4, 2, (1, 2, 4)),
    )
}
# The family names optimum-neuron takes (`--instance_type inf2`) stand for the family's largest size.
INSTANCE_TYPES.update({"inf2": INSTANCE_TYPES["inf2.48xlarge"], "trn1": INSTANCE_TYPES["trn1.32xlarge"],
                       "trn1n": INSTANCE_TYPES["trn1n.32xlarge"], "trn2": INSTANCE_TYPES["trn2.48xlarge"]})
# Planned for when an export names no instance type (optimum-neuron's default target).
DEFAULT_INSTANCE_TYPE = "inf2"
# Every tensor-parallel degree some instance offers.
SUPPORTED_TP_DEGREES = tuple(sorted({tp for t in INSTANCE_TYPES.values() for tp in t.tp_degrees}))


def instance_type(name: str) -> InstanceType:
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        raise ValueError(f"Unknown instance_type {name!r}; known: {', '.join(INSTANCE_TYPES)}.") from None
