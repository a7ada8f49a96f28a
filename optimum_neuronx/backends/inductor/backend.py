"""torch.export + AOTInductor: every graph in one .pt2 package, weights kept out of it.

Weights live once in neuronx_weights.safetensors and are handed to every graph with
`load_constants(..., user_managed=True)`, so N graphs share one copy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable, Sequence

import torch

from ...configuration import GraphSpec
from ...tempdirs import temporary_directory
from ..base import Backend, CompiledGraph
from ..workers import compile_workers, map_in_workers
from . import tuning
from .build import objects_compiled_together
from .codegen import codegen_options, decode_codegen, inductor_options
from .custom_kernels import DOT_KERNEL_ISAS, c_shim_options, kernel_digests
from .lowering import Lowering
from .ops import KERNEL_ROWS

logger = logging.getLogger(__name__)

PACKAGE_NAME = "model.pt2"
# The package metadata entry holding each graph's input and weight shapes (graph_signature).
SIGNATURE_KEY = "optimum_neuronx.signature"
# Graphs check their inputs' shapes, strides and dtypes on every call (AOTInductor's generated checks, a few integer
# comparisons) where this is set when the first graph runs: an input they were not compiled for raises instead of
# being read out of bounds. `load` sets it unless the user did.
CHECK_INPUTS_ENV = "AOTI_RUNTIME_CHECK_INPUTS"

# x86 vector instruction sets named in an export's target -> the torch.cpu probe that says this CPU has them.
X86_FEATURE_PROBES = {
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "avx512_vnni": "_is_vnni_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx_tile": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}
# The smallest batch each variant of the dot kernel takes (AVX2 at one row is no faster than the multiply + sum).
DOT_KERNEL_MIN_BATCH = {"avx512_bf16": 1, "avx512": 1, "avx2": 2}
# The dot kernel variant that reads tiled weights of each dtype (tuning.json's weight_tile).
TILED_ISA = {torch.float32: "avx512", torch.bfloat16: "avx512_bf16"}
# Compiler flags Inductor adds beyond its ISA's name when the compiling CPU has them.
OPTIONAL_ISA_FLAGS = {"-mavx512bf16": "avx512_bf16", "-mamx-fp16": "amx_fp16"}


def cpu_has(feature: str) -> bool:
    """Whether this CPU has an x86 instruction set named in X86_FEATURE_PROBES (False if torch cannot tell)."""
    return getattr(torch.cpu, X86_FEATURE_PROBES[feature], lambda: False)()


# Inductor options whose names say they write files, print, or call hooks: refused whatever their value.
_REFUSED_OPTION_WORDS = ("debug", "trace", "profile", "dump", "log", "hook", "print", "minifier")
# Options with no typed default whose values are a known set.
_ENUM_OPTIONS = {"cpp.simdlen": (0, 128, 256, 512),
                 "aot_inductor.compile_wrapper_opt_level": ("O0", "O1", "O2", "O3", "Os")}


def parse_compiler_args(compiler_args: Sequence[str]) -> dict:
    """`name=value` pairs -> Inductor config options, each checked against what is safe to take from a file: a
    torch._inductor.config option whose default is a boolean or a number, given a value of that type (or one of the
    few known enum values). Options that hold a program, a path, a string or code - the C++ compiler, include
    paths, passes - are refused, naming the option: an export's options must never run anything."""
    from torch._inductor import config as inductor_config

    defaults = inductor_config.get_config_copy()
    options = {}
    for arg in compiler_args:
        name, sep, raw = arg.partition("=")
        if not sep:
            raise ValueError(f"compiler arg {arg!r} must look like name=value, e.g. 'max_autotune=true'.")
        if name not in defaults:
            raise ValueError(f"compiler arg {arg!r}: {name!r} is not a torch._inductor.config option.")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options[name] = _checked_option(name, value, defaults[name], arg)
    return options


def _checked_option(name: str, value, default, arg: str):
    refuse = (f"compiler arg {arg!r} is refused: only options taking a boolean or a number (or a known enum value) "
              f"can be given, and none that writes files or calls hooks")
    if any(word in name for word in _REFUSED_OPTION_WORDS):
        raise ValueError(f"{refuse}; {name!r} is one that does.")
    if name in _ENUM_OPTIONS:
        if value in _ENUM_OPTIONS[name] and not isinstance(value, bool):
            return value
        raise ValueError(f"{refuse}; {name!r} takes one of {_ENUM_OPTIONS[name]}.")
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    else:
        raise ValueError(f"{refuse}; {name!r} holds a {type(default).__name__}, which may name a program, a path "
                         f"or code.")
    raise ValueError(f"{refuse}; {name!r} takes a {type(default).__name__}, got {value!r}.")


