"""Ahead-of-time NEFFs: each graph compiled by AWS's `neuronx-cc` for the export's instance type, graphs in parallel.

Inf2 and Trn1 take the graph as an XLA HloModuleProto (`.hlo.pb`), Trn2 and Trn3 as StableHLO (`.mlir`), as AWS's
own frameworks hand them over. Runs only where `neuronx-cc` is on PATH (AWS's pip repository; never a dependency).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from ...configuration import InstanceType

logger = logging.getLogger(__name__)

NEURONX_CC = "neuronx-cc"
# The compiler's input per target: what it reads for that device generation.
SOURCE_SUFFIX = {"inf2": ".hlo.pb", "trn1": ".hlo.pb", "trn2": ".mlir", "trn3": ".mlir"}
# auto_cast_type -> neuronx-cc's casting: float32 graphs stay float32 (the compiler would otherwise cast matmuls to
# bf16); half-precision graphs let it cast what remains in float32 inside them (norms, the logits) to that type.
AUTO_CAST = {"fp32": ("--auto-cast", "none"), "bf16": ("--auto-cast", "matmult", "--auto-cast-type", "bf16"),
             "fp16": ("--auto-cast", "matmult", "--auto-cast-type", "fp16")}
DEFAULT_OPTIMIZATION = "-O2"


def available() -> bool:
    return shutil.which(NEURONX_CC) is not None


def argv(source: Path, output: Path, instance: InstanceType, auto_cast_type: str,
         extra_args: Sequence[str] = ()) -> list[str]:
    """The command line compiling `source` (a graph's .hlo.pb or .mlir) to the NEFF `output` for `instance`."""
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
