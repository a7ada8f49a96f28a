"""Export: Transformers checkpoint -> artifact directory (weights + compiled graphs + metadata)."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..artifacts import (WEIGHTS_NAME, ArtifactError, atomic_directory, copy_artifact_files, read_artifact,
                         write_neuron_config)
from ..cache import ENTRY_META, CacheKey, CompileCache, cache_key, weights_digest
from ..backends import Backend, get_backend
from ..configuration import GraphSpec, NeuronConfig
from ..memory import check_fits_neuron_cores, estimate_memory
from ..modeling.decoder import DecoderSpec, StaticDecoder
from ..modeling.sharding import ShardLayout
from ..trust import record_produced_here
from ..version import ARTIFACT_FORMAT_VERSION, __version__
from ..weights_io import save_weights
from .registry import get_export_config

logger = logging.getLogger(__name__)


def export(model_id: str, output_dir: str | Path, neuron_config: NeuronConfig,
           hf_kwargs: Optional[dict] = None, cache: Optional[CompileCache] = None,
           from_export: bool = False) -> dict:
    """Compile `model_id` (Hub id or directory) for `neuron_config` into `output_dir`; return the stamp.

    With a `cache`, an identical earlier export is copied instead of compiled ("cache hit"), and a new
    one is stored; concurrent exports of the same key wait for each other. The Hub cache repo's entries hold
    compiled native code: they are used only with `trust_remote_code=True` in `hf_kwargs`, and only when their
    weights are the ones the key names. `from_export`: `model_id` is an export directory whose graphs are rebuilt
    here from its config and weights (`artifact_state_dict`).
    """
    prepared = prepare(model_id, neuron_config, hf_kwargs, from_export=from_export)
    if cache is None:
        return _compile(prepared, output_dir)
    key = prepared.cache_key()
    trust_remote_code = bool((hf_kwargs or {}).get("trust_remote_code"))
    with cache.lock(key):
        entry = cache.lookup(key) or _fetch_trusted(cache, key, prepared, trust_remote_code)
        if entry is not None:
            logger.info("Compile cache hit %s (%s): nothing to compile", key.digest, entry)
            with atomic_directory(output_dir) as staging:
                copy_artifact_files(entry, staging, exclude=(ENTRY_META,))
            return read_artifact(output_dir)[1]
        logger.info("Compile cache miss %s: %s", key.digest, cache.miss_reason(key))
        meta = _compile(prepared, output_dir)
        cache.store(key, Path(output_dir))  # recorded as produced here
        logger.info("Stored in the compile cache as %s", key.digest)
        cache.push(key)
        return meta


def _fetch_trusted(cache: CompileCache, key: CacheKey, prepared: "_Prepared", trust_remote_code: bool):
    """The Hub cache repo's entry for `key`, when the caller trusts its native code and its weights are the key's."""
    if not cache.hub_repo:
        return None
    if not trust_remote_code:
        logger.info("The Hub compile cache %s is not consulted: its entries hold compiled native code, which runs only "
                    "with trust_remote_code=True (CLI: --trust-remote-code). Compiling here.", cache.hub_repo)
        return None
    entry = cache.fetch(key)
    if entry is None:
        return None
    from safetensors.torch import load_file

    stored = load_file(str(entry / WEIGHTS_NAME))
    names = {name for name, _ in prepared.decoder.named_parameters()}
    if weights_digest({name: t for name, t in stored.items() if name in names}) != key.fields["weights"]:
        logger.warning("Hub compile cache entry %s holds other weights than its key names: evicted, compiling here.",
                       key.digest)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    record_produced_here(entry, "trusted remote cache")
    return entry


def artifact_state_dict(artifact_dir: str | Path) -> tuple[object, dict]:
    """An export's config and its weights back in Transformers' names and shapes (model.safetensors is data: read
    by the safetensors library), every tensor checked against the model config.json describes: ArtifactError naming
    the tensor and both shapes where they disagree."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    artifact_dir = Path(artifact_dir)
    config = AutoConfig.from_pretrained(artifact_dir)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(config).state_dict()
    weights = load_file(str(artifact_dir / WEIGHTS_NAME))
    redo = "The export's config.json and model.safetensors do not belong together: re-export the model."
    try:
        restored = get_export_config(config.model_type).restore_weights(weights, expected)
    except KeyError as err:
        raise ArtifactError(f"{artifact_dir}: model.safetensors holds {err.args[0]}, which config.json's model does "
                            f"not have. {redo}") from None
    except (RuntimeError, ValueError) as err:
        raise ArtifactError(f"{artifact_dir}: model.safetensors does not fit config.json ({err}). {redo}") from None
    for name, tensor in restored.items():
        if name not in expected:
            raise ArtifactError(f"{artifact_dir}: model.safetensors holds {name}, which config.json's model does not "
                                f"have. {redo}")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ArtifactError(f"{artifact_dir}: {name} is {tuple(tensor.shape)} in model.safetensors but "
                                f"{tuple(expected[name].shape)} in config.json's model. {redo}")
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(restored) - tied)
    if missing:
        raise ArtifactError(f"{artifact_dir}: model.safetensors lacks {missing[:3]} ({len(missing)} tensors). {redo}")
    return config, restored


