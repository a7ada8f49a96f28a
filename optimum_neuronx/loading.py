"""Loading an export, in one pass: find it (a directory, or a Hub download completed with its source's weights),
decide what its compiled graphs may do here (trust.py: load them, or rebuild them from its config and weights), read
it once, and hand its graphs and weights to the backend. NeuronModelForCausalLM is built from the result."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch
from transformers import GenerationConfig

from .artifacts import (WEIGHTS_NAME, ArtifactError, compiled_code_problem, export_identity, read_artifact,
                        verified_copy, weights_source)
from .backends import get_backend
from .backends.base import Backend, CompiledGraph
from .cache import CompileCache
from .configuration import NEURON_CONFIG_NAME, NeuronConfig
from .exporters.registry import get_export_config, load_model_config
from .memory import check_fits_host_memory
from .modeling.decoder import StaticDecoder
from .modeling.spec import DecoderSpec
from .stamp import ExportStamp
from .tempdirs import temporary_directory
from .trust import TrustDecision, trust_decision
from .weights_io import load_weights

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedExport:
    """An export read and its graphs loaded by its backend."""

    config: object  # the checkpoint's Transformers config (e.g. LlamaConfig)
    neuron_config: NeuronConfig
    spec: DecoderSpec
    backend: Backend
    graphs: dict[str, CompiledGraph]
    kv_cache: object  # the zeroed KV cache the graphs take (the backend's: a host tensor, or a device handle)
    weights: dict  # the graphs point into these tensors: keep them alive as long as the graphs
    artifact_dir: Path
    generation_config: Optional[GenerationConfig] = None
    tmpdir: object = None  # owns the directory of an export made in this process and not saved yet


def resolve(model_id: str | Path, kwargs: dict, cache: CompileCache) -> tuple[Path, bool]:
    """The export's directory, and whether it is new to this machine (downloaded, or completed with its source's
    weights: its digests are checked)."""
    artifact_dir, downloaded = _artifact_dir(model_id, kwargs)
    if not (artifact_dir / WEIGHTS_NAME).exists() and weights_source(artifact_dir):
        return _with_source_weights(artifact_dir, cache, kwargs), True
    return artifact_dir, downloaded


def load_trusted(artifact_dir: Path, downloaded: bool, trust_remote_code: bool, cache: Optional[CompileCache],
                 huge_pages: Optional[bool]) -> LoadedExport:
    """Load an export whose compiled graphs may run here (trust.trust_decision); rebuild the graphs of any other
    here from its config and weights first."""
    decision = trust_decision(artifact_dir, downloaded, trust_remote_code)
    if decision.action == "load":
        return load_export(artifact_dir, huge_pages=huge_pages, decision=decision)
    neuron_config = decision.stamp.neuron_config
    if decision.cannot_run:
        logger.warning("The compiled graphs of %s cannot run here: %s. Rebuilding them here from its config and "
                       "weights (once: the compile cache keeps them).", artifact_dir, decision.cannot_run)
    else:
        logger.info("%s was not exported on this machine: its compiled graphs are native code, which is loaded only "
                    "with trust_remote_code=True. Rebuilding the graphs here from its config and weights (once: the "
                    "compile cache keeps them).", artifact_dir)
    if neuron_config.compiler_args and not trust_remote_code:
        logger.warning("%s's compiler_args %s are not applied to its rebuild: an export's compiler options run only "
                       "with trust_remote_code=True (the graphs compute the same; only how they are compiled "
                       "changes).", artifact_dir, list(neuron_config.compiler_args))
        neuron_config = dataclasses.replace(neuron_config, compiler_args=())
    return export_and_load(str(artifact_dir), neuron_config, cache=cache, huge_pages=huge_pages, from_export=True,
                           rebuilt_stamp=decision.stamp)


def export_and_load(model_id: str, neuron_config: NeuronConfig, *, cache: Optional[CompileCache],
                    huge_pages: Optional[bool], hf_kwargs: Optional[dict] = None,
                    from_export: bool = False, config=None,
                    rebuilt_stamp: Optional[ExportStamp] = None) -> LoadedExport:
    """Export `model_id` (a checkpoint, or with `from_export` an export to rebuild) into a directory this process
    owns until it is saved, and load it. `config`: the checkpoint's Transformers config where the caller read it;
    `rebuilt_stamp`: the rebuilt export's stamp, as the trust decision read it."""
    from .exporters.export import export

    tmpdir = temporary_directory("export")
    out_dir = Path(tmpdir.name) / "model"
    stamp = export(model_id, out_dir, neuron_config, hf_kwargs=hf_kwargs or {}, cache=cache, from_export=from_export,
                   config=config, rebuilt_stamp=rebuilt_stamp)
    return load_export(out_dir, tmpdir=tmpdir, compiled=True, huge_pages=huge_pages, stamp=stamp)


