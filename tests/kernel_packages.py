"""One AOTInductor package per instruction set x dtype for the kernel tests: the graphs of test_kernels.py
(rows_matvec), test_attention_kernel.py (decode_attention) and test_quantization.py (int8_matvec) side by side in one
module, compiled once (one C++ build where there were three). Each test file registers its part and reads its own
inputs and outputs of the shared package through a `KernelPart`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# part name -> (runs_here(isa, dtype) -> bool, make(dtype) -> (module, args)); filled by the test files at import
PARTS: dict[str, tuple[Callable, Callable]] = {}


def register(name: str, runs_here: Callable, make: Callable) -> None:
    PARTS[name] = (runs_here, make)


class _SideBySide(torch.nn.Module):
    def __init__(self, modules: dict):
        super().__init__()
        self.parts = torch.nn.ModuleDict(modules)

    def forward(self, inputs: dict):
        return {name: module(*inputs[name]) for name, module in self.parts.items()}


@dataclass(frozen=True)
class KernelPart:
    """One test file's graph inside the shared package: its module (eager), its example inputs, and calls of the
    package that take and return only this part's (the other parts run on their own example inputs)."""
    path: str
    name: str
    module: torch.nn.Module
    args: tuple
    inputs: dict  # every part's example inputs
    output_spec: object  # the pytree of the whole package's outputs

    def _with(self, args) -> dict:
        return {**self.inputs, self.name: tuple(self.args if args is None else args)}

    def run(self, args=None):
        """Load the package and run it: this part's outputs for `args` (default: its example inputs)."""
        from torch._inductor.package import load_package

        return load_package(self.path)(self._with(args))[self.name]

    def flat_inputs(self, args=None) -> list:
        """The package's inputs as one flat list (AOTIModelPackageLoader.boxed_run takes them so)."""
        return tree_flatten((self._with(args),))[0]

    def outputs_from_flat(self, flat: list):
        """This part's outputs out of the flat list boxed_run returns."""
        return tree_unflatten(list(flat), self.output_spec)[self.name]


def _package(isa: str, dtype: torch.dtype, directory: str, names=None, **shim_options) -> tuple[str, dict, dict, object]:
    from torch._inductor.package import package_aoti

    from optimum_neuronx.backends.inductor.custom_kernels import c_shim_options

    made = {name: make(dtype) for name, (runs_here, make) in PARTS.items()
            if runs_here(isa, dtype) and (names is None or name in names)}
    modules = {name: module.eval() for name, (module, _) in made.items()}
    inputs = {name: tuple(args) for name, (_, args) in made.items()}
    module = _SideBySide(modules)
    with torch.no_grad():
        output_spec = tree_flatten(module(inputs))[1]
    program = torch.export.export(module, (inputs,), strict=False)
    options = c_shim_options(4, isa, attention="decode_attention" in made, int8="int8_matvec" in made, **shim_options)
    files = torch._inductor.aot_compile(program.module(), (inputs,), options={"aot_inductor.package": True,
                                                                              **options})
    return package_aoti(f"{directory}/kernels.pt2", files), modules, inputs, output_spec


_BUILT: dict = {}


def kernel_part(name: str, isa: str, dtype: torch.dtype, make_directory: Callable[[], object]) -> KernelPart:
    """`name`'s part of the package for (isa, dtype), compiled on first use (into a folder `make_directory` makes)."""
    if (isa, dtype) not in _BUILT:
        _BUILT[isa, dtype] = _package(isa, dtype, str(make_directory()))
    path, modules, inputs, output_spec = _BUILT[isa, dtype]
    return KernelPart(path, name, modules[name], inputs[name], inputs, output_spec)


def standalone_part(name: str, isa: str, dtype: torch.dtype, directory, **shim_options) -> KernelPart:
    """`name`'s graph alone in a package of its own, compiled with other kernel options (c_shim_options's)."""
    path, modules, inputs, output_spec = _package(isa, dtype, str(directory), names=(name,), **shim_options)
    return KernelPart(path, name, modules[name], inputs[name], inputs, output_spec)