class InductorBackend(Backend):
    name = "inductor"
    streams_host_weights = True

    def check_compiler_args(self, compiler_args: Sequence[str]) -> None:
        parse_compiler_args(compiler_args)

    def check_toolchain(self) -> None:
        if shutil.which("g++") is None and shutil.which("c++") is None and shutil.which("clang++") is None:
            raise RuntimeError(
                "The inductor backend compiles C++ at export time and found no C++ compiler. Install one "
                "(Debian/Ubuntu: `apt-get install g++`). Loading an already exported model needs none."
            )

    quantizations = ("int8",)

    def kernels(self, dtype: torch.dtype, batch_size: int, quantization: str | None = None) -> Lowering:
        # Decode projections of up to KERNEL_ROWS rows: our dot kernel where it builds, else one fused multiply +
        # sum per row; prefill and larger batches: oneDNN (weights packed at load past the kernel's rows). Decode
        # attention: our kernel or fused reductions; prefill attention: SDPA in 128-token causal blocks.
        if not dtype.is_floating_point:
            return Lowering(gemm_dtype=self.gemm_dtype(dtype))
        gemm_dtype = self.gemm_dtype(dtype)
        onednn = gemm_dtype == dtype and torch.backends.mkldnn.is_available()
        isa = self.dot_kernel_isa(dtype)
        dot_rows = KERNEL_ROWS if isa and batch_size >= DOT_KERNEL_MIN_BATCH[isa] else 0
        attention_kernel = bool(isa)
        packed_rows = batch_size if onednn and batch_size > max(1, dot_rows) and not quantization else 0
        tile = tuning.weight_tile(dtype)
        tile = tile if TILED_ISA.get(dtype) == isa and batch_size <= dot_rows and not quantization else 0
        # Tiles are read at decode by the dot kernel alone, at every width
        # int8 projections: our int8 kernel wherever a dot kernel variant builds (it reads a quarter of float32's
        # bytes, worth it at every batch size)
        return Lowering(dot_rows=dot_rows, dot_isa=isa if dot_rows or attention_kernel else "",
                        int8_kernel=bool(quantization) and bool(isa),
                        matvec_rows=KERNEL_ROWS,
                        gemm_dtype=gemm_dtype, onednn=onednn, packed_rows=packed_rows, attention_tokens=1,
                        attention_kernel=attention_kernel, causal_block=128,
                        weight_tile=tile)

    def dot_kernel_isa(self, dtype: torch.dtype) -> str:
        """The best variant of `rows_matvec`'s kernel this machine can compile and run for `dtype` (a DOT_KERNEL_ISAS
        key: AVX-512, for bfloat16 with avx512_bf16's dot products where the CPU has them, else AVX2; GCC or
        Clang), "" if none."""
        from torch._inductor import cpp_builder

        if not (cpp_builder.is_gcc() or cpp_builder.is_clang()):
            return ""
        return next((isa for isa, needs in DOT_KERNEL_ISAS.items()
                     if dtype in needs and all(cpu_has(feature) for feature in needs[dtype])), "")

    def packable_weight_names(self, decoder) -> list[str]:
        return decoder.kernels.packable_weight_names(decoder)

    def pack_weight(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        # oneDNN's blocked layout depends on this CPU and this torch build: reordered at load, never saved.
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def gemm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # Without native bf16/fp16 dot products (avx512_bf16, AMX) the BLAS emulates half-precision GEMMs several
        # times slower than float32: upcast the operands, round the result. Weights stay half precision in memory.
        native = {torch.bfloat16: ("avx512_bf16", "amx_tile"), torch.float16: ("amx_fp16",)}
        if dtype not in native or any(cpu_has(feature) for feature in native[dtype]):
            return dtype
        return torch.float32

    def compiler_version(self) -> str:
        return torch.__version__

    def codegen_options(self) -> dict:
        return {**codegen_options(), "kernels": kernel_digests(), "kernel_tuning": tuning.kernel_tuning()}

    def target(self, lowering: Lowering | None = None, dtype: torch.dtype | None = None) -> str:
        # The vector instructions Inductor's C++ kernels were compiled for: its ISA for this CPU (e.g. "avx512
        # avx512_vnni") plus the optional instruction sets it added to the compiler flags, and what our
        # dot-product kernel needs for `dtype` when the graphs carry it. gemm_dtype also depends on the compiling
        # CPU, but both of its choices run anywhere.
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        flags = isa.build_arch_flags().split() if isa else []
        names = [*(str(isa).split() if isa else []),
                 *(name for flag, name in OPTIONAL_ISA_FLAGS.items() if flag in flags)]
        if lowering is not None and (lowering.dot_rows or lowering.attention_kernel):
            names += [name for name in DOT_KERNEL_ISAS[lowering.dot_isa].get(dtype, ()) if name not in names]
        return " ".join(["cpu", *names])

    def missing_target_support(self, target: str) -> str:
        features = target.removeprefix("cpu").split()
        if all(name in X86_FEATURE_PROBES for name in features):
            # Read from the CPU's own feature flags (cpuinfo): no compiler needed to load an export.
            has = {name: cpu_has(name) for name in X86_FEATURE_PROBES}
            lacking = [name for name in features if not has[name]]
            if not lacking:
                return ""
            supported = [name for name, ok in has.items() if ok]
            return (f"its kernels were compiled for the vector instructions {' '.join(features)!r}; this CPU lacks "
                    f"{', '.join(lacking)} (it supports: {', '.join(supported) or 'none of them'})")
        # Other architectures: Inductor's own check, which test-compiles a kernel for each ISA (needs a compiler).
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        isa = " ".join(features)
        supported = [str(vec) for vec in valid_vec_isa_list()]
        if not isa or isa in supported:
            return ""
        return (f"its kernels were compiled for the vector instructions {isa!r}, which this CPU lacks "
                f"(it supports: {', '.join(supported) or 'none'})")

    def graph_files(self, out_dir) -> tuple[str, ...]:
        return (PACKAGE_NAME,)

    def compile(self, decoder, graphs, example_inputs, out_dir, neuron_config) -> dict[str, float]:
        from torch._inductor.package import package_aoti

        lowering = decoder.kernels
        options = {**inductor_options(),
                   **c_shim_options(lowering.dot_rows, lowering.dot_isa, lowering.attention_kernel,
                                    int8=lowering.int8_kernel),
                   **parse_compiler_args(neuron_config.compiler_args)}
        start = time.perf_counter()
        with temporary_directory("aoti") as build_dir:
            compile_graph = functools.partial(_compile_graph, decoder, example_inputs, options, build_dir)
            workers = compile_workers(len(graphs))
            setup = functools.partial(_forked_worker_setup, torch.get_num_threads())
            compiled = map_in_workers(compile_graph, graphs, workers, setup, lambda graph: f"graph {graph.name}",
                                      desc="Compiling graphs", unit="graph")
            files = {graph.name: graph_files for graph, (graph_files, _) in zip(graphs, compiled)}
            package_aoti(str(Path(out_dir) / PACKAGE_NAME), files)
        logger.info("Compiled %d graphs in %.1f s (%d at a time)", len(graphs), time.perf_counter() - start, workers)
        return {graph.name: seconds for graph, (_, seconds) in zip(graphs, compiled)}

    def load(self, artifact_dir, graphs, weights) -> dict[str, CompiledGraph]:
        check_package(Path(artifact_dir) / PACKAGE_NAME)
        os.environ.setdefault(CHECK_INPUTS_ENV, "1")
        loaded = {}
        for graph in graphs:
            # The C++ loader, not load_package(): that first loads every graph in the package to compare this CPU
            # with the compiling one, which imports Inductor and test-compiles a kernel per vector ISA (~3 s in a
            # fresh process, and an error with no C++ compiler installed). read_artifact checked the target.
            with _extraction_removed_on_failure(graph.name):
                runner = torch._C._aoti.AOTIModelPackageLoader(str(Path(artifact_dir) / PACKAGE_NAME), graph.name,
                                                               False, 1, -1)
            needed = runner.get_constant_fqns()
            signature = _signature(runner, graph.name)
            missing = [name for name in needed if name not in weights]
            # Running a graph whose constants were never loaded segfaults: refuse before any call.
            if missing:
                raise ValueError(
                    f"neuronx_weights.safetensors lacks {len(missing)} weights that graph {graph.name} needs "
                    f"(e.g. {missing[:3]}); the artifact is incomplete or from another export. Re-export it."
                )
            # Each graph gets its own aliases of the weights (same storage, no copy). AOTInductor takes one more
            # reference to every user-managed constant and never drops it, which would keep all the weights
            # resident after the model is gone; emptying the aliases once the graph is collected releases them.
            for name, (shape, dtype) in signature["constants"].items():
                weight = weights.get(name)  # oneDNN-packed ones report their logical shape too
                if weight is not None and (
                        list(weight.shape) != shape or str(weight.dtype).removeprefix("torch.") != dtype):
                    raise ValueError(f"neuronx_weights.safetensors holds {name} as {tuple(weight.shape)} {weight.dtype}, but graph "
                                     f"{graph.name} was compiled for {tuple(shape)} {dtype}: the weights are from "
                                     f"another export. Re-export the model.")
            aliases = {name: weights[name].detach() for name in needed}
            runner.load_constants(aliases, use_inactive=False, check_full_update=True, user_managed=True)
            loaded[graph.name] = _fast_call(runner)
            loaded[graph.name].input_signature = signature["inputs"]
            weakref.finalize(loaded[graph.name], _release_aliases, list(aliases.values()))
        return loaded


@contextlib.contextmanager
def _extraction_removed_on_failure(graph_name: str):
    """The loader extracts the package into an `aotinductor_*` folder of the temp directory and leaves it there when
    it fails: remove the folders that appeared during the failed call and hold this graph."""
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("aotinductor_*"))
    try:
        yield
    except BaseException:
        for folder in set(temp.glob("aotinductor_*")) - before:
            if any(folder.rglob(f"{graph_name}*")):
                shutil.rmtree(folder, ignore_errors=True)
        raise


