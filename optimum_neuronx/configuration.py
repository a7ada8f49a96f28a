"""NeuronConfig: the static shapes, buckets, dtype and compiler settings an export is made for."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from .instances import DEFAULT_INSTANCE_TYPE, SUPPORTED_TP_DEGREES, InstanceType, instance_type

NEURON_CONFIG_NAME = "neuron_config.json"

# Accepted spellings of auto_cast_type -> canonical name.
DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "f32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "f16": "fp16", "half": "fp16",
}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Smallest default bucket: below this, compiling one more graph costs more than the cache reads it saves.
MIN_DEFAULT_BUCKET = 128
# Default sequence_length: the model's context length, capped here (as optimum-neuron does): a longer KV cache costs
# memory and compile time for lengths few requests reach.
MAX_DEFAULT_SEQUENCE_LENGTH = 4096
# The most graphs one export compiles: each costs a compile (seconds to minutes) and a load.
MAX_GRAPHS = 64
# Weight-only quantizations an export can ask for (modeling/quantization.py implements them).
QUANTIZATIONS = ("int8",)
# The compiler backends (backends/); backends.get_backend(name) loads one.
SUPPORTED_BACKENDS = ("inductor", "neuron")
def canonical_dtype(auto_cast_type: Any) -> str:
    if isinstance(auto_cast_type, torch.dtype):
        auto_cast_type = str(auto_cast_type).replace("torch.", "")
    name = DTYPE_ALIASES.get(str(auto_cast_type).lower())
    if name is None:
        raise ValueError(
            f"Unknown auto_cast_type {auto_cast_type!r}. Use one of: 'fp32', 'bf16', 'fp16' "
            f"(aliases: {', '.join(sorted(DTYPE_ALIASES))})."
        )
    return name


def default_buckets(sequence_length: int) -> tuple[int, ...]:
    """Powers of two from 128 up to `sequence_length`, plus `sequence_length` itself."""
    buckets = []
    size = min(MIN_DEFAULT_BUCKET, sequence_length)
    while size < sequence_length:
        buckets.append(size)
        size *= 2
    buckets.append(sequence_length)
    return tuple(buckets)


def normalize_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(int(b) for b in buckets)))


@dataclass(frozen=True)
class GraphSpec:
    """One compiled graph: `tokens` new tokens per sequence attending to `window` cache slots."""

    # "context" (prefill), "token" (decode), "verify" (speculation), "prefill" (one row, chunked) or "fused" (a token
    # for every row and a prefill chunk of `tokens` for one row, in one call)
    kind: str
    tokens: int
    window: int

    @property
    def name(self) -> str:
        # prefill graphs all span the whole cache: they differ in their tokens
        return f"{self.kind}_{self.tokens if self.kind == 'prefill' else self.window}"

    def rows(self, batch_size: int) -> int:
        """The rows the graph runs, in an export of `batch_size`: a prefill graph encodes one row of the cache, a
        fused graph runs one row of all its tokens (`batch_size` of them, then the chunk)."""
        return 1 if self.kind in ("prefill", "fused") else batch_size

    def samples(self, on_device_sampling: bool) -> bool:
        """Whether this graph picks tokens too, in an export with `on_device_sampling` (verification graphs never)."""
        return on_device_sampling and self.kind != "verify"

    @property
    def logits_positions(self) -> int:
        """Positions per sequence the graph returns logits for: every new token of a verification graph, else one."""
        return self.tokens if self.kind == "verify" else 1


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


@dataclass(frozen=True)
class NeuronConfig:
    """Everything that fixes the shapes and numerics of the compiled graphs.

    `context_buckets` are the prompt lengths a context-encoding (prefill) graph is compiled for;
    `token_buckets` are how much of the KV cache a token-generation (decode) graph attends to.
    Left as None, both default to powers of two from 128 up to `sequence_length`.
    """

    batch_size: int = 1
    sequence_length: int = 1024
    context_buckets: Optional[tuple[int, ...]] = None
    token_buckets: Optional[tuple[int, ...]] = None
    auto_cast_type: str = "fp32"
    tp_degree: int = 1
    backend: str = "inductor"
    compiler_args: tuple[str, ...] = field(default_factory=tuple)
    # The Neuron instance the graphs are planned and compiled for (INSTANCE_TYPES); None: DEFAULT_INSTANCE_TYPE.
    instance_type: Optional[str] = None
    # Speculative decoding (optimum-neuron's name): > 0 adds a verification graph per token bucket that scores the
    # last accepted token and up to this many drafted ones in one pass (generate's prompt_lookup_num_tokens or
    # assistant_model), batch_size 1 only.
    speculation_length: int = 0
    # Weight-only quantization of the layers' projections (modeling/quantization.py): "int8", or None.
    quantization: Optional[str] = None
    # The context and token graphs also pick the next token (greedy, temperature, top-k, top-p: modeling/sampling.py)
    # and generate uses those tokens where the request asks for nothing more (optimum-neuron's name).
    on_device_sampling: bool = False
    # Rows served independently (optimum-neuron's name): each context bucket becomes a prefill graph that encodes
    # one row of the cache, in chunks from any slot (a prompt longer than the largest bucket too), and the token
    # graphs write each row at its own position, so requests join and leave the batch at any step (engine.py); with
    # batch_size > 1, a fused graph per token bucket also decodes every row and prefills a chunk of the smallest
    # context bucket in one call, reading the weights once for both.
    continuous_batching: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        _positive_int("batch_size", self.batch_size)
        seq = _positive_int("sequence_length", self.sequence_length)
        set_("auto_cast_type", canonical_dtype(self.auto_cast_type))
        set_("context_buckets", self._buckets("context_buckets", self.context_buckets, seq))
        set_("token_buckets", self._buckets("token_buckets", self.token_buckets, seq))
        if self.token_buckets[-1] != seq:
            raise ValueError(
                f"The largest token-generation bucket ({self.token_buckets[-1]}) must equal sequence_length "
                f"({seq}) so that decoding can use the whole KV cache: add {seq} to token_buckets."
            )
        count = len(self.context_buckets) + len(self.token_buckets) * (2 if self.speculation_length else 1)
        if count > MAX_GRAPHS:
            raise ValueError(f"{len(self.context_buckets)} context and {len(self.token_buckets)} token buckets make "
                             f"{count} graphs to compile, more than {MAX_GRAPHS}: pass fewer context_buckets / "
                             f"token_buckets (the defaults are powers of two).")
        if self.instance_type is not None:
            instance = instance_type(self.instance_type)
            if self.tp_degree not in instance.tp_degrees:
                raise ValueError(f"tp_degree (num_cores) {self.tp_degree!r} is not supported on {instance.name} "
                                 f"({instance.cores} NeuronCores); use one of {instance.tp_degrees}.")
        elif self.tp_degree not in SUPPORTED_TP_DEGREES:
            raise ValueError(
                f"tp_degree (num_cores) {self.tp_degree!r} is not supported; use one of {SUPPORTED_TP_DEGREES}."
            )
        if isinstance(self.speculation_length, bool) or not isinstance(self.speculation_length, int) or \
                self.speculation_length < 0:
            raise ValueError(f"speculation_length must be a non-negative integer (0: no speculation), got "
                             f"{self.speculation_length!r}.")
        if self.speculation_length:
            if self.batch_size != 1:
                raise ValueError(f"speculation_length={self.speculation_length} needs batch_size=1 (Transformers' "
                                 f"assisted generation scores one sequence's drafts), got batch_size="
                                 f"{self.batch_size}. Export with batch_size=1, or without speculation_length.")
            if self.speculation_length + 1 >= seq:
                raise ValueError(f"speculation_length={self.speculation_length} leaves no room in sequence_length="
                                 f"{seq}: a verification pass takes speculation_length + 1 tokens. Use "
                                 f"speculation_length <= {max(seq - 2, 0)}.")
        if not isinstance(self.continuous_batching, bool):
            raise ValueError(f"continuous_batching must be True or False, got {self.continuous_batching!r}.")
        if not isinstance(self.on_device_sampling, bool):
            raise ValueError(f"on_device_sampling must be True or False, got {self.on_device_sampling!r}.")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"Unknown quantization {self.quantization!r}; supported: {', '.join(QUANTIZATIONS)} "
                             f"(weight-only, one scale per output channel), or None for none.")
        if self.backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"Unknown backend {self.backend!r}; supported backends: {', '.join(SUPPORTED_BACKENDS)}.")
        if isinstance(self.compiler_args, str) or not all(isinstance(a, str) for a in self.compiler_args):
            raise ValueError(f"compiler_args must be a list of strings, got {self.compiler_args!r}.")
        set_("compiler_args", tuple(self.compiler_args))

    @staticmethod
    def _buckets(name: str, buckets: Optional[Iterable[int]], sequence_length: int) -> tuple[int, ...]:
        if buckets is None:
            return default_buckets(sequence_length)
        try:
            values = normalize_buckets(buckets)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a list of positive integers, got {buckets!r}.") from None
        if not values:
            raise ValueError(f"{name} must not be empty (got {buckets!r}); leave it unset for the defaults.")
        if values[0] < 1 or values[-1] > sequence_length:
            raise ValueError(
                f"{name} {list(values)} must lie between 1 and sequence_length ({sequence_length}); "
                f"raise sequence_length or drop the larger buckets."
            )
        return values

    @property
    def instance(self) -> InstanceType:
        """The instance type planned for (DEFAULT_INSTANCE_TYPE when none was given)."""
        return instance_type(self.instance_type or DEFAULT_INSTANCE_TYPE)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.auto_cast_type]

    def graphs(self) -> list[GraphSpec]:
        """Every graph of an export: one context-encoding graph per context bucket (a one-row prefill graph with
        continuous_batching), one token graph per token bucket,
        and with speculation_length one verification graph per token bucket wider than a verification pass; with
        continuous_batching and several rows, one fused graph per token bucket at least as wide as the smallest
        context bucket (its chunk size)."""
        contexts = [GraphSpec("prefill", size, self.sequence_length) if self.continuous_batching
                    else GraphSpec("context", size, size) for size in self.context_buckets]
        tokens = [GraphSpec("token", 1, size) for size in self.token_buckets]
        width = self.speculation_length + 1  # a verification pass: the last accepted token and the drafted ones
        verify = [GraphSpec("verify", width, size) for size in self.token_buckets if size > width] \
            if self.speculation_length else []
        chunk = self.context_buckets[0]
        fused = [GraphSpec("fused", chunk, size) for size in self.token_buckets if size >= chunk] \
            if self.continuous_batching and self.batch_size > 1 else []
        return contexts + tokens + verify + fused

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("context_buckets", "token_buckets", "compiler_args"):
            out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "NeuronConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown NeuronConfig fields {sorted(unknown)}; known fields: {sorted(known)}.")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    @classmethod
    def for_model(cls, config: Any, **options) -> "NeuronConfig":
        """A NeuronConfig for the model `config` (a Transformers config) describes: `options` as given (None: unset),
        sequence_length defaulting to the model's context length (capped at MAX_DEFAULT_SEQUENCE_LENGTH) and
        auto_cast_type to the checkpoint's dtype, as optimum-neuron does."""
        options = {k: v for k, v in options.items() if v is not None}
        if "sequence_length" not in options:
            length = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 1024
            options["sequence_length"] = min(int(length), MAX_DEFAULT_SEQUENCE_LENGTH)
        if "auto_cast_type" not in options:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            options["auto_cast_type"] = DTYPE_ALIASES.get(str(dtype).removeprefix("torch.").lower(), "fp32")
        if "backend" not in options and options.get("tp_degree", 1) > 1:
            options["backend"] = "neuron"  # the backend that shards: what num_cores > 1 asks for
        return cls(**options)

    @classmethod
    def from_pretrained(cls, model_id: str | Path, *, revision: Optional[str] = None, token: Optional[str] = None,
                        cache_dir: Optional[str] = None, local_files_only: bool = False) -> "NeuronConfig":
        """The NeuronConfig of an export (a directory or a Hub repo id), reading its neuron_config.json only."""
        path = Path(model_id)
        if not path.is_dir():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(model_id), NEURON_CONFIG_NAME, revision=revision, token=token,
                                        cache_dir=cache_dir, local_files_only=local_files_only)).parent
        try:
            return cls.from_json_file(path / NEURON_CONFIG_NAME)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{model_id}: {NEURON_CONFIG_NAME} is missing or is not an optimum-neuronx export's "
                             f"({err!r}).") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> "NeuronConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f)["neuron_config"])
