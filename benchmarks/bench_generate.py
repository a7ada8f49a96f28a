"""Generation benchmark: Transformers eager vs optimum-neuronx compiled graphs, side by side in one run.

    python benchmarks/bench_generate.py --quick

Per system and batch size: time to first token (generate with max_new_tokens=1), decode tokens/s
((N - 1) new tokens over the time a generation of N takes beyond the first token), median of --repeats
runs after one warm-up; for the compiled model also compile time per graph and reload time. Writes
JSON and a Markdown table to --output-dir and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.configuration import TORCH_DTYPES
from optimum_neuronx.utils.smollm2 import convert_smollm2

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _timed_generate(model, inputs, new_tokens: int) -> float:
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def measure(model, inputs, new_tokens: int, repeats: int) -> dict:
    _timed_generate(model, inputs, new_tokens)  # warm-up
    first, full = [], []
    for _ in range(repeats):
        first.append(_timed_generate(model, inputs, 1))
        full.append(_timed_generate(model, inputs, new_tokens))
    ttft, total = statistics.median(first), statistics.median(full)
    rows = inputs["input_ids"].shape[0]
    return {"ttft_s": ttft, "decode_tok_s": rows * (new_tokens - 1) / (total - ttft), "total_s": total}


def prompt_inputs(tokenizer, batch_size: int):
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer([text] * batch_size, return_tensors="pt", padding=True)


def bench_smollm2(args, work: Path) -> list[dict]:
    checkpoint = convert_smollm2(work / "smollm2")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    results = []
    for dtype in args.dtypes:
        eager = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=TORCH_DTYPES[dtype]).eval()
        export_dir = work / f"smollm2-{dtype}"
        compiled = NeuronModelForCausalLM.from_pretrained(
            checkpoint, export=True, batch_size=max(args.batch_sizes), sequence_length=args.sequence_length,
            context_buckets=[64], token_buckets=[args.sequence_length], auto_cast_type=dtype)
        compiled.save_pretrained(export_dir)
        del compiled
        start = time.perf_counter()
        compiled = NeuronModelForCausalLM.from_pretrained(export_dir)
        reload_s = time.perf_counter() - start
        compile_s = json.loads((export_dir / "neuron_config.json").read_text())["compile_time_s"]
        for batch_size in args.batch_sizes:
            inputs = prompt_inputs(tokenizer, batch_size)
            greedy = dict(max_new_tokens=args.new_tokens, do_sample=False)
            # A fast wrong model is worthless: record whether greedy tokens equal eager's (exact in fp32).
            tokens_match = torch.equal(compiled.generate(**inputs, **greedy), eager.generate(**inputs, **greedy))
            systems = {"transformers eager": eager, "optimum-neuronx (inductor)": compiled}
            for name, model in tqdm(systems.items(), desc=f"smollm2 {dtype} batch {batch_size}"):
                row = {"model": "SmolLM2-135M-Instruct", "dtype": dtype, "batch_size": batch_size, "system": name,
                       "prompt_tokens": inputs["input_ids"].shape[1], "new_tokens": args.new_tokens}
                row.update(measure(model, inputs, args.new_tokens, args.repeats))
                if model is compiled:
                    row.update(compile_s_per_graph=compile_s, reload_s=reload_s, greedy_tokens_match=tokens_match)
                results.append(row)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| model | dtype | batch | system | TTFT (ms) | decode tok/s | vs eager | greedy = eager |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results:
        base = next(r for r in results if r["system"] == "transformers eager" and r["dtype"] == row["dtype"]
                    and r["batch_size"] == row["batch_size"] and r["model"] == row["model"])
        lines.append(f"| {row['model']} | {row['dtype']} | {row['batch_size']} | {row['system']} | "
                     f"{row['ttft_s'] * 1e3:.1f} | {row['decode_tok_s']:.1f} | "
                     f"{row['decode_tok_s'] / base['decode_tok_s']:.2f}x | "
                     f"{ {True: 'yes', False: 'NO'}.get(row.get('greedy_tokens_match'), '-') } |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fp32, batch 1, 3 repeats")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(TORCH_DTYPES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work-dir", type=Path, default=None, help="checkpoints and exports (default: temporary)")
    args = parser.parse_args()
    if args.quick:
        args.dtypes, args.batch_sizes = ["fp32"], [1]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    with tempfile.TemporaryDirectory() as tmp:
        results = bench_smollm2(args, args.work_dir or Path(tmp))
    environment = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor()
                   or platform.machine(), "python": platform.python_version()}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps({"environment": environment, "results": results},
                                                             indent=2))
    table = markdown(results)
    (args.output_dir / "results.md").write_text(table + "\n")
    print(json.dumps(environment))
    print(table)
    for row in results:
        if "compile_s_per_graph" in row:
            print(f"{row['dtype']}: compile s/graph {row['compile_s_per_graph']}, reload {row['reload_s']:.2f} s")


if __name__ == "__main__":
    main()
