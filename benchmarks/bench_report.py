"""The generation benchmark's report (bench_generate.py runs the systems): each decode repeat set against the
bandwidth sampled right before and after it and labelled by where the host ran the two CPUs, the Markdown
tables, and the plot.

Where the host runs a virtual machine's two CPUs sets how fast its memory streams (core_round_trip.py): on the
Zen 4 guest of docs/performance.md a cache line's round trip between them is ~55-110 ns while two threads read
~30-35 GB/s, >= 300 ns while they read ~53-62 GB/s, and it switches within seconds. A median over repeats from
both, or a ratio between two systems that ran in different ones, measures the host. So each repeat carries its
own share of the bound (samples on both sides of it) and a placement; the second table compares like with like.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Callable

SYSTEMS = ("transformers eager", "transformers static+compile", "optimum-neuronx (inductor)")
# Two placements differ this much in their round trips at least: ~2.7x on the Zen 4 guest (110 -> 300 ns), while
# neighbouring round trips of one placement, sorted, sit within a few %.
PLACEMENT_GAP = 2.0
# Labels of a repeat's placement, in table order: all its round trips below the run's split, all above, some of
# each, or a run without two placements (or without round trips: one CPU).
PLACEMENTS = ("near", "apart", "mixed", "one placement")


def fastest_gb_s(sample: dict) -> float:
    """A bandwidth sample's fastest probe (a BLAS GEMV can be compute-limited, bf16 without bf16 dot products, and a
    bound below what a system reaches would measure the probe, not the memory); not the round trip beside them."""
    return max(value for name, value in sample.items() if name.endswith("_gb_s"))


def placement_split(round_trips) -> float | None:
    """The round trip (ns) between the two placements a run saw: the geometric middle of the first gap of
    PLACEMENT_GAP or more, from the shortest; None when there is none (one placement, or no round trips)."""
    values = sorted(ns for ns in round_trips if ns is not None)
    for shorter, longer in zip(values, values[1:]):
        if longer >= PLACEMENT_GAP * shorter:
            return (shorter * longer) ** 0.5
    return None


def placement(round_trips: list, split: float | None) -> str:
    if split is None or None in round_trips:
        return "one placement"
    sides = {ns >= split for ns in round_trips}
    return "mixed" if len(sides) > 1 else ("apart" if sides.pop() else "near")


def _sample_round_trips(sample: dict) -> list:
    """A bandwidth sample's round trips, before and after its probes ([None] where it has none)."""
    return sample.get("core_round_trip_ns", [None])


def _run_round_trips(rows: list[dict]):
    for row in rows:
        for sample in row.get("bandwidth", {}).get("samples", []):
            yield from _sample_round_trips(sample)
        for timed in row.get("decode_repeats", []):
            yield from timed["core_round_trip_ns"]


def label_repeats(rows: list[dict]) -> float | None:
    """Give each decode repeat its rate's share of the bound sampled right before and after it
    ("percent_of_bound"; row["tok_s_per_gb_s"] turns GB/s into its tokens/s) and where the CPUs ran ("cpus":
    the round trips at both ends of both samples and of the repeat, against the run's split). Returns the split."""
    split = placement_split(_run_round_trips(rows))
    for row in rows:
        samples = row.get("bandwidth", {}).get("samples", [])
        repeats = row.get("decode_repeats", [])
        if "tok_s_per_gb_s" not in row or len(samples) != len(repeats) + 1:
            continue  # the job samples before its first repeat and after each one
        for timed, before, after in zip(repeats, samples, samples[1:]):
            bound_tok_s = (fastest_gb_s(before) + fastest_gb_s(after)) / 2 * row["tok_s_per_gb_s"]
            timed["percent_of_bound"] = 100 * timed["decode_tok_s"] / bound_tok_s
            timed["cpus"] = placement([*_sample_round_trips(before), *timed["core_round_trip_ns"],
                                       *_sample_round_trips(after)], split)
    return split


def percent_of_bound(row: dict) -> float:
    """The median of the row's repeats' shares of the bound around each; without them, its median rate over the
    median bound."""
    shares = [timed["percent_of_bound"] for timed in row.get("decode_repeats", []) if "percent_of_bound" in timed]
    return statistics.median(shares) if shares else 100 * row["decode_tok_s"] / row["bound_tok_s"]


def round_trip_cell(row: dict) -> str:
    """The cores' round trips taken around a row's decode repeats: median (least-most), or "-" where none was."""
    taken = [ns for timed in row.get("decode_repeats", []) for ns in timed["core_round_trip_ns"] if ns is not None]
    return f"{statistics.median(taken):.0f} ({min(taken):.0f}-{max(taken):.0f})" if taken else "-"


def _same(row: dict, **fields) -> Callable[[dict], bool]:
    """Matches a row that ran, like `row` but for `fields`."""
    keys = ("model", "dtype", "batch_size", "system")
    return lambda other: "error" not in other and all(other[k] == fields.get(k, row[k]) for k in keys)


def markdown(rows: list[dict]) -> str:
    lines = ["| model | dtype | batch | system | TTFT ms (prompt tokens) | TTFT vs eager | decode tok/s | decode vs eager "
             "| % of bound | bound GB/s (spread) | core round trip ns (spread) | peak RSS (GiB) "
             "| greedy = eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['batch_size']} | {r['system']} | failed: {r['error']} "
                         f"| | | | | | | | |")
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
                     f"{round_trip_cell(r)} | {r['peak_rss_gib']:.2f} | {match} |")
    return "\n".join(lines)


def _by_placement(row: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for timed in row.get("decode_repeats", []):
        if "cpus" in timed:
            groups.setdefault(timed["cpus"], []).append(timed)
    return groups


def _median_rate(row: dict | None, cpus: str) -> float | None:
    repeats = _by_placement(row).get(cpus) if row else None
    return statistics.median(timed["decode_tok_s"] for timed in repeats) if repeats else None


def placement_markdown(rows: list[dict], split: float | None) -> str:
    """Per row and placement of the CPUs, the repeats that ran in it: their median rate, share of the bound around
    each, and ratios to eager and to the smallest batch in the same placement ("-" where that has no repeat in it,
    and for repeats whose placement changed)."""
    where = (f"near: every round trip around a repeat below {split:.0f} ns; apart: every one above; mixed: some "
             f"of each" if split is not None else "the run saw one placement")
    lines = [f"Decode by where the host ran the two CPUs ({where}):", "",
             "| model | dtype | batch | system | CPUs | repeats | decode tok/s | % of bound | vs eager "
             "| vs smallest batch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        groups = _by_placement(r) if "error" not in r else {}
        smallest = min((other["batch_size"] for other in rows
                        if _same(r, batch_size=other["batch_size"])(other)), default=None)
        for cpus in (c for c in PLACEMENTS if c in groups):
            rate = _median_rate(r, cpus)
            share = statistics.median(timed["percent_of_bound"] for timed in groups[cpus])
            ratios = []
            for other in (next(filter(_same(r, system=SYSTEMS[0]), rows), None),
                          next(filter(_same(r, batch_size=smallest), rows), None)):
                rate_there = _median_rate(other, cpus) if cpus != "mixed" else None
                ratios.append(f"{rate / rate_there:.2f}x" if rate_there else "-")
            lines.append(f"| {r['model']} | {r['dtype']} | {r['batch_size']} | {r['system']} | {cpus} | "
                         f"{len(groups[cpus])} | {rate:.1f} | {share:.0f}% | {ratios[0]} | {ratios[1]} |")
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
