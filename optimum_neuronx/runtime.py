"""NeuronModelForCausalLM: runs the compiled graphs behind Transformers' GenerationMixin."""

from __future__ import annotations

import copy
import functools
import logging
import threading
from pathlib import Path
from typing import Optional

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from .artifacts import atomic_directory, copy_artifact_files
from .cache import CompileCache
from .configuration import NeuronConfig, canonical_dtype
from .engine import Engine
from .exporters.registry import load_model_config
from .generation import (NO_INPUTS_EMBEDS, check_batch, check_forward_request, check_generate_mask, check_input_ids,
                         check_speculation, drafting, drop_cache_options, fit_generation_length, forward_mask,
                         on_device_sampler)
from .kv_cache import CacheHandle
from .loading import LoadedExport, export_and_load, load_trusted, resolve

logger = logging.getLogger(__name__)
# Transformers 5.24 renamed the model output's and generate's `past_key_values` to `cache` (the old name still
# works, with a deprecation warning): use whichever this version has.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

_PUSH_KWARGS = ("token", "private", "commit_message", "revision", "create_pr", "include_weights")


def _warn_ignored(method: str, kwargs: dict) -> None:
    """Transformers' options that mean nothing for an export (safe_serialization, device_map, ...): said, not
    silently dropped."""
    if kwargs:
        logger.warning("%s: %s ignored (they do not apply to a compiled export).", method, ", ".join(sorted(kwargs)))


# from_pretrained keyword -> NeuronConfig field.
NEURON_KWARGS = {
    "batch_size": "batch_size",
    "sequence_length": "sequence_length",
    "num_cores": "tp_degree",
    "tp_degree": "tp_degree",
    "auto_cast_type": "auto_cast_type",
    "context_buckets": "context_buckets",
    "token_buckets": "token_buckets",
    "backend": "backend",
    "compiler_args": "compiler_args",
    "instance_type": "instance_type",
    "tensor_parallel_size": "tp_degree",  # optimum-neuron's name
    "speculation_length": "speculation_length",
    "quantization": "quantization",
    "on_device_sampling": "on_device_sampling",
    "continuous_batching": "continuous_batching",
}


class NeuronCausalLMConfig(PretrainedConfig):
    """Our own model_type, so that the Auto classes (and pipeline's model check) know NeuronModelForCausalLM.

    Instances keep the exported model's own config (e.g. LlamaConfig); registering against LlamaConfig
    instead would hijack AutoModelForCausalLM for every Llama in the process.
    """

    model_type = "optimum-neuronx-causal-lm"


class NeuronModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM compiled to static-shape graphs; generate() is Transformers' own."""

    config_class = NeuronCausalLMConfig
    main_input_name = "input_ids"
    base_model_prefix = "neuron_model"

    def __init__(self, loaded: LoadedExport):
        super().__init__(loaded.config)
        neuron_config = self.neuron_config = loaded.neuron_config
        self._weights = loaded.weights  # the compiled graphs point into these tensors: keep them alive
        self._artifact_dir = loaded.artifact_dir
        self._tmpdir = loaded.tmpdir  # owns the export directory of a model exported but not yet saved
        self._engine = Engine(loaded.graphs, neuron_config, loaded.spec, loaded.kv_cache,  # every graph call
                              loaded.backend.reorder_kv_cache)
        # One generate (or forward) at a time: calls share the KV cache, and an AOTInductor runner keeps the GIL
        # while it waits for a graph another thread is running, which would deadlock the process.
        self._lock = threading.RLock()
        self._generating = threading.local()  # set while this thread runs generate (a streamer may call back in)
        generation_config = loaded.generation_config
        if generation_config is not None:
            # A checkpoint's own cache choice (e.g. cache_implementation="hybrid") is for Transformers' caches; the
            # graphs keep theirs, so it is dropped here rather than warned about on every generate.
            generation_config.cache_implementation = None
            generation_config.use_cache = True
            self.generation_config = generation_config

    @property
    def _graphs(self) -> dict:
        """The loaded graphs, by name (the engine calls them)."""
        return self._engine.graphs

    @property
    def _vocab_size(self) -> int:
        return self._engine.vocab_size

    # GenerationMixin and pipeline read these; with no torch parameters the base properties fail.
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self.neuron_config.torch_dtype

    @property
    def artifact_dir(self) -> Path:
        """The directory the compiled graphs and weights are loaded from."""
        return self._artifact_dir

    # -- loading and saving -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_id: str | Path, *, export: bool = False,
                        neuron_config: Optional[NeuronConfig] = None, compile_cache: bool = True,
                        compile_cache_dir: Optional[str | Path] = None, compile_cache_repo: Optional[str] = None,
                        huge_pages: Optional[bool] = None, **kwargs) -> "NeuronModelForCausalLM":
        """Load an exported directory (or Hub repo), or with `export=True` compile a Transformers checkpoint.

        Export keywords: batch_size, sequence_length, num_cores (tp_degree), auto_cast_type, context_buckets,
        token_buckets, backend, compiler_args, instance_type — or a ready `neuron_config`. Exports go through the compile
        cache (`compile_cache_dir`, default $OPTIMUM_NEURONX_CACHE or inside HF_HOME; `compile_cache_repo`, default
        $OPTIMUM_NEURONX_CACHE_REPO, a Hub repo shared as a remote cache) unless `compile_cache=False`. Other
        keywords go to Transformers' loaders (revision, token, ...).

        `huge_pages`: read the weights into memory in 2 MiB pages (Linux transparent huge pages), which decode
        streams faster than the 4 KiB pages a memory-mapped file may sit in; the default where the backend reads
        weights from host memory and the kernel has them. False maps the file instead: instant loads, and processes
        serving the same export share one copy in the page cache.
        """
        for name in ("dtype", "torch_dtype"):  # Transformers' / optimum-neuron's name for auto_cast_type
            value = kwargs.pop(name, None)
            if value is None or value == "auto":
                continue
            asked = canonical_dtype(value)
            if kwargs.get("auto_cast_type") is not None and canonical_dtype(kwargs["auto_cast_type"]) != asked:
                raise ValueError(f"{name}={value} and auto_cast_type={kwargs['auto_cast_type']!r} disagree: pass one.")
            kwargs["auto_cast_type"] = asked
        if kwargs.pop("task", "text-generation") != "text-generation":
            raise ValueError("NeuronModelForCausalLM exports task 'text-generation' only (causal language models).")
        neuron_kwargs = {NEURON_KWARGS[k]: kwargs.pop(k) for k in list(kwargs) if k in NEURON_KWARGS}
        neuron_kwargs = {k: v for k, v in neuron_kwargs.items() if v is not None}
        if export:
            if neuron_config is not None and neuron_kwargs:
                raise ValueError(f"Pass either neuron_config or {sorted(neuron_kwargs)}, not both.")
            config = load_model_config(model_id, **kwargs)  # read once: the export plans from it too
            if neuron_config is None:
                neuron_config = cls.get_neuron_config(model_id, config, **neuron_kwargs)
            return cls.export(model_id, config, neuron_config, compile_cache=compile_cache,
                              compile_cache_dir=compile_cache_dir, compile_cache_repo=compile_cache_repo,
                              huge_pages=huge_pages, **kwargs)
        from .hub import DOWNLOAD_KWARGS

        trust_remote_code = bool(kwargs.pop("trust_remote_code", False))
        _warn_ignored("from_pretrained", {k: v for k, v in kwargs.items() if k not in DOWNLOAD_KWARGS})
        cache = CompileCache(compile_cache_dir, compile_cache_repo, kwargs.get("token"))
        artifact_dir, downloaded = resolve(model_id, kwargs, cache)
        model = cls(load_trusted(artifact_dir, downloaded, trust_remote_code, cache if compile_cache else None,
                                 huge_pages))
        requested = dict(neuron_kwargs, **(neuron_config.to_dict() if neuron_config else {}))
        compiled = model.neuron_config.to_dict()
        differing = {k: v for k, v in NeuronConfig(**{**compiled, **requested}).to_dict().items() if compiled[k] != v}
        if differing:
            raise ValueError(
                f"{model_id} was compiled with " + ", ".join(f"{k}={compiled[k]!r}" for k in differing)
                + f" but {differing} was asked for. Compiled shapes are fixed: re-export with "
                  f"NeuronModelForCausalLM.from_pretrained(<original model>, export=True, ...)."
            )
        return model

    @classmethod
    def get_neuron_config(cls, model_name_or_path: str | Path, config=None, *, token: Optional[str] = None,
                          revision: Optional[str] = None, batch_size: Optional[int] = None,
                          sequence_length: Optional[int] = None, tensor_parallel_size: Optional[int] = None,
                          auto_cast_type: Optional[str] = None, **options) -> NeuronConfig:
        """The NeuronConfig an export of `model_name_or_path` gets (optimum-neuron 0.4's signature): what is given,
        else batch_size 1, sequence_length from the model's config (capped at 4096), auto_cast_type from the
        checkpoint's dtype, tensor_parallel_size 1. `options`: other NeuronConfig fields (context_buckets, backend,
        instance_type, ...) and Transformers' loading keywords (subfolder, cache_dir, trust_remote_code)."""
        fields = {f for f in NeuronConfig.__dataclass_fields__}
        nc_options = {k: options.pop(k) for k in list(options) if k in fields}
        if config is None:  # `options` left are Transformers' loading keywords, for the config only
            config = load_model_config(model_name_or_path, token=token, revision=revision, **options)
        tp = nc_options.pop("tp_degree", None) or tensor_parallel_size
        return NeuronConfig.for_model(config, batch_size=batch_size, sequence_length=sequence_length, tp_degree=tp,
                                      auto_cast_type=auto_cast_type, **nc_options)

    @classmethod
    def export(cls, model_id: str | Path, config=None, neuron_config: Optional[NeuronConfig] = None, *,
               token: Optional[str] = None, revision: Optional[str] = None, compile_cache: bool = True,
               compile_cache_dir: Optional[str | Path] = None, compile_cache_repo: Optional[str] = None,
               huge_pages: Optional[bool] = None, **kwargs) -> "NeuronModelForCausalLM":
        """Compile `model_id` for `neuron_config` and load it (optimum-neuron 0.4's `export(model_id, config,
        neuron_config)`; `export(model_id, neuron_config)` works too). `config`: the checkpoint's Transformers config
        (read from the checkpoint if not given); the export writes it as its config.json."""
        if isinstance(config, NeuronConfig) and neuron_config is None:
            config, neuron_config = None, config
        if kwargs.pop("load_weights", True) is False:
            logger.warning("export(load_weights=False) is ignored: an export always writes the weights its graphs "
                           "run with.")
        for name, value in (("token", token), ("revision", revision)):
            if value is not None:
                kwargs[name] = value
        if config is None:
            config = load_model_config(model_id, **kwargs)
        if neuron_config is None:
            neuron_config = cls.get_neuron_config(model_id, config)
        cache = CompileCache(compile_cache_dir, compile_cache_repo, token) if compile_cache else None
        return cls(export_and_load(str(model_id), neuron_config, cache=cache, huge_pages=huge_pages,
                                   hf_kwargs=kwargs, config=config))

    def save_pretrained(self, save_directory: str | Path, push_to_hub: bool = False, **kwargs) -> None:
        """Write the artifact (weights, graphs, configs, tokenizer files) to `save_directory`, atomically.

        With `push_to_hub=True` the saved directory is then pushed, as in Transformers: to `repo_id` (default: the
        directory's name), with push_to_hub's `token`, `private`, `commit_message`, `revision`, `create_pr`.
        """
        push_kwargs = {k: kwargs.pop(k) for k in _PUSH_KWARGS + ("repo_id",) if k in kwargs}
        _warn_ignored("save_pretrained", kwargs)
        save_directory = Path(save_directory)
        if not (save_directory.exists() and save_directory.resolve() == self._artifact_dir.resolve()):
            with atomic_directory(save_directory) as staging:
                copy_artifact_files(self._artifact_dir, staging)
        if push_to_hub:
            from .hub import push_artifact

            push_artifact(save_directory, push_kwargs.pop("repo_id", None) or save_directory.resolve().name,
                          **push_kwargs)

    def push_to_hub(self, repo_id: str | Path, repository_id: Optional[str] = None, *,
                    commit_message: Optional[str] = None, private: Optional[bool] = None,
                    token: Optional[str] = None, revision: Optional[str] = None, create_pr: bool = False,
                    include_weights: bool = True, endpoint: Optional[str] = None, **kwargs):
        """Upload the exported directory (weights, graphs, configs, tokenizer) plus a model card, in one commit.

        `push_to_hub("me/model")`, as in Transformers; or optimum-neuron's `push_to_hub(save_directory,
        repository_id, private=..., revision=..., token=..., endpoint=...)`, which pushes the export saved in
        `save_directory` (checked like any export) to `repository_id`. `endpoint`: another Hub server.

        `include_weights=False` leaves the weights out: the export names its source checkpoint (Hub repo id and
        commit), from which from_pretrained fetches and converts them, checking them against the recorded sha256 -
        for gated or large models whose weights should not be copied. Exports of a local directory have no source
        to name: they are pushed whole."""
        from .hub import push_artifact

        _warn_ignored("push_to_hub", kwargs)
        directory = self._artifact_dir
        if repository_id is not None:  # optimum-neuron's order: the directory first, then the repo
            directory = Path(repo_id)
            if not directory.is_dir():
                raise ValueError(f"push_to_hub({str(repo_id)!r}, {repository_id!r}): the first argument is the saved "
                                 f"export's directory in optimum-neuron's signature, and {repo_id} is not a directory. "
                                 f"Call model.save_pretrained({str(repo_id)!r}) first, or push_to_hub({repository_id!r}).")
            repo_id = repository_id
        return push_artifact(directory, str(repo_id), token=token, private=private, revision=revision,
                             commit_message=commit_message, create_pr=create_pr, include_weights=include_weights,
                             endpoint=endpoint)

    # -- generation ---------------------------------------------------------------------------------
    # Transformers' own, plus what its LongRoPE models (phi3) do: the step whose input passes the pretraining length
    # re-encodes the whole sequence (cache dropped), so that every cached key is rotated with the long frequencies
    # from then on. Wrapped: generate validates its keywords against this method's signature, which stays the base's.
    @functools.wraps(GenerationMixin.prepare_inputs_for_generation)
    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        after = self._engine.rope_long_after  # LongRoPE: the sequence is re-encoded when it passes this
        if after and input_ids.shape[1] >= after + 1:
            for name in ("cache", "past_key_values"):
                handle = kwargs.get(name)
                if isinstance(handle, CacheHandle) and handle.get_seq_length() <= after:
                    kwargs[name] = None
                    if "next_sequence_length" in kwargs:
                        kwargs["next_sequence_length"] = None
        return super().prepare_inputs_for_generation(input_ids, *args, **kwargs)


    def generate(self, inputs=None, generation_config=None, truncate_to_sequence_length: bool = False,
                 on_device_sampling: Optional[bool] = None, **kwargs):
        """Transformers' generate, after checking the request fits the compiled shapes.

        A request longer than `sequence_length` is an error; with `truncate_to_sequence_length=True`
        max_new_tokens is lowered to fit instead, and a warning says so. In an export with on-device sampling, the
        graphs pick the tokens wherever the request asks only for greedy search or sampling with temperature, top_k
        and top_p (`on_device_sampling=True`: an error otherwise; False: always on the logits).
        """
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(NO_INPUTS_EMBEDS)
        nc = self.neuron_config
        config = copy.deepcopy(generation_config or self.generation_config)
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        generation_config = drop_cache_options(config, generation_config, kwargs)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is not None:
            check_input_ids(input_ids, self._vocab_size)
            check_generate_mask(kwargs.get("attention_mask"), input_ids)
            check_speculation(nc.speculation_length, input_ids.shape[0], config, kwargs)
            handle = self._engine.handle
            continuing = any(kwargs.get(name) is handle is not None for name in ("cache", "past_key_values"))
            fitted = fit_generation_length(nc, input_ids.shape, config, truncate_to_sequence_length,
                                                      continuing)
            if fitted is not None:
                kwargs["max_new_tokens"] = fitted
                kwargs.pop("max_length", None)
        if getattr(self._generating, "active", False):
            raise RuntimeError("generate was called on this model while its own generate is running in the same thread "
                               "(e.g. from a streamer or stopping criterion): both would share one KV cache. Call it "
                               "after the outer generate returns, or load a second model for the inner one.")
        sampler = on_device_sampler(nc, self._vocab_size, config, kwargs, on_device_sampling)
        if sampler is not None:  # generate searches greedily over the logits _picked returns (warpers at defaults)
            kwargs.update(do_sample=False, temperature=1.0, top_k=50, top_p=1.0)
        with self._lock, drafting(kwargs.get("assistant_model"), nc.speculation_length):
            self._generating.active, self._engine.sampler = True, sampler
            try:
                return super().generate(inputs, generation_config=generation_config, **kwargs)
            finally:
                self._generating.active, self._engine.sampler = False, None

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = True, logits_to_keep=None, cache=None, labels=None, **kwargs):
        """Context encoding when the cache passed (`cache`, or `past_key_values` before Transformers 5.24) is not
        our live handle, else one decode step per token.

        Positions come from `attention_mask` (left padding); without a mask every row is full. Context encoding
        returns the last position's logits, [batch, 1, vocab], unless `logits_to_keep` asks for more (0: all, as in
        Transformers): the graphs compute logits at one position, so the last `logits_to_keep - 1` tokens are then
        fed as decode steps after the rest is encoded (assisted generation's first pass needs this).
        """
        check_forward_request(input_ids, labels, kwargs)
        past_key_values = cache if cache is not None else past_key_values
        check_input_ids(input_ids, self._vocab_size)
        check_batch(self.neuron_config.batch_size, input_ids.shape[0],
                               f"batch of {input_ids.shape[0]} sequences")
        attention_mask = forward_mask(attention_mask)
        if isinstance(past_key_values, CacheHandle) and past_key_values is not self._engine.handle:
            raise ValueError("past_key_values is a cache handle this model no longer holds: a newer context replaced "
                             "its cache (or it belongs to another model). Continue with the handle returned last, or "
                             "pass past_key_values=None to start a new context.")
        with self._lock:
            logits = self._run(input_ids, attention_mask, past_key_values, logits_to_keep)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        handle = self._engine.handle if use_cache is not False else None
        return CausalLMOutputWithPast(logits=logits, **{_CACHE_FIELD: handle})

    def _run(self, input_ids, attention_mask, past_key_values, logits_to_keep) -> torch.Tensor:
        n = input_ids.shape[1]
        if past_key_values is not None and past_key_values is self._engine.handle and self._engine.handle.length > 0:
            return self._engine.decode(input_ids, attention_mask)
        keep = n if logits_to_keep == 0 else min(logits_to_keep or 1, n)
        encoded = n - keep + 1
        mask = attention_mask[:, :encoded] if attention_mask is not None else None
        logits = self._engine.encode(input_ids[:, :encoded], mask)
        if keep > 1:
            logits = torch.cat([logits, self._engine.decode(input_ids[:, encoded:], attention_mask)], dim=1)
        return logits


AutoConfig.register(NeuronCausalLMConfig.model_type, NeuronCausalLMConfig, exist_ok=True)
AutoModelForCausalLM.register(NeuronCausalLMConfig, NeuronModelForCausalLM, exist_ok=True)
