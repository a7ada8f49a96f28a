"""Export: Transformers checkpoint -> artifact directory (weights + compiled graphs + metadata)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..artifacts import (WEIGHTS_NAME, ArtifactError, atomic_directory, copy_artifact_files, read_artifact,
                         write_neuron_config)
from ..cache import CacheKey, CompileCache, read_entry_meta
from ..configuration import NeuronConfig
from ..digests import file_sha256
from ..modeling.decoder import StaticDecoder
from ..modeling.quantization import dequantize_weights, quantize_weights
from ..stamp import ExportStamp
from ..trust import record_produced_here
from ..weights_io import save_weights
from .plan import ExportPlan, plan_export
from .registry import get_export_config, load_model_config

logger = logging.getLogger(__name__)


def export(model_id: str, output_dir: str | Path, neuron_config: NeuronConfig,
           hf_kwargs: Optional[dict] = None, cache: Optional[CompileCache] = None,
           from_export: bool = False, config=None, rebuilt_stamp: Optional[ExportStamp] = None) -> ExportStamp:
    """Compile `model_id` (Hub id or directory) for `neuron_config` into `output_dir`; return the stamp.

    With a `cache`, graphs compiled earlier for the same decoder and NeuronConfig are copied instead of compiled
    ("cache hit": the weights may differ, e.g. a fine-tune), and new ones are stored; concurrent exports of the same
    key wait for each other. The Hub cache repo's entries hold compiled native code: they are used only with
    `trust_remote_code=True` in `hf_kwargs`. `from_export`: `model_id` is an export directory whose graphs are
    rebuilt here from its config and weights (`artifact_state_dict`). `config`: the checkpoint's Transformers config
    where the caller read it already; `rebuilt_stamp`: with `from_export`, the export's stamp where it was read.
    """
    prepared = prepare(model_id, neuron_config, hf_kwargs, from_export=from_export, config=config,
                       rebuilt_stamp=rebuilt_stamp)
    if cache is None:
        return _write_export(prepared, output_dir)
    key = prepared.plan.cache_key()
    trust_remote_code = bool((hf_kwargs or {}).get("trust_remote_code"))
    with cache.lock(key):
        entry = cache.lookup(key, trusted=trust_remote_code) or _fetch_trusted(cache, key, trust_remote_code)
        if entry is not None:
            logger.info("Compile cache hit %s (%s): nothing to compile", key.digest, entry)
            return _write_export(prepared, output_dir, cached_graphs=entry)
        logger.info("Compile cache miss %s: %s", key.digest, cache.miss_reason(key))
        stamp = _write_export(prepared, output_dir)
        cache.store(key, Path(output_dir), tuple(name for name in stamp.files if name != WEIGHTS_NAME),
                    dict(stamp.compile_time_s))
        logger.info("Stored the compiled graphs in the compile cache as %s", key.digest)
        cache.push(key)
        return stamp


def _fetch_trusted(cache: CompileCache, key: CacheKey, trust_remote_code: bool):
    """The Hub cache repo's entry for `key`, when the caller trusts its native code."""
    if not cache.hub_repo:
        return None
    if not trust_remote_code:
        logger.info("The Hub compile cache %s is not consulted: its entries hold compiled native code, which runs only "
                    "with trust_remote_code=True (CLI: --trust-remote-code). Compiling here.", cache.hub_repo)
        return None
    return cache.fetch(key)


def artifact_state_dict(artifact_dir: str | Path, config=None) -> dict:
    """An export's weights back in Transformers' names and shapes (its weights file is data: read by the safetensors
    library), every tensor checked against the model its config.json (`config`, read if not given) describes:
    ArtifactError naming the tensor and both shapes where they disagree."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    artifact_dir = Path(artifact_dir)
    config = config if config is not None else load_model_config(artifact_dir)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(config).state_dict()
    weights = dequantize_weights(load_file(str(artifact_dir / WEIGHTS_NAME)))  # int8 ones back to float32
    redo = "The export's config.json and neuronx_weights.safetensors do not belong together: re-export the model."
    try:
        restored = get_export_config(config.model_type).restore_weights(weights, expected)
    except KeyError as err:
        raise ArtifactError(f"{artifact_dir}: neuronx_weights.safetensors holds {err.args[0]}, which config.json's model does "
                            f"not have. {redo}") from None
    except (RuntimeError, ValueError) as err:
        raise ArtifactError(f"{artifact_dir}: neuronx_weights.safetensors does not fit config.json ({err}). {redo}") from None
    for name, tensor in restored.items():
        if name not in expected:
            raise ArtifactError(f"{artifact_dir}: neuronx_weights.safetensors holds {name}, which config.json's model does not "
                                f"have. {redo}")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ArtifactError(f"{artifact_dir}: {name} is {tuple(tensor.shape)} in neuronx_weights.safetensors but "
                                f"{tuple(expected[name].shape)} in config.json's model. {redo}")
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(restored) - tied)
    if missing:
        raise ArtifactError(f"{artifact_dir}: neuronx_weights.safetensors lacks {missing[:3]} ({len(missing)} tensors). {redo}")
    return restored


@dataclass(frozen=True)
class PreparedExport:
    """An export planned and its weights loaded and converted into the plan's decoder: ready to compile."""

    plan: ExportPlan
    decoder: StaticDecoder
    generation_config: object
    start: float


