"""Time the inductor backend's dot kernel (rows_matvec) outside any graph, against a plain read of the same weight.

    python tools/kernel_harness.py --dtype bf16 --rows 1 --k 2048 --megabytes 1024
    python tools/kernel_harness.py --dtype f32 --rows 4 --k 5632 --set rows_prefetch_locality=0

It compiles optimum_neuronx/backends/inductor/kernels/harness.cpp with the defines a graph compiles the kernel with
(this CPU's variant and its entries of kernels/tuning.json; --set overrides one) and prints one JSON line: the
kernel's GB/s, the plain read's GB/s in the same process, and the kernel's largest error against a float64 sum.
This is how a tuning-table entry is tried before it is measured on benchmarks/bench_generate.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from optimum_neuronx.backends import get_backend
from optimum_neuronx.backends.inductor.custom_kernels import KERNELS_DIR, kernel_defines

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def build(isa: str, overrides: dict, out_dir: Path) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise SystemExit("kernel_harness needs a C++ compiler (g++ or clang++)")
    defines = kernel_defines(isa, tuning_overrides=overrides)
    binary = out_dir / "harness"
    command = [compiler, "-std=c++17", "-O1", "-march=native", "-fopenmp", f"-I{KERNELS_DIR}",
               *(f"-D{name}={value}" for name, value in defines.items()), str(KERNELS_DIR / "harness.cpp"), "-o",
               str(binary)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building the harness failed:\n{' '.join(command)}\n{done.stderr[-4000:]}")
    return binary


def run(dtype: str, rows: int, k: int, n: int, repeats: int, isa: str = "", overrides: dict | None = None) -> dict:
    """Build and run the harness once; its JSON line as a dict."""
    isa = isa or get_backend("inductor").dot_kernel_isa(DTYPES[dtype])
    if not isa:
        raise SystemExit(f"this CPU has no variant of the dot kernel for {dtype}")
    with tempfile.TemporaryDirectory(prefix="optimum-neuronx-harness-") as work:
        binary = build(isa, overrides or {}, Path(work))
        done = subprocess.run([str(binary), dtype, str(rows), str(k), str(n), str(repeats)], capture_output=True,
                              text=True)
    if done.returncode != 0:
        raise SystemExit(f"the harness failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return dict(json.loads(done.stdout), isa=isa)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (decode: the batch), 1-64")
    parser.add_argument("--k", type=int, default=2048, help="inputs per row")
    parser.add_argument("--megabytes", type=float, default=1024.0, help="size of the weight streamed")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    parser.add_argument("--isa", default="", help="the kernel variant (avx512_bf16, avx512, avx2); default: this CPU's")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a tuning-table constant (kernels/tuning.json), e.g. row_prefetch_locality=1")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            parser.error(f"--set {item!r}: give NAME=INTEGER")
        overrides[name] = int(value)
    element = DTYPES[args.dtype].itemsize
    n = max(1, int(args.megabytes * 2**20 / (args.k * element)))
    print(json.dumps(run(args.dtype, args.rows, args.k, n, args.repeats, args.isa, overrides)))


if __name__ == "__main__":
    sys.exit(main())
