"""NeuronModelForCausalLM: runs the compiled graphs behind Transformers' GenerationMixin."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from .artifacts import (WEIGHTS_NAME, ArtifactError, atomic_directory, compiled_code_problem, copy_artifact_files,
                        export_identity, read_artifact, verified_copy, weights_source)
from .backends import get_backend
from .buckets import context_bucket
from .cache import CompileCache
from .configuration import GraphSpec, NeuronConfig, canonical_dtype
from .exporters.registry import get_export_config, load_model_config
from .memory import check_fits_host_memory
from .engine import Engine
from .kv_cache import CacheHandle
from .modeling.decoder import StaticDecoder
from .modeling.sampling import MAX_TOP_K
from .tempdirs import temporary_directory
from .weights_io import load_weights

logger = logging.getLogger(__name__)
# Transformers 5.24 renamed the model output's and generate's `past_key_values` to `cache` (the old name still
# works, with a deprecation warning): use whichever this version has.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

_NO_INPUTS_EMBEDS = ("inputs_embeds is not supported: the compiled graphs start from token ids (the embedding lookup "
                     "is compiled in). Pass input_ids.")

_PUSH_KWARGS = ("token", "private", "commit_message", "revision", "create_pr", "include_weights")


def _warn_ignored(method: str, kwargs: dict) -> None:
    """Transformers' options that mean nothing for an export (safe_serialization, device_map, ...): said, not
    silently dropped."""
    if kwargs:
        logger.warning("%s: %s ignored (they do not apply to a compiled export).", method, ", ".join(sorted(kwargs)))


def _use_huge_pages(asked: Optional[bool], backend) -> bool:
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

    def __init__(self, config, neuron_config: NeuronConfig, graphs: dict, weights: dict, artifact_dir: Path,
                 generation_config: Optional[GenerationConfig] = None, tmpdir=None):
        super().__init__(config)
        self.neuron_config = neuron_config
        self._weights = weights  # the compiled graphs point into these tensors: keep them alive
        self._artifact_dir = Path(artifact_dir)
        self._tmpdir = tmpdir  # owns the export directory of a model exported but not yet saved
        spec = get_export_config(config.model_type).decoder_spec(config, neuron_config)
        shape = spec.kv_cache_shape(neuron_config.batch_size, neuron_config.sequence_length)
        kv = get_backend(neuron_config.backend).new_kv_cache(graphs, shape, neuron_config.torch_dtype)
        self._engine = Engine(graphs, neuron_config, spec, kv)  # the cache and every graph call
        self._check_graph_inputs(tuple(kv.shape))
        # One generate (or forward) at a time: calls share the KV cache, and an AOTInductor runner keeps the GIL
        # while it waits for a graph another thread is running, which would deadlock the process.
        self._lock = threading.RLock()
        self._generating = threading.local()  # set while this thread runs generate (a streamer may call back in)
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

    def _check_graph_inputs(self, kv_shape: tuple) -> None:
        """Refuse, at load, graphs compiled for other input shapes than this export's configs give (an export edited
        after it was compiled): they would be handed tensors they read out of bounds."""
        nc = self.neuron_config
        kv_cache = torch.empty(kv_shape, dtype=nc.torch_dtype, device="meta")
        for spec in nc.graphs():
            compiled = getattr(self._graphs[spec.name], "input_signature", None)
            if compiled is None:
                continue
            given = [[list(t.shape), str(t.dtype).removeprefix("torch.")]
                     for t in StaticDecoder.graph_inputs(spec, nc.batch_size, kv_cache, nc.on_device_sampling)]
            if len(compiled) != len(given):
                raise ArtifactError(f"graph {spec.name} was compiled for {len(compiled)} inputs, but this export's "
                                    f"neuron_config.json gives it {len(given)}: the export was edited after it was "
                                    f"compiled. Re-export the model.")
            for input_name, expected, actual in zip(StaticDecoder.INPUT_NAMES, compiled, given):
                if [list(expected[0]), expected[1]] != actual:
                    raise ArtifactError(
                        f"graph {spec.name} was compiled for {input_name} {tuple(expected[0])} {expected[1]}, but this "
                        f"export's config.json and neuron_config.json give {tuple(actual[0])} {actual[1]}: the export "
                        f"was edited after it was compiled. Re-export the model.")

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
            if neuron_config is None:
                neuron_config = cls.get_neuron_config(model_id, token=kwargs.get("token"),
                                                      revision=kwargs.get("revision"), **_hub_kwargs(kwargs),
                                                      **neuron_kwargs)
            return cls.export(model_id, neuron_config=neuron_config, compile_cache=compile_cache,
                              compile_cache_dir=compile_cache_dir, compile_cache_repo=compile_cache_repo,
                              huge_pages=huge_pages, **kwargs)
        from .hub import DOWNLOAD_KWARGS

        trust_remote_code = bool(kwargs.pop("trust_remote_code", False))
        _warn_ignored("from_pretrained", {k: v for k, v in kwargs.items() if k not in DOWNLOAD_KWARGS})
        artifact_dir, downloaded = _resolve_artifact_dir(model_id, kwargs)
        cache = CompileCache(compile_cache_dir, compile_cache_repo, kwargs.get("token"))
        if not (artifact_dir / WEIGHTS_NAME).exists() and weights_source(artifact_dir):
            artifact_dir, downloaded = _with_source_weights(artifact_dir, cache, kwargs), True
        model = cls._from_trusted_artifact(artifact_dir, downloaded, trust_remote_code,
                                           cache if compile_cache else None, huge_pages)
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
               token: Optional[str] = None, revision: Optional[str] = None, load_weights: bool = True,
               compile_cache: bool = True, compile_cache_dir: Optional[str | Path] = None,
               compile_cache_repo: Optional[str] = None, huge_pages: Optional[bool] = None,
               **kwargs) -> "NeuronModelForCausalLM":
        """Compile `model_id` for `neuron_config` (optimum-neuron 0.4's `export(model_id, config, neuron_config)`;
        `export(model_id, neuron_config)` works too) and load it. `config` is accepted for compatibility: the
        checkpoint's own config is read again, so that the export and its cache key come from files.
        `load_weights=False` is accepted and changes nothing: the graphs run with the weights they were exported
        with, which are always written."""
        if isinstance(config, NeuronConfig) and neuron_config is None:
            config, neuron_config = None, config
        if neuron_config is None:
            neuron_config = cls.get_neuron_config(model_id, config, token=token, revision=revision,
                                                  **_hub_kwargs(kwargs))
        for name, value in (("token", token), ("revision", revision)):
            if value is not None:
                kwargs[name] = value
        from .exporters.export import export as run_export

        tmpdir = temporary_directory("export")
        out_dir = Path(tmpdir.name) / "model"
        cache = CompileCache(compile_cache_dir, compile_cache_repo, token) if compile_cache else None
        run_export(str(model_id), out_dir, neuron_config, hf_kwargs=kwargs, cache=cache)
        return cls._from_artifact(out_dir, tmpdir=tmpdir, compiled=True, huge_pages=huge_pages)

    @classmethod
    def _from_trusted_artifact(cls, artifact_dir: Path, downloaded: bool, trust_remote_code: bool, cache,
                               huge_pages: Optional[bool]) -> "NeuronModelForCausalLM":
        """Load an export whose compiled graphs (native code) this machine produced, or the caller trusts; rebuild
        the graphs of any other here from its config and weights first. Digests are checked for an export from a
        new source (a download, a path it was not recorded at, one not produced here)."""
        from .trust import provenance, record_produced_here

        origins = []  # the provenance of the neuron_config.json bytes read_artifact parses

        def digests_needed(identity: str) -> bool:
            origins.append(provenance(artifact_dir, identity))
            return downloaded or origins[-1] != "here"

        neuron_config, meta = read_artifact(artifact_dir, check_digests=digests_needed)
        origin, loaded = origins[-1], (neuron_config, meta)
        problem = compiled_code_problem(artifact_dir, meta)
        if not problem and origin != "foreign":
            record_produced_here(artifact_dir, "copied", meta["identity"])
            return cls._from_artifact(artifact_dir, huge_pages=huge_pages, loaded=loaded)
        if not problem and trust_remote_code:
            record_produced_here(artifact_dir, "trusted by the user", meta["identity"])
            return cls._from_artifact(artifact_dir, huge_pages=huge_pages, loaded=loaded)
        from .exporters.export import export as run_export

        if problem:
            logger.warning("The compiled graphs of %s cannot run here: %s. Rebuilding them here from its config and "
                           "weights (once: the compile cache keeps them).", artifact_dir, problem)
        else:
            logger.info("%s was not exported on this machine: its compiled graphs are native code, which is loaded "
                        "only with trust_remote_code=True. Rebuilding the graphs here from its config and weights "
                        "(once: the compile cache keeps them).", artifact_dir)
        if neuron_config.compiler_args and not trust_remote_code:
            logger.warning("%s's compiler_args %s are not applied to its rebuild: an export's compiler options run "
                           "only with trust_remote_code=True (the graphs compute the same; only how they are compiled "
                           "changes).", artifact_dir, list(neuron_config.compiler_args))
            neuron_config = dataclasses.replace(neuron_config, compiler_args=())
        tmpdir = temporary_directory("export")
        out_dir = Path(tmpdir.name) / "model"
        run_export(str(artifact_dir), out_dir, neuron_config, cache=cache, from_export=True)
        return cls._from_artifact(out_dir, tmpdir=tmpdir, compiled=True, huge_pages=huge_pages)

    @classmethod
    def _from_artifact(cls, artifact_dir: Path, tmpdir=None, compiled: bool = False,
                       huge_pages: Optional[bool] = None, loaded=None) -> "NeuronModelForCausalLM":
        """Load the export in `artifact_dir` (`loaded`: its NeuronConfig and metadata as the trust decision read
        them). The compiled graphs and configs load from a private copy checked against the digests as it is made:
        the code that runs is the code that was verified."""
        start = time.perf_counter()
        neuron_config, meta = loaded or read_artifact(artifact_dir)
        problem = compiled_code_problem(artifact_dir, meta)
        if problem:
            raise ArtifactError(f"{artifact_dir} cannot run here: {problem}. Load it with "
                                f"NeuronModelForCausalLM.from_pretrained, which rebuilds its graphs here.")
        backend = get_backend(neuron_config.backend)
        with verified_copy(artifact_dir, meta, neuron_config) as private:
            config = load_model_config(private)
            in_memory = _use_huge_pages(huge_pages, backend)
            if backend.uses_host_memory():
                spec = get_export_config(config.model_type).decoder_spec(config, neuron_config)
                kv_bytes = math.prod(spec.kv_cache_shape(neuron_config.batch_size, neuron_config.sequence_length))
                weight_bytes = (Path(artifact_dir) / WEIGHTS_NAME).stat().st_size if in_memory else 0
                check_fits_host_memory(kv_bytes * neuron_config.torch_dtype.itemsize + weight_bytes,
                                       f"Loading {artifact_dir} (its KV cache{' and weights' if in_memory else ''})")
            weights = load_weights(artifact_dir, meta, huge_pages=in_memory)
            graph_specs = [GraphSpec(**g) for g in meta["graphs"]]
            graphs = backend.load(private, graph_specs, weights)
            generation_config = None
            if (private / "generation_config.json").is_file():
                generation_config = GenerationConfig.from_pretrained(private)
        model = cls(config, neuron_config, graphs, weights, artifact_dir, generation_config, tmpdir)
        logger.info("Loaded %d compiled graphs from %s in %.2f s%s", len(graphs), artifact_dir,
                    time.perf_counter() - start, "" if compiled else " (no compilation)")
        return model

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
            raise ValueError(_NO_INPUTS_EMBEDS)
        config = copy.deepcopy(generation_config or self.generation_config)
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        generation_config = self._drop_cache_options(config, generation_config, kwargs)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is not None:
            self._check_input_ids(input_ids)
            mask = kwargs.get("attention_mask")
            # Transformers drops an all-ones mask before forward, so a mask of the wrong width would go unnoticed.
            if torch.is_tensor(mask) and (mask.dim() != 2 or mask.shape[1] != input_ids.shape[1]
                                          or mask.shape[0] not in (1, input_ids.shape[0])):
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has "
                                 f"{tuple(input_ids.shape)}: pass the mask the tokenizer returned with the ids.")
            self._check_speculation(input_ids.shape[0], config, kwargs)
            handle = self._engine.handle
            continuing = any(kwargs.get(name) is handle is not None for name in ("cache", "past_key_values"))
            fitted = self._fit_generation_length(input_ids.shape, config, truncate_to_sequence_length, continuing)
            if fitted is not None:
                kwargs["max_new_tokens"] = fitted
                kwargs.pop("max_length", None)
        if getattr(self._generating, "active", False):
            raise RuntimeError("generate was called on this model while its own generate is running in the same thread "
                               "(e.g. from a streamer or stopping criterion): both would share one KV cache. Call it "
                               "after the outer generate returns, or load a second model for the inner one.")
        sampler = self._on_device_request(config, kwargs, on_device_sampling)
        if sampler is not None:  # generate searches greedily over the logits _picked returns (warpers at defaults)
            kwargs.update(do_sample=False, temperature=1.0, top_k=50, top_p=1.0)
        with self._lock, self._drafting(kwargs.get("assistant_model")):
            self._generating.active, self._engine.sampler = True, sampler
            try:
                return super().generate(inputs, generation_config=generation_config, **kwargs)
            finally:
                self._generating.active, self._engine.sampler = False, None

    def _on_device_request(self, config: GenerationConfig, kwargs: dict, asked: Optional[bool]):
        """(top_k, top_p, temperature) for the sampling graphs when this request asks only for what they do (greedy
        search, or sampling with temperature, top_k <= MAX_TOP_K and top_p) and on-device sampling is not turned
        off (`asked` False); else None, the logits path (a debug log says why). `asked` True makes that an error."""
        if asked is False:
            return None
        if not self.neuron_config.on_device_sampling:
            if asked:
                raise ValueError("on_device_sampling=True, but this export's graphs return logits only. Re-export "
                                 "with on_device_sampling=True, or leave on_device_sampling unset.")
            return None
        unable = on_device_blockers(config, kwargs, self._vocab_size)
        if unable:
            if asked:
                raise ValueError(f"on_device_sampling=True, but the graphs cannot do {', '.join(unable)}: they pick "
                                 f"tokens by greedy search, or by sampling with temperature, top_k (1 to "
                                 f"{MAX_TOP_K}, or 0 with top_p=1) and top_p. Drop those options, or leave "
                                 f"on_device_sampling unset to run them on the logits.")
            logger.debug("On-device sampling not used for this request (%s): it runs on the logits.",
                         ", ".join(unable))
            return None
        if not config.do_sample:
            return (0.0, 1.0, 0.0)
        top_k = config.top_k if config.top_k is not None else 50
        top_k = 0 if top_k >= self._vocab_size else top_k
        return (float(top_k), float(1.0 if config.top_p is None else config.top_p),
                float(1.0 if config.temperature is None else config.temperature))

    @contextlib.contextmanager
    def _drafting(self, assistant):
        """A draft model whose generation_config leaves num_assistant_tokens unset (Transformers' default: 20)
        drafts speculation_length tokens during this generate, what one verification pass scores."""
        config = getattr(assistant, "generation_config", None)
        k = self.neuron_config.speculation_length
        if not k or config is None or config.num_assistant_tokens is not None:
            yield
            return
        config.num_assistant_tokens = k
        try:
            yield
        finally:
            config.num_assistant_tokens = None

    def _check_speculation(self, batch: int, config: GenerationConfig, kwargs: dict) -> None:
        """Assisted generation (prompt lookup or a draft model) within what the verification graphs take: one
        sequence, at most speculation_length drafted tokens a pass (a draft model's, left unset, drafts that many:
        `_drafting`). Exports without verification graphs score drafts one decode step each."""
        lookup, assistant = config.prompt_lookup_num_tokens, kwargs.get("assistant_model")
        if not lookup and assistant is None:
            return
        k = self.neuron_config.speculation_length
        if batch * (config.num_return_sequences or 1) > 1:
            raise ValueError(f"Speculative decoding (prompt_lookup_num_tokens / assistant_model) scores one "
                             f"sequence at a time, but this request has {batch} prompts x "
                             f"{config.num_return_sequences or 1} sequences. Generate them one by one, or without "
                             f"speculation.")
        if not k:
            logger.warning("This export has no verification graphs (speculation_length=0): each drafted token costs "
                           "a full decode step, so speculation is no faster. Re-export with speculation_length=k to "
                           "score k drafted tokens in one pass.")
            return
        if lookup and lookup > k:
            raise ValueError(f"prompt_lookup_num_tokens={lookup} exceeds the {k} drafted tokens this export's "
                             f"verification graphs score in one pass (speculation_length={k}). Use "
                             f"prompt_lookup_num_tokens <= {k}, or re-export with speculation_length={lookup}.")
        drafted = getattr(getattr(assistant, "generation_config", None), "num_assistant_tokens", None)
        if drafted is not None and drafted > k:
            raise ValueError(f"The assistant model's generation_config.num_assistant_tokens={drafted} exceeds the {k} "
                             f"drafted tokens this export's verification graphs score in one pass (speculation_length="
                             f"{k}). Set it <= {k} (left unset, {k} is used), or re-export with speculation_length="
                             f"{drafted}.")

    @staticmethod
    def _drop_cache_options(config: GenerationConfig, generation_config, kwargs: dict):
        """The graphs always read and write their own static KV cache: `use_cache=False` or a `cache_implementation`
        would change nothing in the tokens (and Transformers' code for them does not fit a static graph). Returns
        the generation_config to pass on; kwargs are updated in place."""
        overrides = {}
        if config.use_cache is False:
            overrides["use_cache"] = True
        if config.cache_implementation is not None:
            overrides["cache_implementation"] = None
        if not overrides:
            return generation_config
        logger.warning("%s ignored: the compiled model always uses its own static KV cache (same tokens).",
                       ", ".join(f"{k}={getattr(config, k)!r}" for k in overrides))
        if generation_config is not None and not any(k in kwargs for k in overrides):
            generation_config = copy.deepcopy(generation_config)  # the caller's object stays as it was
            generation_config.update(**overrides)
        else:
            kwargs.update(overrides)
        return generation_config

    def _fit_generation_length(self, shape, config: GenerationConfig, truncate, continuing: bool = False
                               ) -> Optional[int]:
        """max_new_tokens lowered to fit sequence_length where `truncate`, else None (or an error if it does not
        fit). `continuing`: generate continues from this model's live cache (a draft model's later rounds), so only
        the tokens after it are encoded, as decode steps: no context bucket needs to hold the whole prompt."""
        nc = self.neuron_config
        batch, prompt = shape
        beams = config.num_beams or 1
        rows = batch * (beams if beams > 1 else (config.num_return_sequences or 1))
        self._check_batch(rows, f"batch of {batch} prompts x {max(beams, config.num_return_sequences or 1)} "
                                f"beams/sequences")
        if not continuing and not nc.continuous_batching:  # (continuous batching encodes long prompts in chunks)
            context_bucket(prompt, nc.context_buckets)  # raises if the prompt does not fit any bucket
        new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt
        if prompt + new_tokens <= nc.sequence_length:
            return None
        room = nc.sequence_length - prompt
        if truncate and room > 0:
            logger.warning("max_new_tokens lowered from %d to %d: prompt (%d tokens) + new tokens must fit "
                           "sequence_length=%d.", new_tokens, room, prompt, nc.sequence_length)
            return room
        raise ValueError(
            f"The prompt ({prompt} tokens) + max_new_tokens ({new_tokens}) = {prompt + new_tokens} exceeds the "
            f"compiled sequence_length ({nc.sequence_length}). Use max_new_tokens <= {max(room, 0)}, pass "
            f"truncate_to_sequence_length=True to cap it, or re-export with sequence_length >= {prompt + new_tokens}."
        )

    def _check_input_ids(self, input_ids) -> None:
        """Ids the graphs can take: out-of-vocabulary ids would abort the process inside the embedding lookup."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            got = f"shape {tuple(input_ids.shape)}" if torch.is_tensor(input_ids) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a [batch, tokens] tensor, got {got}. One prompt of n tokens is "
                             f"ids[None], shape [1, n].")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
        if input_ids.shape[0] == 0:
            raise ValueError(f"input_ids holds no prompts (shape {tuple(input_ids.shape)}): pass at least one row.")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids holds no tokens: a prompt needs at least one (e.g. the tokenizer's BOS token).")
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= self._vocab_size:
            raise ValueError(f"Token id {low if low < 0 else high} is outside this model's vocabulary (ids 0 to "
                             f"{self._vocab_size - 1}). Encode prompts with this model's tokenizer.")

    def _check_batch(self, rows: int, what: str) -> None:
        if rows > self.neuron_config.batch_size:
            raise ValueError(
                f"The {what} needs {rows} rows but the model was compiled for batch_size="
                f"{self.neuron_config.batch_size}. Split the batch, or re-export with batch_size >= {rows}."
            )

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = True, logits_to_keep=None, cache=None, labels=None, **kwargs):
        """Context encoding when the cache passed (`cache`, or `past_key_values` before Transformers 5.24) is not
        our live handle, else one decode step per token.

        Positions come from `attention_mask` (left padding); without a mask every row is full. Context encoding
        returns the last position's logits, [batch, 1, vocab], unless `logits_to_keep` asks for more (0: all, as in
        Transformers): the graphs compute logits at one position, so the last `logits_to_keep - 1` tokens are then
        fed as decode steps after the rest is encoded (assisted generation's first pass needs this).
        """
        if kwargs.get("inputs_embeds") is not None or input_ids is None:
            raise ValueError(_NO_INPUTS_EMBEDS)
        unsupported = [k for k in ("output_hidden_states", "output_attentions") if kwargs.get(k)]
        if labels is not None or unsupported:
            asked = ", ".join(["labels (a loss)"] * (labels is not None) + [f"{k}=True" for k in unsupported])
            raise ValueError(f"{asked}: the compiled graphs return logits only, at the positions generation needs. "
                             f"Run the original checkpoint with transformers.AutoModelForCausalLM for a loss, hidden "
                             f"states or attention weights.")
        served_elsewhere = [k for k in ("position_ids", "seq_ids", "sampling_params") if kwargs.get(k) is not None]
        if served_elsewhere:
            raise ValueError(f"forward({', '.join(f'{k}=...' for k in served_elsewhere)}): optimum-neuron's vLLM "
                             f"runner call is not served by forward: positions come from attention_mask (left or "
                             f"right padding) and sampling runs in generate. Pass input_ids and attention_mask, or "
                             f"call generate; requests in per-sequence slots are served by `optimum-cli neuron serve` "
                             f"(an export with continuous_batching=True; optimum_neuronx.scheduler in Python).")
        past_key_values = cache if cache is not None else past_key_values
        self._check_input_ids(input_ids)
        self._check_batch(input_ids.shape[0], f"batch of {input_ids.shape[0]} sequences")
        if attention_mask is not None:
            if not torch.is_tensor(attention_mask) or attention_mask.is_complex() or \
                    not ((attention_mask == 0) | (attention_mask == 1)).all():
                found = (torch.unique(attention_mask)[:5].tolist() if torch.is_tensor(attention_mask)
                         else type(attention_mask).__name__)
                raise ValueError(f"attention_mask must hold 0 (padding) and 1 (a real token) only, got {found}: pass "
                                 f"the mask the tokenizer returned with the ids.")
            attention_mask = attention_mask.to(torch.bool)
            empty = (~attention_mask.any(dim=-1)).nonzero().flatten().tolist()
            if empty:
                raise ValueError(f"attention_mask row(s) {empty} mark no token as real (all zeros): those rows have "
                                 f"nothing to attend to. Drop them from the batch, or pass the mask the tokenizer "
                                 f"returned with the ids.")
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


