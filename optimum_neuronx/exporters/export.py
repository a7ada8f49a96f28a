"""Export: Transformers checkpoint -> artifact directory (weights + compiled graphs + metadata)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..artifacts import (WEIGHTS_NAME, ArtifactError, atomic_directory, copy_artifact_files, read_artifact,
                         write_neuron_config)
from ..cache import CacheKey, CompileCache, cache_key, read_entry_meta
from ..configuration import NEURON_CONFIG_NAME
from ..digests import file_sha256
from ..backends import Backend, get_backend
from ..configuration import GraphSpec, NeuronConfig
from ..memory import check_fits_host_memory, check_fits_neuron_cores, estimate_memory
from ..modeling.decoder import StaticDecoder
from ..modeling.spec import DecoderSpec
from ..modeling.quantization import dequantize_weights, quantize_weights
from ..modeling.sharding import ShardLayout
from ..trust import record_produced_here
from ..version import ARTIFACT_FORMAT_VERSION, __version__
from ..weights_io import save_weights
from .registry import get_export_config, load_model_config

logger = logging.getLogger(__name__)


def export(model_id: str, output_dir: str | Path, neuron_config: NeuronConfig,
           hf_kwargs: Optional[dict] = None, cache: Optional[CompileCache] = None,
           from_export: bool = False) -> dict:
    """Compile `model_id` (Hub id or directory) for `neuron_config` into `output_dir`; return the stamp.

    With a `cache`, graphs compiled earlier for the same decoder and NeuronConfig are copied instead of compiled
    ("cache hit": the weights may differ, e.g. a fine-tune), and new ones are stored; concurrent exports of the same
    key wait for each other. The Hub cache repo's entries hold compiled native code: they are used only with
    `trust_remote_code=True` in `hf_kwargs`. `from_export`: `model_id` is an export directory whose graphs are
    rebuilt here from its config and weights (`artifact_state_dict`).
    """
    prepared = prepare(model_id, neuron_config, hf_kwargs, from_export=from_export)
    if cache is None:
        return _write_export(prepared, output_dir)
    key = prepared.cache_key()
    trust_remote_code = bool((hf_kwargs or {}).get("trust_remote_code"))
    with cache.lock(key):
        entry = cache.lookup(key, trusted=trust_remote_code) or _fetch_trusted(cache, key, trust_remote_code)
        if entry is not None:
            logger.info("Compile cache hit %s (%s): nothing to compile", key.digest, entry)
            return _write_export(prepared, output_dir, cached_graphs=entry)
        logger.info("Compile cache miss %s: %s", key.digest, cache.miss_reason(key))
        meta = _write_export(prepared, output_dir)
        cache.store(key, Path(output_dir), tuple(name for name in meta["files"] if name != WEIGHTS_NAME),
                    meta["compile_time_s"])
        logger.info("Stored the compiled graphs in the compile cache as %s", key.digest)
        cache.push(key)
        return meta


def _fetch_trusted(cache: CompileCache, key: CacheKey, trust_remote_code: bool):
    """The Hub cache repo's entry for `key`, when the caller trusts its native code."""
    if not cache.hub_repo:
        return None
    if not trust_remote_code:
        logger.info("The Hub compile cache %s is not consulted: its entries hold compiled native code, which runs only "
                    "with trust_remote_code=True (CLI: --trust-remote-code). Compiling here.", cache.hub_repo)
        return None
    return cache.fetch(key)