def check_package(path: Path) -> None:
    """Refuse a package whose entries would be extracted outside the loader's folder (an absolute path, a `..`
    component, a backslash, a symlink) or that is not a zip archive at all."""
    import stat
    import zipfile
    from pathlib import PurePosixPath

    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{path} is not a readable zip archive ({err}): re-export the model.") from None
    for entry in entries:
        name = entry.filename
        if (name.startswith("/") or "\\" in name or ".." in PurePosixPath(name).parts
                or stat.S_ISLNK(entry.external_attr >> 16)):
            raise ValueError(f"{path}: archive entry {name!r} would be extracted outside the package's folder (an "
                             f"absolute path, '..', or a symlink). Refusing to load it: this is not an export this "
                             f"package wrote.")


def _compile_graph(decoder, example_inputs, options: dict, build_dir: str, graph: GraphSpec) -> tuple[list, float]:
    """Export and compile one graph into `build_dir`: (its files, seconds taken)."""
    start = time.perf_counter()
    args = example_inputs(graph)
    program = torch.export.export(decoder, args, strict=False)
    options = {
        **options,
        "aot_inductor.package": True,
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.model_name_for_generated_files": graph.name,
        # A fresh directory per graph. By default AOTInductor writes into a directory named by the hash of the FX
        # code, which does not encode tensor shapes, and keeps files that already exist there: an export with
        # another sequence_length would reuse stale kernels.
        "aot_inductor.output_path": str(Path(build_dir) / graph.name),
        "aot_inductor.metadata": {SIGNATURE_KEY: json.dumps(graph_signature(decoder, args))},
    }
    with torch.no_grad(), decode_codegen(), objects_compiled_together():
        files = torch._inductor.aot_compile(program.module(), args, options=options)
    seconds = time.perf_counter() - start
    logger.info("Compiled graph %s (tokens=%d, window=%d) in %.1f s", graph.name, graph.tokens, graph.window, seconds)
    return files, seconds


