"""ExportConfig: how one architecture of the Llama family maps onto the shared static decoder.

An export config is a small declarative table: flags that switch decoder features on, and the
weight-name mapping from the Transformers checkpoint to the decoder's (fused) parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Union

import torch

from ..configuration import NeuronConfig
from ..modeling.spec import MAX_CONFIG_SIZE, DecoderSpec, window_cache_places
from ..modeling.layout import untile_weight
from .rope import check_long_rope_buckets, check_rope_length, check_rope_types, rope_fields


# A flag is either a constant or the name of a boolean field of the Transformers config.
Flag = Union[bool, str]

# The config fields that size the decoder (the last three optional), checked as positive integers.
CONFIG_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "intermediate_size")


def is_config_size(value) -> bool:
    """A size a config field may give: an int (not a bool) from 1 to MAX_CONFIG_SIZE."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_CONFIG_SIZE


SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

# Decoder parameter -> Transformers parameters, concatenated along dim 0 (this is how q/k/v and
# gate/up are fused). "{i}" is the layer index. Entries whose source is absent are skipped only
# when the decoder does not have that parameter (e.g. biases when the flag is off).
LLAMA_FAMILY_WEIGHTS: Mapping[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("model.embed_tokens.weight",),
    "norm.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
    "layers.{i}.input_norm.weight": ("model.layers.{i}.input_layernorm.weight",),
    "layers.{i}.post_attention_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
    "layers.{i}.qkv_proj.weight": tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
    "layers.{i}.qkv_proj.bias": tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"),
    "layers.{i}.o_proj.weight": ("model.layers.{i}.self_attn.o_proj.weight",),
    "layers.{i}.o_proj.bias": ("model.layers.{i}.self_attn.o_proj.bias",),
    "layers.{i}.q_norm.weight": ("model.layers.{i}.self_attn.q_norm.weight",),
    "layers.{i}.k_norm.weight": ("model.layers.{i}.self_attn.k_norm.weight",),
    "layers.{i}.gate_up_proj.weight": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "layers.{i}.gate_up_proj.bias": ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"),
    "layers.{i}.down_proj.weight": ("model.layers.{i}.mlp.down_proj.weight",),
    "layers.{i}.down_proj.bias": ("model.layers.{i}.mlp.down_proj.bias",),
}

_LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")



def _flag(config, flag: Flag) -> bool:
    return bool(getattr(config, flag, False)) if isinstance(flag, str) else bool(flag)


