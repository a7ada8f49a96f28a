"""model_type -> ExportConfig, imported lazily (one small module per architecture)."""

from __future__ import annotations

import importlib

from .export_config import ExportConfig

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
