"""The neuron backend: every graph lowered to StableHLO (torch-mlir) and run through PJRT (jaxlib).

Per graph the artifact holds the module as lowered (`<graph>.mlir`), as a portable StableHLO artifact
(`<graph>.mlirbc`, versioned bytecode), as an XLA HloModuleProto (`<graph>.hlo.pb`, what neuronx-cc reads for Inf2 and
Trn1), the PJRT executable compiled at export for the device found then (`<graph>.pjrt`: a reload does not compile)
and, where neuronx-cc ran, a NEFF for the instance type (`<graph>.neff`). `neuron_graphs.json` is the manifest:
argument order, shapes, dtypes, shardings, aliases, and every file's sha256.

The weights are graph arguments fed from the one neuronx_weights.safetensors, put on the device(s) once at load and shared by
every graph; the KV cache lives on the device(s) and is donated to each call, which returns it written.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import re
import time
from pathlib import Path

import torch

from ...configuration import GraphSpec
from ...instances import INSTANCE_TYPES
from ...digests import file_sha256
from ...modeling.decoder import StaticDecoder
from ...modeling.sharding import KV_CACHE_AXIS, ShardLayout
from ..base import Backend, CompiledGraph, DeviceLogits
from ..workers import compile_workers, map_in_workers
from . import neuronx_cc
from .pjrt import PjrtGraph, Placement, default_client, platform_version, to_numpy, to_torch
from .stablehlo import NeuronKernels, StableHLOGraph, lower_graph, partitioned

logger = logging.getLogger(__name__)

MANIFEST_NAME = "neuron_graphs.json"
MANIFEST_FORMAT = 1
TOOLCHAIN = ("torch-mlir", "jax", "jaxlib")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class NeuronBackend(Backend):
    name = "neuron"
    targets_neuron_cores = True
    shards = True

    quantizations = ("int8",)  # int8 weights widened inside each projection (Kernels.linear), which XLA fuses

    def kernels(self, dtype: torch.dtype, batch_size: int, quantization: str | None = None) -> NeuronKernels:
        return NeuronKernels()

    def uses_host_memory(self) -> bool:
        # Without AWS's plugin the graphs run on the XLA CPU device: the KV cache is allocated in full on the host.
        return importlib.util.find_spec("libneuronxla") is None

    def check_compiler_args(self, compiler_args) -> None:
        neuronx_cc.check_flags(compiler_args)

    def environment_compiler_args(self) -> tuple[str, ...]:
        return neuronx_cc.environment_flags()

    def check_toolchain(self) -> None:
        missing = [name for name in TOOLCHAIN if importlib.util.find_spec(name.replace("-", "_")) is None]
        if missing:
            raise RuntimeError(f"The neuron backend lowers graphs with torch-mlir and runs them with jax/jaxlib; "
                               f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed. "
                               f"Install them with: pip install 'optimum-neuronx[neuron]'.")

    def compiler_version(self) -> str:
        return ", ".join(f"{name} {_version(name)}" for name in ("torch-mlir", "jaxlib"))

    def target(self, kernels=None, dtype=None) -> str:
        return "stablehlo"  # runs wherever a PJRT client does; the executables' platform is checked at load

    def graph_files(self, out_dir: Path) -> tuple[str, ...]:
        manifest = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
        return (MANIFEST_NAME, *(name for entry in manifest["graphs"].values() for name in entry["files"].values()))

    # -- export -----------------------------------------------------------------------------------
    def compile(self, decoder, graphs, example_inputs, out_dir, neuron_config) -> dict[str, float]:
        out_dir = Path(out_dir)
        tp = neuron_config.tp_degree
        layout = ShardLayout.for_spec(decoder.spec, tp)
        sharded = _sharded_decoder(decoder, layout)
        cache = torch.zeros(sharded.spec.kv_cache_shape(neuron_config.batch_size, neuron_config.sequence_length),
                            dtype=neuron_config.torch_dtype)
        axes = {name: weight.dim() + axis for name, weight in sharded.state_dict().items()
                if (axis := layout.axis(name)) is not None}
        if tp > 1:
            axes["kv_cache"] = KV_CACHE_AXIS

        def lower(graph: GraphSpec) -> tuple[StableHLOGraph, float]:
            start = time.perf_counter()
            inputs = sharded.graph_inputs(graph, neuron_config.batch_size, cache,
                                          neuron_config.on_device_sampling)
            with torch.no_grad():
                lowered = lower_graph(sharded, inputs, graph.name)
            return lowered, time.perf_counter() - start

        # Lowering is single-threaded Python: graphs side by side in forked workers (before any PJRT client runs).
        lowered = map_in_workers(lower, graphs, compile_workers(len(graphs)), functools.partial(torch.set_num_threads, 1),
                                 lambda graph: f"graph {graph.name}", desc="Lowering graphs", unit="graph")
        client = default_client()
        times, entries = {}, {}
        for spec, (graph, seconds) in zip(graphs, lowered):
            start = time.perf_counter()
            graph = partitioned(graph, axes, tp)
            executable = PjrtGraph.compile(graph, client)
            files = _write_graph_files(out_dir, graph, executable.serialize())
            entries[graph.name] = {**graph.to_dict(), "files": files}
            times[graph.name] = seconds + time.perf_counter() - start
            logger.info("Lowered and compiled graph %s (tokens=%d, window=%d) in %.1f s", graph.name, spec.tokens,
                        spec.window, times[graph.name])
        instance = neuron_config.instance
        neff = None
        if neuronx_cc.available() and client.platform != "neuron":
            suffix = neuronx_cc.SOURCE_SUFFIX[instance.target]
            sources = {name: out_dir / f"{name}{suffix}" for name in entries}
            neff_times = neuronx_cc.compile_neffs(sources, out_dir, instance, neuron_config.auto_cast_type,
                                                  neuron_config.compiler_args)
            for name, seconds in neff_times.items():
                entries[name]["files"]["neff"] = f"{name}.neff"
                times[name] += seconds
            neff = {"instance_type": instance.name, "target": instance.target,
                    "argv": neuronx_cc.argv(Path(f"<graph>{suffix}"), Path("<graph>.neff"), instance,
                                            neuron_config.auto_cast_type, neuron_config.compiler_args)}
        for entry in entries.values():
            entry["sha256"] = {name: file_sha256(out_dir / name) for name in entry["files"].values()}
        manifest = {
            "format": MANIFEST_FORMAT,
            "tp_degree": tp,
            "layout": layout.to_dict(),
            "instance_type": instance.name,
            "executables": {"platform": client.platform, "platform_version": platform_version(client)},
            "neff": neff,
            "graphs": entries,
        }
        (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
        return times

    # -- load ---------------------------------------------------------------------------------------
    def load(self, artifact_dir, graphs, weights) -> dict[str, CompiledGraph]:
        artifact_dir = Path(artifact_dir)
        manifest = read_manifest(artifact_dir)
        client = default_client()
        portable = not executables_match(manifest, client, artifact_dir)
        if portable:
            logger.warning("%s holds PJRT executables compiled for %r, but this machine runs %r: compiling its StableHLO "
                        "graphs for this platform.", artifact_dir, manifest["executables"]["platform_version"],
                        platform_version(client))
        layout = ShardLayout(**manifest["layout"])
        arranged = layout.arrange(dict(weights))
        loaded, device_weights = {}, {}
        for spec in graphs:
            entry = manifest["graphs"].get(spec.name)
            if entry is None:
                raise ValueError(f"{artifact_dir / MANIFEST_NAME} has no graph {spec.name}; the export is incomplete. "
                                 f"Re-export the model.")
            files = entry["files"]
            graph = StableHLOGraph.from_dict(entry, (artifact_dir / files["mlir"]).read_text())
            executable = (PjrtGraph.compile(graph, client) if portable
                          else PjrtGraph.deserialize(graph, (artifact_dir / files["pjrt"]).read_bytes(), client))
            for argument in graph.arguments:
                if argument.kind != "weight" or argument.name in device_weights:
                    continue
                if argument.name not in arranged:
                    raise ValueError(f"neuronx_weights.safetensors lacks {argument.name}, which graph {graph.name} takes; the "
                                     f"artifact is incomplete or from another export. Re-export it.")
                tensor = arranged[argument.name]
                if tuple(tensor.shape) != argument.shape or str(tensor.dtype).removeprefix("torch.") != argument.dtype:
                    raise ValueError(f"neuronx_weights.safetensors holds {argument.name} as {tuple(tensor.shape)} "
                                     f"{tensor.dtype}; graph {graph.name} takes {argument.shape} {argument.dtype}. "
                                     f"The artifact is from another export: re-export it.")
                device_weights[argument.name] = executable.placement.put(tensor, argument.sharded_axis)
            loaded[spec.name] = NeuronGraph(executable, device_weights)
        return loaded

    def new_kv_cache(self, graphs, shape, dtype):
        graph = next(iter(graphs.values()))
        argument = graph.executable.graph.arguments[graph.executable.graph.argument_index("kv_cache")]
        return DeviceKVCache(graph.executable.placement, argument.shape, dtype, argument.sharded_axis)

    def reorder_kv_cache(self, kv, rows):
        kv.reorder(rows)


def _sharded_decoder(decoder: StaticDecoder, layout: ShardLayout) -> StaticDecoder:
    """`decoder` with its weights in `layout` (KV heads repeated, fused projections shard-major)."""
    if layout.shards == 1:
        return decoder
    with torch.device("meta"):
        sharded = StaticDecoder(layout.sharded_spec(decoder.spec), NeuronKernels(layout.shards), decoder.quantization)
    sharded.load_state_dict(layout.arrange(decoder.state_dict()), strict=True, assign=True)
    return sharded.eval()


def _write_graph_files(out_dir: Path, graph: StableHLOGraph, executable: bytes) -> dict[str, str]:
    from jaxlib import xla_client
    from jaxlib.mlir.dialects import stablehlo

    files = {"mlir": f"{graph.name}.mlir", "mlirbc": f"{graph.name}.mlirbc", "hlo": f"{graph.name}.hlo.pb",
             "pjrt": f"{graph.name}.pjrt"}
    (out_dir / files["mlir"]).write_text(graph.text)
    # Versioned bytecode (VHLO) at the version this jaxlib reads: newer StableHLO consumers keep reading it.
    (out_dir / files["mlirbc"]).write_bytes(
        stablehlo.serialize_portable_artifact_str(graph.text, stablehlo.get_current_version()))
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(graph.text, use_tuple_args=False,
                                                                      return_tuple=True)
    (out_dir / files["hlo"]).write_bytes(computation.as_serialized_hlo_module_proto())
    (out_dir / files["pjrt"]).write_bytes(executable)
    return files


def read_manifest(artifact_dir: Path) -> dict:
    """The manifest, every file it names a plain name in the export directory (ValueError naming it otherwise). The
    files' digests are not checked again here: the graphs load from the private copy the artifact check verified
    against neuron_config.json, which lists every file."""
    path = Path(artifact_dir) / MANIFEST_NAME
    redo = "Re-export the model."
    try:
        manifest = json.loads(path.read_text())
        if manifest["format"] != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest['format']}, this package reads {MANIFEST_FORMAT}")
        for entry in manifest["graphs"].values():
            for name in entry["sha256"]:
                if Path(name).name != name:
                    raise ValueError(f"file name {name!r} is not a plain name in the export directory")
    except (OSError, KeyError, TypeError, json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{path}: {err}. {redo}") from None
    return manifest


# neuronx-cc target -> the NeuronCore generation its devices have (as the Neuron plugin names device kinds).
CORE_GENERATION = {"inf2": "v2", "trn1": "v2", "trn2": "v3", "trn3": "v4"}


def executables_match(manifest: dict, client, artifact_dir: Path) -> bool:
    """Whether the serialized executables were compiled for this client's platform and plugin version (else the
    portable StableHLO graphs are compiled at load). An export made for another generation of NeuronCores is refused
    on a Neuron device, naming both: its NEFFs and memory plan are for other cores."""
    target = INSTANCE_TYPES[manifest["instance_type"]].target
    kind = str(getattr(client.devices()[0], "device_kind", ""))
    found = re.search(r"v(\d)\b", kind)
    if client.platform == "neuron" and found and f"v{found.group(1)}" != CORE_GENERATION[target]:
        raise ValueError(f"{artifact_dir} was compiled for {manifest['instance_type']} (NeuronCore-"
                         f"{CORE_GENERATION[target]}), but this machine's Neuron devices are {kind!r}. Re-export the "
                         f"model with instance_type set to this instance (e.g. instance_type="
                         f"'{_family_of_generation(found.group(1))}').")
    compiled = manifest["executables"]
    return compiled["platform"] == client.platform and compiled["platform_version"] == platform_version(client)


def _family_of_generation(generation: str) -> str:
    return next((t for t, g in CORE_GENERATION.items() if g == f"v{generation}"), "?")


class NeuronGraph:
    """A loaded graph as the runtime calls it: the decoder's inputs (torch tensors, the cache a DeviceKVCache) in,
    float32 logits out; the weights are already on the device(s)."""

    def __init__(self, executable: PjrtGraph, device_weights: dict):
        self.executable = executable
        self._weights = device_weights
        self._inputs = [a.name for a in executable.graph.arguments]
        self._cache_output = executable.graph.outputs.index("kv_cache")
        # The decoder's inputs as compiled (PJRT also refuses buffers of other shapes at every call).
        self.input_signature = [[list(a.shape), a.dtype] for a in executable.graph.arguments if a.kind == "input"]
        # The logits, then any other result (the tokens an on-device sampling graph picks)
        self._results = [i for i, name in enumerate(executable.graph.outputs) if name != "kv_cache"]

    def __call__(self, inputs: list) -> torch.Tensor:
        given = dict(zip(StaticDecoder.INPUT_NAMES, inputs))
        cache = given["kv_cache"]
        given["kv_cache"] = cache.buffer
        outputs = self.executable([self._weights[name] if name in self._weights else given[name]
                                   for name in self._inputs])
        cache.buffer = outputs[self._cache_output]
        if len(self._results) == 1:
            return to_torch(outputs[self._results[0]])
        logits, tokens = (outputs[i] for i in self._results)  # on-device sampling: only the tokens come back now
        return DeviceLogits(functools.partial(to_torch, logits)), to_torch(tokens)


class DeviceKVCache:
    """The KV cache on the device(s), laid out as the graphs take it; each call swaps in the buffer it returns."""

    def __init__(self, placement: Placement, shape: tuple[int, ...], dtype: torch.dtype, axis):
        self.placement, self.dtype, self.axis = placement, dtype, axis
        self.buffer = placement.put(to_numpy(torch.zeros(shape, dtype=dtype)), axis)
        self._reorders = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.buffer.shape)

    def reorder(self, rows: torch.Tensor) -> None:
        """Batch rows 0 .. n - 1 become rows `rows` (beam search), on the device."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        n = rows.numel()
        if n not in self._reorders:
            sharding = self.placement.sharding(len(self.shape), self.axis)
            self._reorders[n] = jax.jit(lambda kv, r: kv.at[:, :, :n].set(jnp.take(kv, r, axis=2)),
                                        out_shardings=sharding, donate_argnums=0)
        self.buffer = self._reorders[n](self.buffer, np.asarray(rows, dtype=np.int32))


BACKEND = NeuronBackend()