def load_export(artifact_dir: Path, *, tmpdir=None, compiled: bool = False, huge_pages: Optional[bool] = None,
                decision: Optional[TrustDecision] = None, stamp: Optional[ExportStamp] = None) -> LoadedExport:
    """Load the export in `artifact_dir` as it is (`decision`: the trust decision to load it, which read it;
    `stamp`: what this process's export of it wrote). The compiled graphs and configs load from a private copy
    checked against the digests as it is made: the code that runs is the code that was verified. An export whose
    graphs cannot run here raises ArtifactError."""
    start = time.perf_counter()
    if decision is not None:
        stamp, backend, problem = decision.stamp, decision.backend, decision.cannot_run
    else:
        stamp = stamp or read_artifact(artifact_dir)
        backend = get_backend(stamp.neuron_config.backend)
        problem = compiled_code_problem(stamp, backend)
    if problem:
        raise ArtifactError(f"{artifact_dir} cannot run here: {problem}. Load it with "
                            f"NeuronModelForCausalLM.from_pretrained, which rebuilds its graphs here.")
    neuron_config = stamp.neuron_config
    with verified_copy(artifact_dir, stamp) as private:
        config = load_model_config(private)
        spec = stamp.spec
        if spec is None:  # format 7 recorded no spec: derived from config.json as it was then
            spec = get_export_config(config.model_type).decoder_spec(config, neuron_config)
        else:
            _check_config_against_spec(artifact_dir, config, stamp)
        in_memory = use_huge_pages(huge_pages, backend)
        kv_shape = spec.kv_cache_shape(neuron_config.batch_size, neuron_config.sequence_length)
        if backend.uses_host_memory():
            kv_bytes = math.prod(kv_shape)
            weight_bytes = (Path(artifact_dir) / WEIGHTS_NAME).stat().st_size if in_memory else 0
            check_fits_host_memory(kv_bytes * neuron_config.torch_dtype.itemsize + weight_bytes,
                                   f"Loading {artifact_dir} (its KV cache{' and weights' if in_memory else ''})")
        weights = load_weights(artifact_dir, backend, stamp.backend, huge_pages=in_memory)
        graphs = backend.load(private, list(stamp.graphs), weights)
        kv_cache = backend.new_kv_cache(graphs, kv_shape, neuron_config.torch_dtype)
        _check_graph_inputs(graphs, neuron_config, tuple(kv_cache.shape))
        generation_config = None
        if (private / "generation_config.json").is_file():
            generation_config = GenerationConfig.from_pretrained(private)
    logger.info("Loaded %d compiled graphs from %s in %.2f s%s", len(graphs), artifact_dir,
                time.perf_counter() - start, "" if compiled else " (no compilation)")
    return LoadedExport(config, neuron_config, spec, backend, graphs, kv_cache, weights, Path(artifact_dir),
                        generation_config, tmpdir)


