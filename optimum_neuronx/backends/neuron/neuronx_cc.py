"""Ahead-of-time NEFFs: each graph compiled by AWS's `neuronx-cc` for the export's instance type, graphs in parallel.

Inf2 and Trn1 take the graph as an XLA HloModuleProto (`.hlo.pb`), Trn2 and Trn3 as StableHLO (`.mlir`), as AWS's
own frameworks hand them over. Runs only where `neuronx-cc` is on PATH (AWS's pip repository; never a dependency).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from ...instances import InstanceType

logger = logging.getLogger(__name__)

NEURONX_CC = "neuronx-cc"
# The compiler's input per target: what it reads for that device generation.
SOURCE_SUFFIX = {"inf2": ".hlo.pb", "trn1": ".hlo.pb", "trn2": ".mlir", "trn3": ".mlir"}
# auto_cast_type -> neuronx-cc's casting: float32 graphs stay float32 (the compiler would otherwise cast matmuls to
# bf16); half-precision graphs let it cast what remains in float32 inside them (norms, the logits) to that type.
AUTO_CAST = {"fp32": ("--auto-cast", "none"), "bf16": ("--auto-cast", "matmult", "--auto-cast-type", "bf16"),
             "fp16": ("--auto-cast", "matmult", "--auto-cast-type", "fp16")}
DEFAULT_OPTIMIZATION = "-O2"
# Flags optimum-neuron users set for every compile (read at export, stored with the export's compiler_args).
FLAGS_ENV = "NEURON_CC_FLAGS"
# The neuronx-cc flags an export may carry: none names a file, a program or code. Flags taking a value list the
# values (given as --flag=value or --flag value); the others are switches.
VALUE_FLAGS = {
    "--optlevel": ("1", "2", "3"),
    "--auto-cast": ("none", "matmult", "all"),
    "--auto-cast-type": ("bf16", "fp16", "tf32", "fp8_e4m3"),
    "--model-type": ("transformer", "generic", "unet-inference"),
    "--lnc": ("1", "2"),
    "--verbose": ("debug", "info", "warning", "error", "critical"),
}
SWITCHES = ("-O1", "-O2", "-O3", "--enable-mixed-precision-accumulation", "--enable-saturate-infinity",
            "--enable-fast-loading-neuron-binaries", "--enable-fast-context-switch")


def check_flags(flags: Sequence[str]) -> None:
    """Refuse, naming it, any flag outside VALUE_FLAGS / SWITCHES or a value outside its list (e.g. --logfile, a
    --pipeline or --tensorizer-options string: they name files or pass options on to other tools)."""
    flags = list(flags)
    i = 0
    while i < len(flags):
        flag = flags[i]
        name, sep, value = flag.partition("=")
        if flag in SWITCHES:
            i += 1
            continue
        if name in VALUE_FLAGS:
            if not sep:
                if i + 1 >= len(flags):
                    raise ValueError(f"neuronx-cc flag {flag!r} needs a value: one of {VALUE_FLAGS[name]}.")
                i, value = i + 1, flags[i + 1]
            if value not in VALUE_FLAGS[name]:
                raise ValueError(f"neuronx-cc flag {name} {value!r} is refused: it takes one of {VALUE_FLAGS[name]}.")
            i += 1
            continue
        raise ValueError(f"neuronx-cc flag {flag!r} is refused: an export may carry only "
                         f"{', '.join(SWITCHES)} and {', '.join(VALUE_FLAGS)} with their listed values (no flag that "
                         f"names a file, a program or another tool's options).")


def environment_flags() -> tuple[str, ...]:
    """$NEURON_CC_FLAGS split as a shell would, checked like compiler_args (a refused flag is an error naming it)."""
    flags = tuple(shlex.split(os.environ.get(FLAGS_ENV, "")))
    try:
        check_flags(flags)
    except ValueError as err:
        raise ValueError(f"${FLAGS_ENV}: {err}") from None
    return flags


def available() -> bool:
    return shutil.which(NEURONX_CC) is not None


def argv(source: Path, output: Path, instance: InstanceType, auto_cast_type: str,
         extra_args: Sequence[str] = ()) -> list[str]:
    """The command line compiling `source` (a graph's .hlo.pb or .mlir) to the NEFF `output` for `instance`."""
    check_flags(extra_args)
    command = [NEURONX_CC, "compile", str(source), "--framework", "XLA", "--target", instance.target,
               "--model-type", "transformer", "--output", str(output)]
    if instance.target in ("trn2", "trn3"):
        command += ["--lnc", str(instance.lnc)]
    if not any(arg.startswith("-O") for arg in extra_args):
        command.append(DEFAULT_OPTIMIZATION)
    return [*command, *AUTO_CAST[auto_cast_type], *extra_args]


def compile_neffs(sources: dict[str, Path], out_dir: Path, instance: InstanceType, auto_cast_type: str,
                  extra_args: Sequence[str] = ()) -> dict[str, float]:
    """Compile each graph's source into `out_dir/<graph>.neff`, side by side; return each one's seconds.

    A failure raises RuntimeError naming the graph and the compiler's log, which is kept.
    """
    logs = Path(tempfile.mkdtemp(prefix="optimum-neuronx-neuronx-cc-"))

    def run(name: str) -> float:
        start = time.perf_counter()
        command = argv(sources[name], out_dir / f"{name}.neff", instance, auto_cast_type, extra_args)
        log = logs / f"{name}.log"
        with open(log, "w") as stream:
            stream.write(" ".join(command) + "\n")
            stream.flush()
            code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=logs).returncode
        if code != 0 or not (out_dir / f"{name}.neff").is_file():
            raise RuntimeError(f"neuronx-cc failed to compile graph {name} for {instance.name} (exit code {code}); "
                               f"its log: {log}")
        return time.perf_counter() - start

    workers = min(len(sources), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1) or 1
    logger.info("Compiling %d NEFFs for %s with %s (%d at a time)", len(sources), instance.name, NEURONX_CC, workers)
    with ThreadPoolExecutor(workers) as pool:
        seconds = dict(zip(sources, pool.map(run, sources)))
    shutil.rmtree(logs, ignore_errors=True)
    return seconds
