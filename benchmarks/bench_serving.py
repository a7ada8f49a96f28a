"""Serving benchmark: the OpenAI-compatible server (continuous batching) under Poisson arrivals, side by side with
the same requests served one at a time and by static-batch `generate`, in one run.

    python benchmarks/bench_serving.py            # SmolLM2-135M fp32, batch_size 8, 64 requests, 3 rates, 2 budgets
    python benchmarks/bench_serving.py --quick    # 16 requests, one rate, one budget

Requests have mixed prompt (16-192 tokens) and output (16-160 tokens) lengths, fixed by --seed, and ignore EOS so
that every system generates the same tokens. For each prefill budget (the server's --prefill_budget: prompt tokens
encoded between two decode steps while others decode) and request rate, the `openai` client streams every request
and records when each token arrives: output tokens/s (all output tokens over the time from the first arrival to the
last token), time to first token (TTFT) and inter-token latency (ITL) p50/p99. Baselines on the same requests:
(a) one at a time through the same server; (b) static-batch `generate` in batches of batch_size in arrival order,
each batch generating its longest request's length and starting once its last request has arrived and the batch
before it is done (each batch's time measured in-process; "offline": every request there at once). "Of the arrival
bound": the share of what the arrivals allow (each request done as fast as alone, from its arrival): at low rates
no server can reach the others' multiples. The median decode step is the engine stepping all batch_size slots, timed
in-process. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXPORT = dict(batch_size=8, sequence_length=512, context_buckets=[16, 128], token_buckets=[128, 256, 512],
              continuous_batching=True)


def workload(count: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(16, 192))], rng.randint(16, 160))
            for _ in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


async def _one(client, model: str, prompt: list[int], max_tokens: int, start: float, delay: float) -> dict:
    await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
    arrived = time.monotonic()
    stamps, tokens = [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.monotonic())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"arrived": arrived, "stamps": stamps, "tokens": tokens}


async def drive(url: str, model: str, requests, delays: list[float]) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600) as client:
        start = time.monotonic()
        return await asyncio.gather(*(_one(client, model, p, m, start, d) for (p, m), d in zip(requests, delays)))


def summarize(results: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in results)
    span = max(r["stamps"][-1] for r in results) - min(r["arrived"] for r in results)
    ttft = [r["stamps"][0] - r["arrived"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    return {"output_tok_s": tokens / span, "tokens": tokens, "seconds": span,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99)}


def static_batches(export_dir: Path, requests, batch_size: int) -> dict:
    """Each static batch's generate time (seconds), in arrival order, and the median decode step."""
    import torch

    from optimum_neuronx import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(export_dir)
    seconds = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width, new = max(len(p) for p, _ in batch), max(m for _, m in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        start = time.monotonic()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        seconds.append(time.monotonic() - start)
    return {"batch_seconds": seconds, "step_ms": step_times_ms(model, requests)}


def static_under_arrivals(requests, batch_size: int, batch_seconds: list[float], delays: list[float]) -> dict:
    """Static batching served as the requests arrive: a batch starts when its last request is there and the batch
    before it is done. Tokens counted are those asked for (the rest of a batch's steps is waste)."""
    end = 0.0
    for k, seconds in enumerate(batch_seconds):
        end = max(end, delays[min(len(delays), (k + 1) * batch_size) - 1]) + seconds
    tokens = sum(m for _, m in requests)
    return {"output_tok_s": tokens / end, "tokens": tokens, "seconds": end}


def arrival_bound(requests, delays: list[float], alone_tok_s: float) -> float:
    """About the most output tokens/s any server gets at these arrivals: each request done, from its arrival, as fast
    as requests served alone average (tokens over the time from the first arrival to the last request's end)."""
    end = max(delay + max_tokens / alone_tok_s for delay, (_, max_tokens) in zip(delays, requests))
    return sum(m for _, m in requests) / end


def step_times_ms(model, requests, steps: int = 40) -> dict:
    """Median times of what one continuous-batching iteration runs at full load: the engine stepping every slot
    ("decode"), a prefill chunk of the smallest context bucket alone ("chunk") and both in one fused call ("fused":
    the other slots stepped while the last one takes the chunk)."""
    import torch

    engine = model._engine
    slots = list(range(engine.slots))
    for slot, (prompt, _) in zip(slots, requests):
        engine.free(slot)
        for start in range(0, len(prompt), engine.chunk(len(prompt))):
            engine.prefill(slot, torch.tensor(prompt[start:start + engine.chunk(len(prompt) - start)]))
    size = engine.chunk(10**6, limit=1)
    chunk = torch.tensor(requests[0][0][:size])
    times = {"decode": [], "chunk": [], "fused": []}
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step(slots, [100] * len(slots))
        times["decode"].append(time.perf_counter() - begin)
        engine.free(slots[-1])
        begin = time.perf_counter()
        engine.prefill(slots[-1], chunk)
        times["chunk"].append(time.perf_counter() - begin)
        if engine.fused_chunk:
            engine.free(slots[-1])
            begin = time.perf_counter()
            engine.fused_step(slots[:-1], [100] * (len(slots) - 1), None, slots[-1], chunk)
            times["fused"].append(time.perf_counter() - begin)
    for slot in slots:
        engine.free(slot)
    return {name: 1e3 * statistics.median(values) for name, values in times.items() if values}


def start_server(export_dir: Path, port: int, budget: int, log: Path, max_waiting: int) -> subprocess.Popen:
    import httpx2

    server = subprocess.Popen([sys.executable, "-m", "optimum_neuronx.serve", "--model", str(export_dir), "--port",
                               str(port), "--max_waiting", str(max_waiting), "--served_model_name", "smollm2",
                               "--prefill_budget", str(budget)], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while True:
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx2.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited: see {log}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="requests per second")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 128], help="the server's --prefill_budget")
    parser.add_argument("--one-at-a-time", type=int, default=16, help="requests served alone for baseline (a)")
    parser.add_argument("--context-buckets", type=int, nargs="+", default=EXPORT["context_buckets"],
                        help="the export's context buckets; the smallest is the chunk a fused step carries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-serving"))
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rates, args.budgets, args.one_at_a_time = 16, [2.0], [16], 4
    args.output_dir.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig

    from optimum_neuronx import NeuronModelForCausalLM
    from optimum_neuronx.utils.smollm2 import convert_smollm2

    export = dict(EXPORT, context_buckets=sorted(args.context_buckets))
    work = args.output_dir / "work"
    checkpoint = convert_smollm2(work / "smollm2")
    export_dir = work / ("export-" + "-".join(map(str, export["context_buckets"])))
    if not (export_dir / "neuron_config.json").is_file():
        NeuronModelForCausalLM.from_pretrained(checkpoint, export=True, **export).save_pretrained(export_dir)
    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    requests = workload(args.requests, vocab, args.seed)
    rng = random.Random(args.seed + 1)
    arrivals = {}
    for rate in args.rates:
        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            t += rng.expovariate(rate)
        arrivals[rate] = delays

    results = {"export": export, "requests": args.requests, "server": [], "cpu": os.cpu_count()}
    for budget in args.budgets:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(export_dir, port, budget, args.output_dir / f"server-{budget}.log", args.requests)
        try:
            asyncio.run(drive(url, "smollm2", requests[:2], [0.0, 0.0]))  # warm-up
            for rate in args.rates:
                row = {"budget": budget, "rate": rate,
                       **summarize(asyncio.run(drive(url, "smollm2", requests, arrivals[rate])))}
                results["server"].append(row)
                print(row, flush=True)
            if "one_at_a_time" not in results:
                alone = []
                for request in requests[:args.one_at_a_time]:
                    alone += asyncio.run(drive(url, "smollm2", [request], [0.0]))
                tokens = sum(r["tokens"] for r in alone)
                seconds = sum(r["stamps"][-1] - r["arrived"] for r in alone)
                results["one_at_a_time"] = {"output_tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
                print(f"one at a time: {results['one_at_a_time']}", flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
    static = static_batches(export_dir, requests, export["batch_size"])
    results["static_generate"] = {
        "offline": static_under_arrivals(requests, export["batch_size"], static["batch_seconds"],
                                         [0.0] * len(requests)),
        **{str(rate): static_under_arrivals(requests, export["batch_size"], static["batch_seconds"], arrivals[rate])
           for rate in args.rates}}
    results["arrival_bound"] = {str(rate): arrival_bound(requests, arrivals[rate],
                                                         results["one_at_a_time"]["output_tok_s"])
                                for rate in args.rates}
    results["median_decode_step_ms"] = static["step_ms"]["decode"]
    results["median_step_ms"] = static["step_ms"]
    print(f"static generate: {results['static_generate']}", flush=True)
    (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
    (args.output_dir / "results.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    alone, step = results["one_at_a_time"]["output_tok_s"], results["median_decode_step_ms"]
    static = results["static_generate"]
    bounds = results.get("arrival_bound", {})
    lines = ["| system | prefill budget | rate (req/s) | output tok/s | of the arrival bound | vs one at a time | "
             "vs static generate | TTFT p50 / p99 ms | ITL p50 / p99 ms | ITL p99 / median step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["server"]:
        baseline, bound = static[str(r["rate"])]["output_tok_s"], bounds.get(str(r["rate"]))
        share = "" if bound is None else f"{r['output_tok_s'] / bound:.0%} of {bound:.1f}"
        lines.append(f"| server (continuous batching) | {r['budget']} | {r['rate']} | {r['output_tok_s']:.1f} | "
                     f"{share} | {r['output_tok_s'] / alone:.2f}x | {r['output_tok_s'] / baseline:.2f}x | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.0f} / "
                     f"{r['itl_p99_ms']:.0f} | {r['itl_p99_ms'] / step:.2f} |")
    batch = results["export"]["batch_size"]
    for key, row in static.items():
        lines.append(f"| (b) static generate, batches of {batch} | | {key} | {row['output_tok_s']:.1f} | | "
                     f"{row['output_tok_s'] / alone:.2f}x | 1.00x | | | |")
    lines.append(f"| (a) one at a time (server) | | - | {alone:.1f} | | 1.00x | | | | |")
    lines.append(f"\nMedian decode step (all {batch} slots): {step:.1f} ms.")
    times = results["median_step_ms"]
    if "fused" in times:
        lines.append(f"A prefill chunk of {results['export']['context_buckets'][0]} tokens alone: "
                     f"{times['chunk']:.1f} ms; fused into a decode step of the other slots: {times['fused']:.1f} ms "
                     f"for both.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