def _check_config_against_spec(artifact_dir: Path, config, stamp: ExportStamp) -> None:
    """config.json (the model's config the runtime exposes) against the spec the graphs were compiled from."""
    spec, redo = stamp.spec, "the export was edited after it was compiled. Re-export the model."
    if stamp.model_type != config.model_type:
        raise ArtifactError(f"{artifact_dir}: {NEURON_CONFIG_NAME} records a {stamp.model_type} model but config.json "
                            f"is {config.model_type}'s: {redo}")
    for field, compiled in (("num_hidden_layers", spec.num_layers), ("hidden_size", spec.hidden_size),
                            ("vocab_size", spec.vocab_size)):
        if getattr(config, field, None) != compiled:
            raise ArtifactError(f"{artifact_dir}: config.json gives {field} = {getattr(config, field, None)!r} but "
                                f"the graphs were compiled for {compiled} ({NEURON_CONFIG_NAME}'s decoder spec): "
                                f"{redo}")


def _check_graph_inputs(graphs: dict, nc: NeuronConfig, kv_shape: tuple) -> None:
    """Refuse graphs compiled for other input shapes than this export's configs give (an export edited after it was
    compiled): they would be handed tensors they read out of bounds."""
    kv_cache = torch.empty(kv_shape, dtype=nc.torch_dtype, device="meta")
    for graph in nc.graphs():
        compiled = graphs[graph.name].input_signature
        given = [[list(t.shape), str(t.dtype).removeprefix("torch.")]
                 for t in StaticDecoder.graph_inputs(graph, nc.batch_size, kv_cache, nc.on_device_sampling)]
        if len(compiled) != len(given):
            raise ArtifactError(f"graph {graph.name} was compiled for {len(compiled)} inputs, but this export's "
                                f"neuron_config.json gives it {len(given)}: the export was edited after it was "
                                f"compiled. Re-export the model.")
        for input_name, expected, actual in zip(StaticDecoder.INPUT_NAMES, compiled, given):
            if [list(expected[0]), expected[1]] != actual:
                raise ArtifactError(
                    f"graph {graph.name} was compiled for {input_name} {tuple(expected[0])} {expected[1]}, but this "
                    f"export's config.json and neuron_config.json give {tuple(actual[0])} {actual[1]}: the export "
                    f"was edited after it was compiled. Re-export the model.")


def use_huge_pages(asked: Optional[bool], backend) -> bool:
    """Whether to load weights in huge pages: as asked, else where the backend streams them from host memory and
    the kernel has transparent huge pages."""
    from .huge_pages import THP_SETTING, huge_pages_available, transparent_huge_pages

    if asked is None:
        return backend.streams_host_weights and huge_pages_available()
    if asked and not huge_pages_available():
        mode = transparent_huge_pages()
        raise ValueError(f"huge_pages=True needs Linux transparent huge pages, but {THP_SETTING} "
                         f"{'says ' + repr(mode) if mode else 'cannot be read'}. Pass huge_pages=False (the weights "
                         f"are then memory-mapped), or enable them (echo madvise > {THP_SETTING}).")
    return bool(asked)


def _with_source_weights(artifact_dir: Path, cache: CompileCache, kwargs: dict) -> Path:
    """An export pushed without its weights, completed with its source checkpoint's (converted here, checked against
    the recorded digest) in a directory of the compile cache, reused on later loads."""
    from .exporters.export import restore_source_weights

    destination = cache.root / "with-source-weights" / export_identity(artifact_dir)[:32]
    if (destination / WEIGHTS_NAME).is_file():
        try:
            read_artifact(destination, check_digests=True)
            return destination
        except ArtifactError:
            pass
    hf_kwargs = {k: kwargs[k] for k in ("token", "cache_dir", "local_files_only", "force_download") if k in kwargs}
    return restore_source_weights(artifact_dir, destination, hf_kwargs)


def _artifact_dir(model_id: str | Path, kwargs: dict) -> tuple[Path, bool]:
    """The export's directory, and whether it was downloaded."""
    path = Path(model_id)
    if path.is_dir():
        return path, False
    text = str(model_id)
    if path.is_absolute() or text.startswith(".") or text.count("/") > 1 or isinstance(model_id, Path):
        raise ArtifactError(f"{model_id} is not a directory (and not a Hub repo id): nothing to load.")
    from .hub import DOWNLOAD_KWARGS, download_artifact

    return download_artifact(text, **{k: kwargs[k] for k in DOWNLOAD_KWARGS if k in kwargs}), True