@dataclass(frozen=True)
class ExportConfig:
    model_type: str
    qkv_bias: Flag = False
    o_bias: Flag = False
    mlp_bias: Flag = False
    qk_norm: bool = False
    weight_map: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_FAMILY_WEIGHTS)
    # DecoderSpec scalar -> the config field it is read from (granite's multipliers), or a function of the config
    # (gemma3's sqrt(hidden_size) embedding scale); fields the family lacks keep the decoder's neutral value.
    scalars: Mapping[str, object] = field(default_factory=dict)
    # The config field listing, per layer, 1 where it applies RoPE and 0 where it uses no position encoding.
    rope_layers: str | None = None
    # The block's kinds (modeling.spec NORMS, POSITIONS, MLPS).
    norm: str = "rms"
    positions: str = "rope"
    mlp: str = "gated"
    # Where this family's config keeps what the decoder reads under Llama's names (gpt2: n_inner, layer_norm_epsilon,
    # activation_function).
    config_fields: Mapping[str, str] = field(default_factory=dict)
    # Decoder parameters (weight_map templates) whose checkpoint tensors are stored transposed (gpt2's Conv1D).
    transposed: tuple[str, ...] = ()
    # Norms on each branch's output too (gemma3).
    sandwich_norms: bool = False
    # Config fields whose other values change the math in ways the decoder does not implement: field -> the value
    # it must have.
    required: Mapping[str, object] = field(default_factory=dict)

    # -- validation -------------------------------------------------------------------------------
    def config_value(self, config, name: str, default=None):
        """The config value the decoder calls `name`, read where this family keeps it."""
        value = getattr(config, self.config_fields.get(name, name), None)
        return default if value is None else value

    def check_supported(self, config, neuron_config: NeuronConfig) -> None:
        """Refuse, at export, every config feature the static decoder does not implement."""
        for name in CONFIG_SIZE_FIELDS:
            value = self.config_value(config, name) if name == "intermediate_size" else getattr(config, name, None)
            if (value is None and name in CONFIG_SIZE_FIELDS[-3:]) or is_config_size(value):
                continue
            raise ValueError(f"{self.model_type}: config.{name} = {value!r} must be a positive integer (at most "
                             f"{MAX_CONFIG_SIZE}); the config is damaged or not this model's.")
        for name, value in self.required.items():
            if getattr(config, name, value) != value:
                raise ValueError(f"{self.model_type}: config.{name} = {getattr(config, name)!r} is not supported by the "
                                 f"static decoder (only {value!r}).")
        if self.positions == "learned":
            limit = config.max_position_embeddings
            if neuron_config.sequence_length > limit:
                raise ValueError(f"{self.model_type}: sequence_length = {neuron_config.sequence_length} is longer than "
                                 f"the model's learned position table (max_position_embeddings = {limit}): export "
                                 f"with sequence_length <= {limit}.")
        else:
            check_rope_length(self.model_type, config, neuron_config.sequence_length)
        check_rope_types(self.model_type, config)
        layer_types = getattr(config, "layer_types", None) or ()
        unknown = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unknown:
            raise ValueError(f"{self.model_type}: config.layer_types holds {unknown}, which the static decoder does not "
                             f"implement; supported layer types: {', '.join(SUPPORTED_LAYER_TYPES)}.")
        window = getattr(config, "sliding_window", None)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"{self.model_type}: config.sliding_window = {window!r} must be a positive integer or "
                             f"None.")
        act = self.config_value(config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"{self.model_type}: config.hidden_act = {act!r} is not supported; use one of {SUPPORTED_ACTIVATIONS}."
            )

        check_long_rope_buckets(self.model_type, config, neuron_config)

    # -- decoder spec -----------------------------------------------------------------------------
    def decoder_spec(self, config, neuron_config: NeuronConfig) -> DecoderSpec:
        self.check_supported(config, neuron_config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=self.config_value(config, "intermediate_size", 4 * config.hidden_size),
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=self.config_value(config, "rms_norm_eps"),
            hidden_act=self.config_value(config, "hidden_act", "silu"),
            qkv_bias=_flag(config, self.qkv_bias),
            o_bias=_flag(config, self.o_bias),
            mlp_bias=_flag(config, self.mlp_bias),
            qk_norm=self.qk_norm,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            **(rope_fields(config) if self.positions == "rope" else {"rope_inv_freq": (),
                                                                     "rope_attention_scaling": 1.0}),
            **{name: float(source(config) if callable(source) else getattr(config, source))
               for name, source in self.scalars.items()},
            sandwich_norms=self.sandwich_norms,
            nope_layers=self._nope_layers(config),
            **self._sliding_window(config, neuron_config),
            norm=self.norm, positions=self.positions, mlp=self.mlp,
            max_positions=config.max_position_embeddings if self.positions == "learned" else 0,
            **self._experts(config),
        )

    def _experts(self, config) -> dict:
        if self.mlp != "moe":
            return {}
        experts, top_k = int(self.config_value(config, "num_experts")), int(config.num_experts_per_tok)
        if not 0 < top_k <= experts:
            raise ValueError(f"{self.model_type}: config.num_experts_per_tok = {top_k} must lie between 1 and the "
                             f"number of experts ({experts}).")
        return {"num_experts": experts, "experts_per_token": top_k,
                "normalize_expert_weights": bool(self.config_value(config, "norm_topk_prob", True))}

    @staticmethod
    def _sliding_window(config, neuron_config: NeuronConfig) -> dict:
        """The window and the layers it applies to (config.layer_types where the config lists them, else every
        layer); none when the window covers the whole sequence_length, where it changes nothing."""
        window = getattr(config, "sliding_window", None)
        if window is None or getattr(config, "use_sliding_window", True) is False:
            return {}
        layer_types = getattr(config, "layer_types", None)
        layers = tuple(i for i in range(config.num_hidden_layers)
                       if layer_types is None or layer_types[i] == "sliding_attention")
        if not layers or window >= neuron_config.sequence_length:
            return {}
        return {"sliding_window": int(window), "sliding_layers": layers,
                "cache_places": window_cache_places(config.num_hidden_layers, layers, int(window),
                                                    neuron_config.sequence_length)}

    def _nope_layers(self, config) -> tuple[int, ...]:
        if self.rope_layers is None:
            return ()
        flags = list(getattr(config, self.rope_layers))
        if len(flags) != config.num_hidden_layers or any(f not in (0, 1, True, False) for f in flags):
            raise ValueError(f"{self.model_type}: config.{self.rope_layers} must hold one 0 or 1 per layer "
                             f"({config.num_hidden_layers}), got {flags}.")
        return tuple(i for i, rotates in enumerate(flags) if not rotates)

    # -- weights ----------------------------------------------------------------------------------
    def convert_weights(self, hf_state: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype,
                        num_layers: int = 0) -> dict:
        """Build each decoder parameter in `names` from the Transformers state dict. A stacked layer parameter
        ("layers.<name>", no index) is the `num_layers` layers' "layers.{i}.<name>" stacked along a new axis 0."""
        out = {}
        for name in names:
            if _is_stacked(name):
                if num_layers <= 0:
                    raise ValueError(f"{name!r} stacks every layer's weight: pass num_layers.")
                out[name] = torch.stack([self._converted(hf_state, _layer_name(name, i), dtype)
                                         for i in range(num_layers)])
            else:
                out[name] = self._converted(hf_state, name, dtype)
        return out

    def _converted(self, hf_state: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
        hf_names = self._sources(name)
        if hf_names is None:
            raise KeyError(f"{self.model_type}: no weight mapping for decoder parameter {name!r}.")
        missing = [n for n in hf_names if n not in hf_state]
        if missing:
            raise KeyError(
                f"{self.model_type}: the checkpoint lacks {missing} (needed for {name!r}); is this really a "
                f"{self.model_type} checkpoint?"
            )
        tensors = [hf_state[n].detach() for n in hf_names]
        if _LAYER_INDEX.sub("layers.{i}.", name) in self.transposed:
            tensors = [t.t() for t in tensors]
        return (torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]).to(dtype).contiguous()

    def _sources(self, name: str) -> list[str] | None:
        """The Transformers names one layer's or a global decoder parameter is made of (None: not mapped)."""
        match = _LAYER_INDEX.match(name)
        template = _LAYER_INDEX.sub("layers.{i}.", name) if match else name
        sources = self.weight_map.get(template)
        if sources is None:
            return None
        return [s.format(i=match.group(1)) if match else s for s in sources]

    def restore_weights(self, decoder_weights: Mapping[str, torch.Tensor], hf_state: Mapping[str, torch.Tensor]) -> dict:
        """Inverse of convert_weights: split fused (and stacked, and tiled: `StaticDecoder.arrange_weights`) decoder
        weights back into Transformers' names and shapes."""
        per_layer = {}
        for name, tensor in decoder_weights.items():
            if _is_stacked(name):
                per_layer.update({_layer_name(name, i): layer for i, layer in enumerate(tensor.unbind(0))})
            else:
                per_layer[name] = tensor
        out = {}
        for name, tensor in per_layer.items():
            hf_names = self._sources(name)
            if hf_names is None:
                continue  # derived buffers (RoPE frequencies)
            if tensor.dim() == 3 and ".experts_" not in name:  # a tiled projection weight [N / T, K, T]
                tensor = untile_weight(tensor)
            transposed = _LAYER_INDEX.sub("layers.{i}.", name) in self.transposed
            sizes = [hf_state[n].shape[-1 if transposed else 0] for n in hf_names]
            for hf_name, part in zip(hf_names, torch.split(tensor, sizes, dim=0)):
                out[hf_name] = (part.t().contiguous() if transposed else part).to(hf_state[hf_name].dtype)
        return out


def _is_stacked(name: str) -> bool:
    return name.startswith("layers.") and not _LAYER_INDEX.match(name)


def _layer_name(stacked_name: str, layer: int) -> str:
    return stacked_name.replace("layers.", f"layers.{layer}.", 1)
