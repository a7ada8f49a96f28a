"""The CPU-dependent constants of the inductor backend, read from one table of data (kernels/tuning.json).

A CPU is named by its vendor and family (`cpu_identity`); its entry overrides some values of the generic profile,
which every other CPU gets. Every value is stamped into exports, so a changed table never reuses a cached compile.

weight_tile          dtype -> outputs per tile of the projection weights at decode batches 1-4 (0: plain rows)
row_prefetch_locality, rows_prefetch_locality
                     __builtin_prefetch's locality for weights streamed against one / several rows of input
                     (0 non-temporal, 1-3 into L2 .. L1)

A value earns its entry with >= 5% on benchmarks/bench_generate.py (docs/performance.md, "The tuning table").
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ...configuration import TORCH_DTYPES

TUNING_FILE = Path(__file__).with_name("kernels") / "tuning.json"
# The values compiled into the C++ kernels, as OPTIMUM_NEURONX_<NAME> (custom_kernels.c_shim_options).
KERNEL_CONSTANTS = ("row_prefetch_locality", "rows_prefetch_locality")
# How far ahead of a weight row's current vector a software prefetch reaches (Inductor's loops and ours).
ROW_PREFETCH_BYTES = 8192
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # as tuning.json names them

PROFILES: dict[str, dict] = {name: entry for name, entry in json.loads(TUNING_FILE.read_text()).items()
                             if not name.startswith("_")}


@functools.lru_cache(maxsize=None)
def cpu_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's `name: value` fields of /proc/cpuinfo; {} where it cannot be read."""
    fields = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            name, sep, value = line.partition(":")
            if not sep:
                break  # end of the first processor's block
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, int]:
    """(vendor, family) of this x86 CPU from /proc/cpuinfo; ("", -1) where it cannot be read."""
    fields = cpu_fields(cpuinfo)
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else -1


def profile_name(identity: tuple[str, int]) -> str:
    return f"{identity[0]} family {identity[1]}"


def cpu_profile() -> dict:
    """This CPU's values: the generic profile with its own entry's overrides."""
    return {**PROFILES["generic"], **PROFILES.get(profile_name(cpu_identity()), {})}


def weight_tile(dtype: torch.dtype) -> int:
    """The tile this CPU's profile stores projection weights of `dtype` in; 0 (plain rows) where it names none."""
    return cpu_profile()["weight_tile"].get(_DTYPE_NAMES.get(dtype, ""), 0)


def kernel_tuning() -> dict:
    """The constants compiled into the kernels for this CPU; stamped into exports next to the kernels' digests."""
    profile = cpu_profile()
    return {name: profile[name] for name in KERNEL_CONSTANTS}