def artifact_state_dict(artifact_dir: str | Path) -> tuple[object, dict]:
    """An export's config and its weights back in Transformers' names and shapes (its weights file is data: read by
    the safetensors library), every tensor checked against the model config.json describes: ArtifactError naming
    the tensor and both shapes where they disagree."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    artifact_dir = Path(artifact_dir)
    config = load_model_config(artifact_dir)
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
    return config, restored


def prepare(model_id: str, neuron_config: NeuronConfig, hf_kwargs: Optional[dict] = None,
            from_export: bool = False, load_weights: bool = True) -> "_Prepared":
    """Check, plan (memory, buckets) and load + convert the weights: everything before compiling. Without
    `load_weights` the decoder stays on the meta device (enough for its cache key)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    hf_kwargs = dict(hf_kwargs or {})
    backend = get_backend(neuron_config.backend)
    neuron_config = with_environment_compiler_args(neuron_config, backend)
    backend.check_compiler_args(neuron_config.compiler_args)  # before any key, compile or file: never runs code
    backend.check_toolchain()
    if not from_export:
        _refuse_export_as_checkpoint(model_id, hf_kwargs)
    # Refuse unsupported models before loading any weights.
    config = load_model_config(model_id, **hf_kwargs)
    export_config = get_export_config(config.model_type)
    spec = export_config.decoder_spec(config, neuron_config)
    check_layers_against_weights(model_id, from_export, spec.num_layers)
    if neuron_config.tp_degree > 1 and not backend.shards:
        raise ValueError(
            f"tp_degree (num_cores) = {neuron_config.tp_degree}: the {backend.name} backend does not shard graphs "
            f"across cores (each graph already runs on all of this machine's CPU cores). Use num_cores=1."
        )
    if neuron_config.speculation_length and spec.cache_places:
        raise ValueError(
            f"speculation_length={neuron_config.speculation_length}: this model's sliding-window layers keep only "
            f"their last {spec.sliding_window} tokens (sequence_length {neuron_config.sequence_length} is longer), so "
            f"rejected drafts cannot be rolled back. Export with speculation_length=0, or sequence_length <= "
            f"{spec.sliding_window}.")
    if backend.shards:
        ShardLayout.for_spec(spec, neuron_config.tp_degree)  # heads and MLP cut evenly, or a clear error
    estimate = estimate_memory(spec, neuron_config)
    logger.info("Memory estimate: %s", estimate.summary())
    if backend.targets_neuron_cores:
        check_fits_neuron_cores(estimate)
    if backend.uses_host_memory() and load_weights:
        check_fits_host_memory(estimate.total_bytes, f"Exporting this model (weights + KV cache for batch_size "
                                                     f"{neuron_config.batch_size} x sequence_length "
                                                     f"{neuron_config.sequence_length})")
    graphs = neuron_config.graphs()
    logger.info("Buckets: context %s, token generation %s (%d graphs, backend %s, %s)",
                list(neuron_config.context_buckets), list(neuron_config.token_buckets), len(graphs),
                neuron_config.backend, neuron_config.auto_cast_type)

    quantization = neuron_config.quantization
    if quantization and quantization not in backend.quantizations:
        raise ValueError(f"quantization={quantization!r} is not supported by the {backend.name} backend (it supports "
                         f"{', '.join(backend.quantizations) or 'none'}). Export without quantization, or with a "
                         f"backend that supports it.")
    start = time.perf_counter()
    with torch.device("meta"):
        decoder = StaticDecoder(spec, backend.kernels(neuron_config.torch_dtype, neuron_config.batch_size,
                                                      quantization), quantization)
    generation_config = None
    if from_export:
        source = read_artifact(model_id)[1].get("source")
    else:
        source = _hub_source(model_id, config, hf_kwargs)
    if load_weights:
        if from_export:
            state = artifact_state_dict(model_id)[1]
            if (Path(model_id) / "generation_config.json").is_file():
                generation_config = GenerationConfig.from_pretrained(model_id)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32, **hf_kwargs)
            state, generation_config = hf_model.state_dict(), hf_model.generation_config
            del hf_model
        # Quantized exports convert in float32 and round each projection to int8 from that, not from the dtype
        weights = export_config.convert_weights(state, decoder.parameter_names(),
                                                torch.float32 if quantization else neuron_config.torch_dtype,
                                                spec.num_layers)
        if quantization:
            weights = quantize_weights(weights, neuron_config.torch_dtype)
        weights = decoder.arrange_weights(weights)
        del state
        decoder.load_state_dict(weights, strict=False, assign=True)
        logger.info("Loaded and converted weights in %.1f s", time.perf_counter() - start)
    decoder.eval()
    return _Prepared(model_id, neuron_config, hf_kwargs, backend, config, spec, decoder, graphs,
                     generation_config, start, source)