# GenerationConfig fields that add a logits processor or ask for the logits themselves: what the sampling graphs do not.
_HOST_ONLY_FIELDS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                     "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                     "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
                     "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "guidance_scale", "typical_p",
                     "min_p", "top_h", "epsilon_cutoff", "eta_cutoff", "renormalize_logits", "remove_invalid_values",
                     "watermarking_config", "output_scores", "output_logits", "prompt_lookup_num_tokens",
                     "penalty_alpha", "dola_layers")
_HOST_ONLY_KWARGS = ("assistant_model", "logits_processor", "prefix_allowed_tokens_fn", "negative_prompt_ids",
                     "custom_generate")


def on_device_blockers(config: GenerationConfig, kwargs: dict, vocab_size: int) -> list[str]:
    """What a generate request asks for that the sampling graphs cannot do, as `name=value` strings."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()
    unable = [f"{name}={getattr(config, name)!r}" for name in _HOST_ONLY_FIELDS
              if getattr(config, name, None) not in (None, defaults.get(name))
              and not (name == "guidance_scale" and getattr(config, name) == 1)]
    unable += [name for name in _HOST_ONLY_KWARGS if kwargs.get(name)]
    if (config.num_beams or 1) > 1:
        unable.append(f"num_beams={config.num_beams}")
    if config.do_sample:
        top_k = config.top_k if config.top_k is not None else 50
        top_p = 1.0 if config.top_p is None else config.top_p
        if MAX_TOP_K < top_k < vocab_size:
            unable.append(f"top_k={top_k} (more than {MAX_TOP_K})")
        if (top_k == 0 or top_k >= vocab_size) and top_p < 1.0:
            unable.append(f"top_p={top_p} without top_k")
    return unable


AutoConfig.register(NeuronCausalLMConfig.model_type, NeuronCausalLMConfig, exist_ok=True)
AutoModelForCausalLM.register(NeuronCausalLMConfig, NeuronModelForCausalLM, exist_ok=True)


def _hub_kwargs(kwargs: dict) -> dict:
    """The Transformers loading keywords among from_pretrained's (for reading a checkpoint's config)."""
    return {k: kwargs[k] for k in ("subfolder", "cache_dir", "trust_remote_code", "local_files_only",
                                   "force_download") if k in kwargs}


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


def _resolve_artifact_dir(model_id: str | Path, hub_kwargs: dict) -> tuple[Path, bool]:
    """The export's directory, and whether it was downloaded (a new source: its digests are checked)."""
    path = Path(model_id)
    if path.is_dir():
        return path, False
    text = str(model_id)
    if path.is_absolute() or text.startswith(".") or text.count("/") > 1 or isinstance(model_id, Path):
        raise ArtifactError(f"{model_id} is not a directory (and not a Hub repo id): nothing to load.")
    from .hub import DOWNLOAD_KWARGS, download_artifact

    return download_artifact(text, **{k: hub_kwargs[k] for k in DOWNLOAD_KWARGS if k in hub_kwargs}), True