def prepare(model_id: str, neuron_config: NeuronConfig, hf_kwargs: Optional[dict] = None,
            from_export: bool = False) -> "_Prepared":
    """Check, plan (memory, buckets) and load + convert the weights: everything before compiling."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    hf_kwargs = dict(hf_kwargs or {})
    backend = get_backend(neuron_config.backend)
    backend.check_toolchain()
    # Refuse unsupported models before loading any weights.
    config = AutoConfig.from_pretrained(model_id, **hf_kwargs)
    export_config = get_export_config(config.model_type)
    spec = export_config.decoder_spec(config, neuron_config)
    if neuron_config.tp_degree > 1 and not backend.shards:
        raise ValueError(
            f"tp_degree (num_cores) = {neuron_config.tp_degree}: the {backend.name} backend does not shard graphs "
            f"across cores (each graph already runs on all of this machine's CPU cores). Use num_cores=1."
        )
    if backend.shards:
        ShardLayout.for_spec(spec, neuron_config.tp_degree)  # heads and MLP cut evenly, or a clear error
    estimate = estimate_memory(spec, neuron_config)
    logger.info("Memory estimate: %s", estimate.summary())
    if backend.targets_neuron_cores:
        check_fits_neuron_cores(estimate)
    graphs = neuron_config.graphs()
    logger.info("Buckets: context %s, token generation %s (%d graphs, backend %s, %s)",
                list(neuron_config.context_buckets), list(neuron_config.token_buckets), len(graphs),
                neuron_config.backend, neuron_config.auto_cast_type)

    start = time.perf_counter()
    if from_export:
        state = artifact_state_dict(model_id)[1]
        generation_config = (GenerationConfig.from_pretrained(model_id)
                             if (Path(model_id) / "generation_config.json").is_file() else None)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32, **hf_kwargs)
        state, generation_config = hf_model.state_dict(), hf_model.generation_config
        del hf_model
    with torch.device("meta"):
        decoder = StaticDecoder(spec, backend.kernels(neuron_config.torch_dtype, neuron_config.batch_size))
    weights = decoder.arrange_weights(export_config.convert_weights(state, decoder.parameter_names(),
                                                                    neuron_config.torch_dtype, spec.num_layers))
    del state
    decoder.load_state_dict(weights, strict=False, assign=True)
    decoder.eval()
    logger.info("Loaded and converted weights in %.1f s", time.perf_counter() - start)
    return _Prepared(model_id, neuron_config, hf_kwargs, backend, config, spec, decoder, graphs,
                     generation_config, start)


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

    def backend_stamp(self) -> dict:
        kernels = self.decoder.kernels
        return {"version": self.backend.compiler_version(),
                "target": self.backend.target(kernels, self.neuron_config.torch_dtype),
                "lowering": kernels.describe(), "codegen": self.backend.codegen_options(),
                "packable_weights": self.backend.packable_weight_names(self.decoder)}

    def cache_key(self) -> CacheKey:
        versions = {"optimum_neuronx": __version__, "artifact_format": ARTIFACT_FORMAT_VERSION,
                    "torch": torch.__version__, "compiler": self.backend_stamp()}
        weights = {name: p for name, p in self.decoder.named_parameters()}
        return cache_key(self.config.to_dict(), weights_digest(weights), self.neuron_config.to_dict(), versions)


def _compile(p: _Prepared, output_dir: str | Path) -> dict:
    from transformers import GenerationConfig

    nc = p.neuron_config
    with atomic_directory(output_dir) as staging:
        save_weights(dict(p.decoder.state_dict()), staging / WEIGHTS_NAME)
        kv_cache = torch.zeros(p.spec.kv_cache_shape(nc.batch_size, nc.sequence_length), dtype=nc.torch_dtype)
        with torch.no_grad():
            times = p.backend.compile(p.decoder, p.graphs,
                                      lambda g: p.decoder.example_inputs(nc.batch_size, g.tokens, g.window, kv_cache),
                                      staging, nc)
        # Configs are written from files, never from a live model (its config carries runtime-only fields).
        p.config.save_pretrained(staging)
        generation_config = p.generation_config
        if not isinstance(generation_config, GenerationConfig):
            generation_config = GenerationConfig.from_model_config(p.config)
        generation_config.save_pretrained(staging)
        _save_tokenizer(p.model_id, staging, p.hf_kwargs)
        meta = write_neuron_config(staging, nc, p.graphs, p.backend_stamp(), times,
                                   (WEIGHTS_NAME, *p.backend.graph_files(staging)))
    record_produced_here(output_dir, "export")
    logger.info("Exported %s to %s in %.1f s", p.model_id, output_dir, time.perf_counter() - p.start)
    return meta


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