def graph_signature(decoder, args) -> dict:
    """What a graph is compiled for: its inputs' and weights' shapes and dtypes (stored in the package, checked at
    load: a graph is never handed tensors of other shapes)."""
    def describe(tensor):
        return [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]

    return {"inputs": [describe(a) for a in args],
            "constants": {name: describe(t) for name, t in decoder.state_dict().items()}}


def _forked_worker_setup(threads: int) -> None:
    # OpenMP's thread pool does not survive fork: a worker's first parallel region would wait forever for threads
    # it does not have, so its tensor ops run on one thread. Inductor writes its kernels for the thread count
    # torch.get_num_threads() reports (and leaves `#pragma omp parallel` unbounded when that is every CPU): report
    # this process's so the C++ is the same as when compiled in it. Inductor compiles here, not in a pool of its own.
    from torch._inductor import config

    config.compile_threads = 1
    torch.set_num_threads(1)
    torch.get_num_threads = lambda: threads


def _release_aliases(aliases: list[torch.Tensor]) -> None:
    # Swapping in empty data (not set_(), which oneDNN-packed weights lack) drops the alias's hold on the weight.
    for alias in aliases:
        empty = torch.empty(0, dtype=alias.dtype)
        alias.data = empty.to_mkldnn() if alias.is_mkldnn else empty


def _signature(runner, graph_name: str) -> dict:
    try:
        signature = json.loads(runner.get_metadata()[SIGNATURE_KEY])
        signature["inputs"], signature["constants"]  # noqa: B018 (both present)
        return signature
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"graph {graph_name} of model.pt2 does not say what it was compiled for (no readable "
                         f"{SIGNATURE_KEY}): it is not an export of this package version. Re-export the model.") from None


def _fast_call(loader) -> Callable[[list], torch.Tensor]:
    # The flat entry point: AOTICompiledModel.__call__ would re-parse its pytree spec on every call.
    def call(flat_inputs: list):
        outputs = loader.boxed_run(flat_inputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)  # logits (and the tokens a sampling graph picks)

    return call


BACKEND = InductorBackend()