_LAYER_INDEX_IN_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def check_layers_against_weights(model_id: str, from_export: bool, num_layers: int) -> None:
    """The layer count config.json gives against the weights' own (read from the safetensors headers only), before
    anything of that size is built: a config claiming a million layers over weights for two is refused at once."""
    from safetensors import safe_open

    directory = Path(model_id)
    if not directory.is_dir():
        return  # a Hub checkpoint: Transformers' loader compares it with its weights
    files = [directory / WEIGHTS_NAME] if from_export else sorted(directory.glob("*.safetensors"))
    found = -1
    for path in files:
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    match = _LAYER_INDEX_IN_NAME.search(name)
                    if match:
                        found = max(found, int(match.group(1)))
                    elif from_export and name.startswith("layers."):  # stacked: [layers, ...]
                        found = max(found, f.get_slice(name).get_shape()[0] - 1)
        except Exception as err:  # noqa: BLE001 (the weights' own loader says what is wrong with them)
            logger.debug("Could not read %s's header to count layers: %s", path, err)
            return
    if found >= 0 and found + 1 != num_layers:
        raise ArtifactError(f"{model_id}: config.json gives {num_layers} layers but the weights hold {found + 1}: "
                            f"config and weights do not belong together.")


def with_environment_compiler_args(neuron_config: NeuronConfig, backend: Backend) -> NeuronConfig:
    """`neuron_config` with the compiler options this machine's environment adds (NEURON_CC_FLAGS on the neuron
    backend) appended, so that the export records them and its cache key holds them."""
    added = backend.environment_compiler_args()
    have = neuron_config.compiler_args
    if not added or any(have[i:i + len(added)] == added for i in range(len(have) - len(added) + 1)):
        return neuron_config
    logger.info("Compiler options from the environment: %s", " ".join(added))
    return dataclasses.replace(neuron_config, compiler_args=(*have, *added))


def _hub_source(model_id: str, config, hf_kwargs: dict) -> Optional[dict]:
    """The Hub checkpoint an export comes from (repo id, commit, subfolder), or None for a local directory."""
    if Path(model_id).is_dir():
        return None
    revision = getattr(config, "_commit_hash", None)
    if not revision:
        from huggingface_hub import HfApi

        try:  # the exact commit, so that the weights fetched later are these
            revision = HfApi(token=hf_kwargs.get("token")).model_info(model_id, revision=hf_kwargs.get("revision")).sha
        except Exception:  # offline (HF_HUB_OFFLINE, a cached checkpoint): the revision asked for
            revision = hf_kwargs.get("revision")
    return {"repo_id": model_id, "revision": revision, "subfolder": hf_kwargs.get("subfolder") or ""}


def _refuse_export_as_checkpoint(model_id: str, hf_kwargs: dict) -> None:
    """An export (ours, or optimum-neuron's) handed to export=True: say what it is instead of failing in Transformers."""
    local = Path(model_id)
    if local.is_dir():
        is_export = (local / NEURON_CONFIG_NAME).is_file()
    else:
        from huggingface_hub import file_exists

        try:
            is_export = file_exists(model_id, NEURON_CONFIG_NAME, revision=hf_kwargs.get("revision"),
                                    token=hf_kwargs.get("token"))
        except Exception:  # offline, gated, not a repo id: Transformers' own loader says what is wrong
            is_export = False
    if is_export:
        raise ValueError(f"{model_id} is already a compiled export ({NEURON_CONFIG_NAME}), not a Transformers "
                         f"checkpoint: load it with NeuronModelForCausalLM.from_pretrained({str(model_id)!r}) without "
                         f"export=True (or export the checkpoint it was made from).")


