"""Export: Transformers checkpoint -> artifact directory (weights + compiled graphs + metadata)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from ..artifacts import WEIGHTS_NAME, atomic_directory, write_neuron_config
from ..backends import GraphSpec, get_backend
from ..configuration import NeuronConfig
from ..kv_cache import StaticKVCache
from ..memory import check_fits_neuron_cores, estimate_memory
from ..modeling.decoder import DecoderSpec, StaticDecoder
from .registry import get_export_config

logger = logging.getLogger(__name__)


def graph_specs(neuron_config: NeuronConfig) -> list[GraphSpec]:
    contexts = [GraphSpec("context", size, size) for size in neuron_config.context_buckets]
    return contexts + [GraphSpec("token", 1, size) for size in neuron_config.token_buckets]


def example_inputs(spec: DecoderSpec, neuron_config: NeuronConfig, graph: GraphSpec, kv_caches: list):
    b = neuron_config.batch_size
    return (
        torch.zeros(b, graph.tokens, dtype=torch.long),  # input_ids
        torch.zeros(b, graph.tokens, dtype=torch.long),  # position_ids
        torch.zeros(1, dtype=torch.long),  # cache_start
        torch.ones(b, graph.window, dtype=torch.bool),  # key_valid
        torch.zeros(b, dtype=torch.long),  # last_index
        kv_caches,
    )


def export(model_id: str, output_dir: str | Path, neuron_config: NeuronConfig,
           hf_kwargs: Optional[dict] = None) -> dict:
    """Compile `model_id` (Hub id or directory) for `neuron_config` into `output_dir`; return the stamp."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    hf_kwargs = dict(hf_kwargs or {})
    backend = get_backend(neuron_config.backend)
    backend.check_toolchain()
    # Refuse unsupported models before loading any weights.
    config = AutoConfig.from_pretrained(model_id, **hf_kwargs)
    export_config = get_export_config(config.model_type)
    spec = export_config.decoder_spec(config, neuron_config)
    estimate = estimate_memory(spec, neuron_config)
    logger.info("Memory estimate: %s", estimate.summary())
    if backend.targets_neuron_cores:
        check_fits_neuron_cores(estimate, spec)
    graphs = graph_specs(neuron_config)
    logger.info("Buckets: context %s, token generation %s (%d graphs, backend %s, %s)",
                list(neuron_config.context_buckets), list(neuron_config.token_buckets), len(graphs),
                neuron_config.backend, neuron_config.auto_cast_type)

    start = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32, **hf_kwargs)
    with torch.device("meta"):
        decoder = StaticDecoder(spec)
    weights = export_config.convert_weights(hf_model.state_dict(), decoder.parameter_names(),
                                            neuron_config.torch_dtype)
    decoder.load_state_dict(weights, strict=False, assign=True)
    decoder.eval()
    generation_config = hf_model.generation_config
    del hf_model
    logger.info("Loaded and converted weights in %.1f s", time.perf_counter() - start)

    with atomic_directory(output_dir) as staging:
        save_file(dict(decoder.state_dict()), str(staging / WEIGHTS_NAME))
        kv_caches = StaticKVCache(spec, neuron_config.batch_size, neuron_config.sequence_length,
                                  neuron_config.torch_dtype).kv
        with torch.no_grad():
            times = backend.compile(decoder, graphs, lambda g: example_inputs(spec, neuron_config, g, kv_caches),
                                    staging, neuron_config.compiler_args)
        # Configs are written from files, never from a live model (its config carries runtime-only fields).
        config.save_pretrained(staging)
        if not isinstance(generation_config, GenerationConfig):
            generation_config = GenerationConfig.from_model_config(config)
        generation_config.save_pretrained(staging)
        _save_tokenizer(model_id, staging, hf_kwargs)
        meta = write_neuron_config(staging, neuron_config, graphs, backend.compiler_version(), times,
                                   (WEIGHTS_NAME, *backend.graph_files()))
    logger.info("Exported %s to %s in %.1f s", model_id, output_dir, time.perf_counter() - start)
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
