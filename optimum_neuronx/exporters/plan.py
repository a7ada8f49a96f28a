"""The export plan: everything an export decides before it loads a weight, computed once from the checkpoint's
config and the NeuronConfig: the decoder spec, its shard layout, the memory estimate, the graphs, the backend's
kernels and stamp, the source. Its cache key names the compiled graphs; neuron_config.json records it."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from ..artifacts import WEIGHTS_NAME, ArtifactError, read_artifact
from ..backends import Backend, get_backend
from ..backends.base import Kernels
from ..cache import CacheKey, cache_key
from ..configuration import NEURON_CONFIG_NAME, GraphSpec, NeuronConfig
from ..memory import MemoryEstimate, check_fits_host_memory, check_fits_neuron_cores, estimate_memory
from ..modeling.decoder import StaticDecoder
from ..modeling.sharding import ShardLayout
from ..modeling.spec import DecoderSpec
from ..stamp import BackendStamp, ExportStamp
from ..version import ARTIFACT_FORMAT_VERSION, __version__
from .registry import get_export_config, load_model_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportPlan:
    """One export, decided: what `plan_export` checked and derived, passed on to loading the weights, compiling
    and stamping (nothing here is derived twice)."""

    model_id: str
    config: object  # the checkpoint's Transformers config, read once
    neuron_config: NeuronConfig  # with the environment's compiler options
    hf_kwargs: Mapping[str, object]
    from_export: bool  # model_id is an export whose graphs are rebuilt from its config and weights
    backend: Backend
    kernels: Kernels
    spec: DecoderSpec
    layout: Optional[ShardLayout]  # how tensor parallelism cuts the decoder (backends that shard)
    memory: MemoryEstimate
    graphs: tuple[GraphSpec, ...]
    backend_stamp: BackendStamp
    source: Optional[Mapping[str, object]]  # the Hub checkpoint (repo_id, revision, subfolder); None: local

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def quantization(self) -> Optional[str]:
        return self.neuron_config.quantization

    def new_decoder(self) -> StaticDecoder:
        """The decoder this plan compiles, on the meta device (no memory: weights are assigned into it)."""
        with torch.device("meta"):
            return StaticDecoder(self.spec, self.kernels, self.quantization)

    def cache_key(self) -> CacheKey:
        versions = {"optimum_neuronx": __version__, "artifact_format": ARTIFACT_FORMAT_VERSION,
                    "torch": torch.__version__, "compiler": self.backend_stamp.to_dict()}
        options = self.neuron_config.to_dict()
        if not self.backend.targets_neuron_cores:  # the instance planned for changes nothing the CPU compiles
            options["instance_type"] = None
        return cache_key(model_fields(self.model_type, self.spec), options, versions)


def model_fields(model_type: str, spec: DecoderSpec) -> dict:
    """What the graphs compute, as the cache key names it: the architecture and its decoder's shape (no weights)."""
    return {"model_type": model_type, **dataclasses.asdict(spec)}


def plan_export(model_id: str, neuron_config: NeuronConfig, hf_kwargs: Optional[dict] = None, *,
                from_export: bool = False, config=None, check_host_memory: bool = True,
                rebuilt_stamp: Optional[ExportStamp] = None) -> ExportPlan:
    """Check and plan an export of `model_id` for `neuron_config`: every refusal comes here, before a weight is
    loaded or a file written. `config`: the checkpoint's Transformers config where the caller read it already.
    `check_host_memory=False`: only the plan is wanted (a cache key), no weights will be loaded. `rebuilt_stamp`: with
    `from_export`, the export's stamp where the caller read it (its source is kept)."""
    hf_kwargs = dict(hf_kwargs or {})
    backend = get_backend(neuron_config.backend)
    neuron_config = with_environment_compiler_args(neuron_config, backend)
    backend.check_compiler_args(neuron_config.compiler_args)  # before any key, compile or file: never runs code
    backend.check_toolchain()
    if not from_export:
        _refuse_export_as_checkpoint(model_id, hf_kwargs)
    if config is None:
        config = load_model_config(model_id, **hf_kwargs)
    spec = get_export_config(config.model_type).decoder_spec(config, neuron_config)
    check_layers_against_weights(model_id, from_export, spec.num_layers)
    if neuron_config.tp_degree > 1 and not backend.shards:
        raise ValueError(
            f"tp_degree (num_cores) = {neuron_config.tp_degree}: the {backend.name} backend does not shard graphs "
            f"across cores (each graph already runs on all of this machine's CPU cores). Use num_cores=1.")
    if neuron_config.speculation_length and spec.cache_places:
        raise ValueError(
            f"speculation_length={neuron_config.speculation_length}: this model's sliding-window layers keep only "
            f"their last {spec.sliding_window} tokens (sequence_length {neuron_config.sequence_length} is longer), so "
            f"rejected drafts cannot be rolled back. Export with speculation_length=0, or sequence_length <= "
            f"{spec.sliding_window}.")
    layout = ShardLayout.for_spec(spec, neuron_config.tp_degree) if backend.shards else None
    memory = estimate_memory(spec, neuron_config)
    logger.info("Memory estimate: %s", memory.summary())
    if backend.targets_neuron_cores:
        check_fits_neuron_cores(memory)
    if backend.uses_host_memory() and check_host_memory:
        check_fits_host_memory(memory.total_bytes, f"Exporting this model (weights + KV cache for batch_size "
                                                   f"{neuron_config.batch_size} x sequence_length "
                                                   f"{neuron_config.sequence_length})")
    graphs = tuple(neuron_config.graphs())
    logger.info("Buckets: context %s, token generation %s (%d graphs, backend %s, %s)",
                list(neuron_config.context_buckets), list(neuron_config.token_buckets), len(graphs),
                neuron_config.backend, neuron_config.auto_cast_type)
    quantization = neuron_config.quantization
    if quantization and quantization not in backend.quantizations:
        raise ValueError(f"quantization={quantization!r} is not supported by the {backend.name} backend (it supports "
                         f"{', '.join(backend.quantizations) or 'none'}). Export without quantization, or with a "
                         f"backend that supports it.")
    kernels = backend.kernels(neuron_config.torch_dtype, neuron_config.batch_size, quantization)
    with torch.device("meta"):
        packable = backend.packable_weight_names(StaticDecoder(spec, kernels, quantization))
    stamp = BackendStamp(name=neuron_config.backend, version=backend.compiler_version(),
                         target=backend.target(kernels, neuron_config.torch_dtype), lowering=kernels.describe(),
                         codegen=backend.codegen_options(), packable_weights=tuple(packable))
    if from_export:
        source = (rebuilt_stamp or read_artifact(model_id)).source
    else:
        source = _hub_source(model_id, config, hf_kwargs)
    return ExportPlan(model_id, config, neuron_config, hf_kwargs, from_export, backend, kernels, spec, layout, memory,
                      graphs, stamp, source)


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