@dataclass
class _Prepared:
    """A model loaded and converted for export, ready to compile."""

    model_id: str
    neuron_config: NeuronConfig
    hf_kwargs: dict
    backend: Backend
    config: object
    spec: DecoderSpec
    decoder: StaticDecoder
    graphs: list[GraphSpec]
    generation_config: object
    start: float
    source: Optional[dict]

    def backend_stamp(self) -> dict:
        kernels = self.decoder.kernels
        return {"version": self.backend.compiler_version(),
                "target": self.backend.target(kernels, self.neuron_config.torch_dtype),
                "lowering": kernels.describe(), "codegen": self.backend.codegen_options(),
                "packable_weights": self.backend.packable_weight_names(self.decoder)}

    def cache_key(self) -> CacheKey:
        versions = {"optimum_neuronx": __version__, "artifact_format": ARTIFACT_FORMAT_VERSION,
                    "torch": torch.__version__, "compiler": self.backend_stamp()}
        options = self.neuron_config.to_dict()
        if not self.backend.targets_neuron_cores:  # the instance planned for changes nothing the CPU compiles
            options["instance_type"] = None
        return cache_key(model_fields(self.config.model_type, self.spec), options, versions)


def model_fields(model_type: str, spec: DecoderSpec) -> dict:
    """What the graphs compute, as the cache key names it: the architecture and its decoder's shape (no weights)."""
    return {"model_type": model_type, **dataclasses.asdict(spec)}


def _write_export(p: _Prepared, output_dir: str | Path, cached_graphs: Optional[Path] = None) -> dict:
    """Write the export: weights, graphs (compiled now, or copied from the compile cache entry `cached_graphs`),
    configs and tokenizer, then the stamp."""
    from transformers import GenerationConfig

    nc = p.neuron_config
    with atomic_directory(output_dir) as staging:
        save_weights(dict(p.decoder.state_dict()), staging / WEIGHTS_NAME)
        if cached_graphs is None:
            kv_cache = torch.zeros(p.spec.kv_cache_shape(nc.batch_size, nc.sequence_length), dtype=nc.torch_dtype)
            with torch.no_grad():
                times = p.backend.compile(
                    p.decoder, p.graphs,
                    lambda g: p.decoder.graph_inputs(g, nc.batch_size, kv_cache, nc.on_device_sampling), staging, nc)
            graph_files = p.backend.graph_files(staging)
        else:
            entry = read_entry_meta(cached_graphs)
            graph_files, times = tuple(entry["sha256"]), entry["compile_time_s"]
            copy_artifact_files(cached_graphs, staging, include=graph_files, link=False)
        # Configs are written from files, never from a live model (its config carries runtime-only fields).
        p.config.save_pretrained(staging)
        generation_config = p.generation_config
        if not isinstance(generation_config, GenerationConfig):
            generation_config = GenerationConfig.from_model_config(p.config)
        generation_config.save_pretrained(staging)
        _save_tokenizer(p.model_id, staging, p.hf_kwargs)
        meta = write_neuron_config(staging, nc, p.graphs, p.backend_stamp(), times, (WEIGHTS_NAME, *graph_files),
                                   source=p.source)
    record_produced_here(output_dir, "export")
    logger.info("Exported %s to %s in %.1f s", p.model_id, output_dir, time.perf_counter() - p.start)
    return meta


def restore_source_weights(artifact_dir: str | Path, destination: str | Path, hf_kwargs: Optional[dict] = None) -> Path:
    """Complete an export pushed without its weights (`push_to_hub(include_weights=False)`): convert the weights of
    the source checkpoint it names (repo id and commit) and write the export with them to `destination`, refusing
    weights whose sha256 is not the one the export recorded."""
    artifact_dir = Path(artifact_dir)
    neuron_config, meta = read_artifact(artifact_dir, optional=(WEIGHTS_NAME,))
    source = meta.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("repo_id"), str):
        raise ArtifactError(f"{artifact_dir} has no {WEIGHTS_NAME} and names no source checkpoint to take the weights "
                            f"from. Push the export with include_weights=True, or re-export the model.")
    kwargs = {**(hf_kwargs or {}), "revision": source.get("revision")}
    if source.get("subfolder"):
        kwargs["subfolder"] = source["subfolder"]
    where = f"{source['repo_id']}@{source.get('revision')}"
    logger.info("%s was pushed without its weights: converting them from %s", artifact_dir, where)
    prepared = prepare(source["repo_id"], neuron_config, kwargs)
    expected = meta["files"][WEIGHTS_NAME]["sha256"]
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
