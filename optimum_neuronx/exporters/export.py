"""Export: Transformers checkpoint -> artifact directory (weights + compiled graphs + metadata)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..artifacts import WEIGHTS_NAME, atomic_directory, copy_artifact_files, read_artifact, write_neuron_config
from ..cache import ENTRY_META, CacheKey, CompileCache, cache_key, weights_digest
from ..backends import Backend, get_backend
from ..configuration import GraphSpec, NeuronConfig
from ..memory import check_fits_neuron_cores, estimate_memory
from ..modeling.decoder import DecoderSpec, StaticDecoder
from ..modeling.sharding import ShardLayout
from ..version import ARTIFACT_FORMAT_VERSION, __version__
from ..weights_io import save_weights
from .registry import get_export_config

logger = logging.getLogger(__name__)


def export(model_id: str, output_dir: str | Path, neuron_config: NeuronConfig,
           hf_kwargs: Optional[dict] = None, cache: Optional[CompileCache] = None) -> dict:
    """Compile `model_id` (Hub id or directory) for `neuron_config` into `output_dir`; return the stamp.

    With a `cache`, an identical earlier export is copied instead of compiled ("cache hit"), and a new
    one is stored; concurrent exports of the same key wait for each other.
    """
    prepared = prepare(model_id, neuron_config, hf_kwargs)
    if cache is None:
        return _compile(prepared, output_dir)
    key = prepared.cache_key()
    with cache.lock(key):
        entry = cache.lookup(key) or cache.fetch(key)
        if entry is not None:
            logger.info("Compile cache hit %s (%s): nothing to compile", key.digest, entry)
            with atomic_directory(output_dir) as staging:
                copy_artifact_files(entry, staging, exclude=(ENTRY_META,))
            return read_artifact(output_dir)[1]
        logger.info("Compile cache miss %s: %s", key.digest, cache.miss_reason(key))
        meta = _compile(prepared, output_dir)
        cache.store(key, Path(output_dir))
        logger.info("Stored in the compile cache as %s", key.digest)
        cache.push(key)
        return meta


def prepare(model_id: str, neuron_config: NeuronConfig, hf_kwargs: Optional[dict] = None) -> "_Prepared":
    """Check, plan (memory, buckets) and load + convert the weights: everything before compiling."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    hf_model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32, **hf_kwargs)
    with torch.device("meta"):
        decoder = StaticDecoder(spec, backend.kernels(neuron_config.torch_dtype, neuron_config.batch_size))
    weights = decoder.arrange_weights(export_config.convert_weights(hf_model.state_dict(), decoder.parameter_names(),
                                                                    neuron_config.torch_dtype, spec.num_layers))
    decoder.load_state_dict(weights, strict=False, assign=True)
    decoder.eval()
    generation_config = hf_model.generation_config
    del hf_model
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
