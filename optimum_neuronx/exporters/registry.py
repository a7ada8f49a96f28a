"""model_type -> ExportConfig, imported lazily (one small module per architecture)."""

from __future__ import annotations

import importlib

from .export_config import CONFIG_SIZE_FIELDS, ExportConfig, is_config_size

_EXPORT_CONFIG_MODULES = {
    "gemma3_text": "gemma3",
    "gpt2": "gpt2",
    "granite": "granite",
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "smollm3": "smollm3",
}


def load_model_config(model_id, **kwargs):
    """Transformers' AutoConfig for `model_id`, its failures on a damaged config.json (a zero head count, nesting
    deeper than Python recurses, wrong types) turned into one ValueError naming the file and the cause."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError):
        raise
    except RecursionError:
        raise ValueError(f"{model_id}: config.json nests too deeply to be a model's config.") from None
    except (ArithmeticError, TypeError, KeyError, AttributeError, StrictDataclassError) as err:
        raise ValueError(f"{model_id}: config.json is not a valid model config ({_damaged_field(model_id)}"
                         f"{type(err).__name__}: {err}).") from None


def _damaged_field(model_id) -> str:
    """"config.NAME = VALUE must be a positive integer; " for the first size field of a local config.json that is
    not one, else ""."""
    import json
    from pathlib import Path

    try:
        fields = json.loads((Path(model_id) / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return ""
    for name in (*CONFIG_SIZE_FIELDS, "n_head", "n_layer", "n_embd"):  # gpt2's own names too
        value = fields.get(name) if isinstance(fields, dict) else None
        if value is not None and not is_config_size(value):
            return f"config.{name} = {value!r} must be a positive integer; "
    return ""


# Model types close to a supported one, with what to do instead.
_HINTS = {
    "gemma3": "it is Gemma 3's vision-language model (Gemma3ForConditionalGeneration). Export a text checkpoint "
              "(Gemma3ForCausalLM, model_type gemma3_text), e.g. google/gemma-3-1b-it.",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_EXPORT_CONFIG_MODULES))


def get_export_config(model_type: str) -> ExportConfig:
    module = _EXPORT_CONFIG_MODULES.get(model_type)
    if model_type in _HINTS:
        raise ValueError(f"model_type {model_type!r} is not supported by optimum-neuronx: {_HINTS[model_type]}")
    if module is None:
        raise ValueError(
            f"model_type {model_type!r} is not supported by optimum-neuronx. "
            f"Supported model types: {', '.join(supported_model_types())}."
        )
    return importlib.import_module(f"{__package__}.{module}").EXPORT_CONFIG