def prepare(model_id: str, neuron_config: NeuronConfig, hf_kwargs: Optional[dict] = None, *,
            from_export: bool = False, config=None, rebuilt_stamp: Optional[ExportStamp] = None) -> PreparedExport:
    """Plan the export (plan.plan_export: every check) and load + convert the weights: everything before compiling.
    The checkpoint is loaded in the export's dtype (in float32 when quantizing: int8 is rounded from that)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    plan = plan_export(model_id, neuron_config, hf_kwargs, from_export=from_export, config=config,
                       rebuilt_stamp=rebuilt_stamp)
    nc, spec = plan.neuron_config, plan.spec
    # Quantized exports convert in float32 and round each projection to int8 from that, not from the dtype.
    dtype = torch.float32 if plan.quantization else nc.torch_dtype
    start = time.perf_counter()
    decoder = plan.new_decoder()
    generation_config = None
    if from_export:
        state = artifact_state_dict(model_id, plan.config)
        if (Path(model_id) / "generation_config.json").is_file():
            generation_config = GenerationConfig.from_pretrained(model_id)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, **plan.hf_kwargs)
        state, generation_config = hf_model.state_dict(), hf_model.generation_config
        del hf_model
    weights = get_export_config(plan.model_type).convert_weights(state, decoder.parameter_names(), dtype,
                                                                 spec.num_layers)
    del state
    if plan.quantization:
        weights = quantize_weights(weights, nc.torch_dtype)
    decoder.load_state_dict(decoder.arrange_weights(weights), strict=False, assign=True)
    decoder.eval()
    logger.info("Loaded and converted weights in %.1f s", time.perf_counter() - start)
    return PreparedExport(plan, decoder, generation_config, start)


def _write_export(prepared: PreparedExport, output_dir: str | Path, cached_graphs: Optional[Path] = None
                  ) -> ExportStamp:
    """Write the export: weights, graphs (compiled now, or copied from the compile cache entry `cached_graphs`),
    configs and tokenizer, then the stamp."""
    from transformers import GenerationConfig

    plan, decoder = prepared.plan, prepared.decoder
    nc = plan.neuron_config
    with atomic_directory(output_dir) as staging:
        save_weights(dict(decoder.state_dict()), staging / WEIGHTS_NAME)
        if cached_graphs is None:
            kv_cache = torch.zeros(plan.spec.kv_cache_shape(nc.batch_size, nc.sequence_length), dtype=nc.torch_dtype)
            with torch.no_grad():
                times = plan.backend.compile(
                    decoder, list(plan.graphs),
                    lambda g: decoder.graph_inputs(g, nc.batch_size, kv_cache, nc.on_device_sampling), staging, nc)
            graph_files = plan.backend.graph_files(staging)
        else:
            entry = read_entry_meta(cached_graphs)
            graph_files, times = tuple(entry["sha256"]), entry["compile_time_s"]
            copy_artifact_files(cached_graphs, staging, include=graph_files, link=False)
        # Configs are written from files, never from a live model (its config carries runtime-only fields).
        plan.config.save_pretrained(staging)
        generation_config = prepared.generation_config
        if not isinstance(generation_config, GenerationConfig):
            generation_config = GenerationConfig.from_model_config(plan.config)
        generation_config.save_pretrained(staging)
        _save_tokenizer(plan.model_id, staging, dict(plan.hf_kwargs))
        stamp = write_neuron_config(staging, neuron_config=nc, graphs=list(plan.graphs), backend=plan.backend_stamp,
                                    model_type=plan.model_type, spec=plan.spec, compile_times=times,
                                    files=(WEIGHTS_NAME, *graph_files), source=plan.source)
    record_produced_here(output_dir, "export", stamp.identity)
    logger.info("Exported %s to %s in %.1f s", plan.model_id, output_dir, time.perf_counter() - prepared.start)
    return stamp


def restore_source_weights(artifact_dir: str | Path, destination: str | Path, hf_kwargs: Optional[dict] = None) -> Path:
    """Complete an export pushed without its weights (`push_to_hub(include_weights=False)`): convert the weights of
    the source checkpoint it names (repo id and commit) and write the export with them to `destination`, refusing
    weights whose sha256 is not the one the export recorded."""
    artifact_dir = Path(artifact_dir)
    stamp = read_artifact(artifact_dir, optional=(WEIGHTS_NAME,))
    source = stamp.source
    if not stamp.source_repo:
        raise ArtifactError(f"{artifact_dir} has no {WEIGHTS_NAME} and names no source checkpoint to take the weights "
                            f"from. Push the export with include_weights=True, or re-export the model.")
    kwargs = {**(hf_kwargs or {}), "revision": source.get("revision")}
    if source.get("subfolder"):
        kwargs["subfolder"] = source["subfolder"]
    where = f"{source['repo_id']}@{source.get('revision')}"
    logger.info("%s was pushed without its weights: converting them from %s", artifact_dir, where)
    prepared = prepare(source["repo_id"], stamp.neuron_config, kwargs)
    expected = stamp.files[WEIGHTS_NAME].sha256
    with atomic_directory(destination) as staging:
        copy_artifact_files(artifact_dir, staging)
        save_weights(dict(prepared.decoder.state_dict()), staging / WEIGHTS_NAME)
        found = file_sha256(staging / WEIGHTS_NAME)
        if found != expected:
            raise ArtifactError(f"The weights of {where}, converted here, have sha256 {found}, but {artifact_dir} was "
                                f"exported from weights with sha256 {expected}: the source changed or is not the "
                                f"one the export was made from. Re-export the model from the checkpoint you have.")
    return Path(destination)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _save_tokenizer(model_id: str, directory: Path, hf_kwargs: dict) -> None:
    from transformers import AutoTokenizer

    local = Path(model_id)
    if local.is_dir() and not any((local / name).is_file() for name in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer files; the export has none either.", model_id)
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **hf_kwargs)
    except (OSError, ValueError, TypeError) as err:  # a checkpoint without a tokenizer is still exportable
        logger.warning("No tokenizer saved with the export: %s", str(err).splitlines()[0])
        return
    tokenizer.save_pretrained(directory)
