"""`pipeline("text-generation", model=...)` over a compiled model: Transformers' own pipeline class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..runtime import NEURON_KWARGS, NeuronModelForCausalLM

SUPPORTED_TASKS = ("text-generation",)


def pipeline(task: str = "text-generation", model: Any = None, tokenizer: Any = None, export: bool = False,
             **kwargs):
    """Build a Transformers `TextGenerationPipeline` running a NeuronModelForCausalLM.

    `model` is an exported directory, a Hub id, a Transformers checkpoint (with `export=True` and export
    options such as batch_size / sequence_length), or a NeuronModelForCausalLM. Other keywords go to
    `transformers.pipeline` (e.g. generation defaults are passed at call time as usual).
    optimum-neuron's `input_shapes={"batch_size": ..., "sequence_length": ...}` and
    `compiler_args={"num_cores": ..., "auto_cast_type": ...}` dicts are taken as the same export options.
    """
    import transformers

    if task not in SUPPORTED_TASKS:
        raise ValueError(f"Task {task!r} is not supported; supported tasks: {', '.join(SUPPORTED_TASKS)}.")
    if model is None:
        raise ValueError("pipeline() needs a model: an exported directory, a Hub id, or a NeuronModelForCausalLM.")
    export_kwargs = _optimum_neuron_export_kwargs(kwargs)
    export_kwargs.update({k: kwargs.pop(k) for k in list(kwargs) if k in NEURON_KWARGS})
    if not isinstance(model, NeuronModelForCausalLM):
        if not isinstance(model, (str, Path)):
            raise TypeError(f"model must be a path, a Hub id or a NeuronModelForCausalLM, got {type(model).__name__}.")
        model = NeuronModelForCausalLM.from_pretrained(model, export=export, **export_kwargs)
    elif export_kwargs or export:
        raise ValueError(f"{sorted(export_kwargs) or ['export']} only apply when model is a path or Hub id.")
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer or model.artifact_dir)
    # Batched generation needs left padding; a tokenizer without a pad token borrows eos.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs.setdefault("batch_size", model.neuron_config.batch_size)
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, **kwargs)


def _optimum_neuron_export_kwargs(kwargs: dict) -> dict:
    """optimum-neuron's pipeline dicts (`input_shapes`, and `compiler_args` given as a dict) as export options."""
    merged = {}
    for name in ("input_shapes", "compiler_args"):
        value = kwargs.get(name)
        if not isinstance(value, dict):
            continue
        del kwargs[name]
        unknown = sorted(k for k in value if k not in NEURON_KWARGS)
        if unknown:
            raise ValueError(f"pipeline({name}={value!r}): {unknown} are not export options; known: "
                             f"{', '.join(sorted(NEURON_KWARGS))}.")
        clash = sorted(k for k in value if k in merged and merged[k] != value[k])
        if clash:
            raise ValueError(f"pipeline: input_shapes and compiler_args disagree on {clash}: pass each once.")
        merged.update(value)
    return merged


__all__ = ["pipeline", "SUPPORTED_TASKS"]
