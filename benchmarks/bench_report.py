"""The generation benchmark's report (bench_generate.py runs the systems): each decode repeat set against the
bandwidth sampled right before and after it, the Markdown table, and the plot.

A virtual machine's memory bandwidth can move from one minute to the next, so each repeat carries its own share
of the bound (the samples on both sides of it) and the table gives the median of those shares.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Callable

# Our systems: one of the package's backends, some with export options beyond the dtype.
OUR_BACKENDS = {"optimum-neuronx (inductor)": "inductor", "optimum-neuronx (neuron)": "neuron",
                "optimum-neuronx (inductor, int8)": "inductor",
                "optimum-neuronx (inductor, on-device sampling)": "inductor"}
EXPORT_OPTIONS = {"optimum-neuronx (inductor, int8)": {"quantization": "int8"},
                  "optimum-neuronx (inductor, on-device sampling)": {"on_device_sampling": True}}
SYSTEMS = ("transformers eager", "transformers static+compile", *OUR_BACKENDS)


def fastest_gb_s(sample: dict) -> float:
    """A bandwidth sample's fastest probe (a BLAS GEMV can be compute-limited, bf16 without bf16 dot products, and a
    bound below what a system reaches would measure the probe, not the memory)."""
    return max(value for name, value in sample.items() if name.endswith("_gb_s"))


def label_repeats(rows: list[dict]) -> None:
    """Give each decode repeat its rate's share of the bound sampled right before and after it
    ("percent_of_bound"; row["tok_s_per_gb_s"] turns GB/s into its tokens/s)."""
    for row in rows:
        samples = row.get("bandwidth", {}).get("samples", [])
        repeats = row.get("decode_repeats", [])
        if "tok_s_per_gb_s" not in row or len(samples) != len(repeats) + 1:
            continue  # the job samples before its first repeat and after each one
        for timed, before, after in zip(repeats, samples, samples[1:]):
            bound_tok_s = (fastest_gb_s(before) + fastest_gb_s(after)) / 2 * row["tok_s_per_gb_s"]
            timed["percent_of_bound"] = 100 * timed["decode_tok_s"] / bound_tok_s


def percent_of_bound(row: dict) -> float:
    """The median of the row's repeats' shares of the bound around each; without them, its median rate over the
    median bound."""
    shares = [timed["percent_of_bound"] for timed in row.get("decode_repeats", []) if "percent_of_bound" in timed]
    return statistics.median(shares) if shares else 100 * row["decode_tok_s"] / row["bound_tok_s"]


def _same(row: dict, **fields) -> Callable[[dict], bool]:
    """Matches a row that ran, like `row` but for `fields`."""
    keys = ("model", "dtype", "batch_size", "system")
    return lambda other: "error" not in other and all(other[k] == fields.get(k, row[k]) for k in keys)


def markdown(rows: list[dict]) -> str:
    lines = ["| model | dtype | batch | system | TTFT ms (prompt tokens) | TTFT vs eager | decode tok/s | decode vs eager "
             "| % of bound | bound GB/s (spread) | peak RSS (GiB) | greedy = eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['batch_size']} | {r['system']} | failed: {r['error']} "
                         f"| | | | | | | |")
            continue
        base = next(filter(_same(r, system=SYSTEMS[0]), rows), None)
        longest = max(r["ttft_s"], key=int)
        ttft = ", ".join(f"{r['ttft_s'][n] * 1e3:.0f} ({n})" for n in sorted(r["ttft_s"], key=int))
        # Eager time over ours: above 1 means faster than eager.
        ttft_ratio = f"{base['ttft_s'][longest] / r['ttft_s'][longest]:.2f}x ({longest})" if base else "-"
        ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        match = r.get("greedy_tokens_match", "-")
        bw = r["bandwidth"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['batch_size']} | {r['system']} | {ttft} | {ttft_ratio} | "
                     f"{r['decode_tok_s']:.1f} | {ratio} | {percent_of_bound(r):.0f}% | "
                     f"{bw['bound_gb_s']:.1f} ({bw['bound_min_gb_s']:.1f}-{bw['bound_max_gb_s']:.1f}) | "
                     f"{r['peak_rss_gib']:.2f} | {match} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.warning("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    ok = [r for r in rows if "error" not in r]
    labels = [f"{r['model']}\n{r['dtype']} b{r['batch_size']}\n{r['system']}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(ok)), 5))
    ax.bar(range(len(ok)), [r["decode_tok_s"] for r in ok], color=["C%d" % SYSTEMS.index(r["system"]) for r in ok])
    ax.scatter(range(len(ok)), [r["bound_tok_s"] for r in ok], marker="_", s=400, color="k", label="bandwidth bound")
    ax.set_xticks(range(len(ok)), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s (all rows)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
