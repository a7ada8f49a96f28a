"""Where a compiled token step's time goes, by parallel region: which kernels ran in them and for how long, what the
main thread did alone between them, and what forking and joining the threads cost; then what `generate` adds
around each step.

    python tools/step_breakdown.py ARTIFACT_DIR [--seconds 60] [--calls 10] [--window W] [--json PATH]

A token graph's kernels that use several threads each run as one OpenMP parallel region (GOMP_parallel): the
projections (`rows_matvec`), the decode attention, and those of Inductor's loops it parallelizes. Everything
else - Inductor's small serial loops (norms, RoPE, activations), the wrapper's tensor bookkeeping and
allocations - runs on the main thread between regions, while the other threads wait. A small C shim, preloaded
into a child process, times every region from the main thread's call to its return, and when each thread starts
and ends its part. The token graph of the largest window (or `--window`) runs over and over, `--calls` at a time,
with the cores' round trip taken around each group (core_round_trip.py), so each group is labelled by where the
host ran the two CPUs (bench_report.py's placements). On the 1.1B shape's bfloat16 batch-1 step with the CPUs apart
(docs/performance.md, 2026-11-29) this found ~0.8 ms of the 28.3 a step between regions, most of it the first
reads of data the other core had just written and of code and tensors the weight stream had evicted.

Finally `generate` runs a few times with the graphs and the model's forward wrapped in timers: a step's time
outside its graph, split into our forward's and Transformers' own. Needs a C compiler (Inductor already does)
and `nm` to name the kernels; reads nothing from the network.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core_round_trip import CoreRoundTrip, c_compiler, placement, placement_split

_CHILD = "OPTIMUM_NEURONX_STEP_BREAKDOWN_CHILD"

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void (*body_t)(void*);
typedef void (*gomp_parallel_t)(body_t, void*, unsigned, unsigned);
typedef int (*thread_num_t)(void);
static gomp_parallel_t real_parallel;
static thread_num_t thread_num;

/* One region: its body, the main thread's call and return, the main thread's part, and the other threads' latest
   start and earliest and latest ends (0: no other thread ran it). */
struct region { void* body; long long call, ret, main_start, main_end, others_start, others_first_end, others_end; };
#define MOST (1 << 20)
static struct region* regions;
static long count;
static int recording;

static long long now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

struct wrapped { body_t body; void* data; struct region* region; };

/* *at = value if it is later (later: 1) or earlier (0, or *at still 0) than *at */
static void keep(long long* at, long long value, int later) {
  long long seen = __atomic_load_n(at, __ATOMIC_RELAXED);
  while ((seen == 0 || (later ? value > seen : value < seen)) &&
         !__atomic_compare_exchange_n(at, &seen, value, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}

static void timed_body(void* arg) {
  struct wrapped* w = arg;
  struct region* r = w->region;
  const int main_thread = thread_num() == 0;
  const long long start = now();
  if (main_thread) r->main_start = start;
  else keep(&r->others_start, start, 1);
  w->body(w->data);
  const long long end = now();
  if (main_thread) { r->main_end = end; return; }
  keep(&r->others_end, end, 1);
  keep(&r->others_first_end, end, 0);
}

void GOMP_parallel(body_t body, void* data, unsigned threads, unsigned flags) {
  if (!real_parallel) {
    real_parallel = (gomp_parallel_t)dlsym(RTLD_NEXT, "GOMP_parallel");
    thread_num = (thread_num_t)dlsym(RTLD_NEXT, "omp_get_thread_num");
  }
  if (!recording || count >= MOST || !thread_num) { real_parallel(body, data, threads, flags); return; }
  if (!regions) regions = calloc(MOST, sizeof(struct region));
  if (!regions) { real_parallel(body, data, threads, flags); return; }
  struct region* r = regions + count++;
  r->body = (void*)body;
  r->others_start = r->others_first_end = r->others_end = 0;
  struct wrapped w = {body, data, r};
  r->call = now();
  real_parallel(timed_body, &w, threads, flags);
  r->ret = now();
}

void step_shim_record(int on) { recording = on; }

/* Writes the regions recorded since the last dump to `path`, one per line: the body's file and offset in it, then
   the times (ns); returns how many. */
long step_shim_dump(const char* path) {
  FILE* f = fopen(path, "w");
  if (!f) return -1;
  for (long i = 0; i < count; ++i) {
    struct region* r = regions + i;
    Dl_info info;
    const int named = dladdr(r->body, &info) && info.dli_fname;
    fprintf(f, "%s %lx %lld %lld %lld %lld %lld %lld %lld\n", named ? info.dli_fname : "?",
            named ? (unsigned long)((char*)r->body - (char*)info.dli_fbase) : 0UL, r->call, r->ret, r->main_start,
            r->main_end, r->others_start, r->others_first_end, r->others_end);
  }
  fclose(f);
  const long written = count;
  count = 0;
  return written;
}
"""

Region = collections.namedtuple(
    "Region", "kernel call ret main_start main_end others_start others_first_end others_end")


def build_shim(directory: Path) -> Path:
    compiler = c_compiler()
    if compiler is None:
        raise SystemExit("step_breakdown needs a C compiler (cc or gcc) to build its timing shim")
    source, library = directory / "step_shim.c", directory / "step_shim.so"
    source.write_text(_SHIM)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(library), "-ldl"], check=True,
                   capture_output=True)
    return library


class KernelNames:
    """The kernel a region's body belongs to, from the symbols of the graph's library (`nm`): OpenMP outlines each
    region into a local function named after its parent, which dladdr cannot see."""

    def __init__(self):
        self._tables: dict[str, tuple[list[int], list[str]]] = {}

    def __call__(self, path: str, offset: int) -> str:
        if path not in self._tables:
            self._tables[path] = self._symbols(path)
        addresses, names = self._tables[path]
        at = bisect.bisect_right(addresses, offset) - 1
        return short_kernel_name(names[at]) if at >= 0 else f"{Path(path).name}+{offset:#x}"

    @staticmethod
    def _symbols(path: str) -> tuple[list[int], list[str]]:
        nm = shutil.which("nm")
        if nm is None or not Path(path).is_file():
            return [], []
        listing = subprocess.run([nm, "-C", "--defined-only", path], capture_output=True, text=True).stdout
        rows = (line.split(None, 2) for line in listing.splitlines())  # address, type, name
        symbols = sorted((int(parts[0], 16), parts[2]) for parts in rows if len(parts) == 3)
        return [address for address, _ in symbols], [name for _, name in symbols]


def short_kernel_name(symbol: str) -> str:
    """`dot_rows_parallel<...Float32Lines, 4>._omp_fn.0` -> "rows_matvec fp32 x4" (tiles,
    `tiled_dot_parallel<...BFloat16Tiles, 4, 32>`: "rows_matvec bf16 tiles x4"); Inductor's `cpp_fused_..._5` ->
    "inductor 5"; the decode attention -> "decode_attention"."""
    if "tiled_dot_parallel" in symbol:
        rows = re.search(r"Tiles, (\d+),", symbol)
        dtype = "bf16" if "BFloat16Tiles" in symbol else "fp32"
        return f"rows_matvec {dtype} tiles x{rows.group(1) if rows else '?'}"
    if "dot_rows_parallel" in symbol:
        rows = re.search(r"Lines, (\d+)>", symbol)
        dtype = "fp32" if "Float32Lines" in symbol else "bf16"
        return f"rows_matvec {dtype} x{rows.group(1) if rows else '?'}"
    if "decode_attention" in symbol:
        return "decode_attention"
    fused = re.match(r"cpp_fused\w*?_(\d+)\b", symbol)
    if fused:
        return f"inductor {fused.group(1)}"
    return symbol.split("(")[0][:60]


def read_regions(path: Path, names: KernelNames) -> list[Region]:
    regions = []
    for line in path.read_text().splitlines():
        module, offset, *times = line.split()
        regions.append(Region(names(module, int(offset, 16)), *map(int, times)))
    return regions


def call_breakdown(start: int, end: int, regions: list[Region]) -> dict:
    """One graph call [start, end] (ns) and the regions it ran: ms in regions and between them (the main thread
    alone), the forks' and joins' costs, ms per kernel, and the time between regions by what came before and after.
    """
    inside = [r for r in regions if start <= r.call <= end]
    ms = 1e-6
    kernels, gaps = collections.Counter(), collections.Counter()
    previous, last_end = "start", start
    for r in inside:
        kernels[r.kernel] += (r.ret - r.call) * ms
        gaps[f"{previous} -> {r.kernel}"] += (r.call - last_end) * ms
        previous, last_end = r.kernel, r.ret
    gaps[f"{previous} -> end"] += (end - last_end) * ms
    in_regions = sum(r.ret - r.call for r in inside) * ms
    others = [r for r in inside if r.others_end]
    return {
        "ms": (end - start) * ms, "regions": len(inside), "in_regions_ms": in_regions,
        "between_regions_ms": (end - start) * ms - in_regions,
        # the call until the last thread starts its part (waking and handing out the work)
        "fork_ms": sum(max(r.main_start, r.others_start) - r.call for r in others) * ms,
        # the first thread done until the last one is (threads idle at the region's end)
        "imbalance_ms": sum(max(r.main_end, r.others_end) - min(r.main_end, r.others_first_end) for r in others) * ms,
        # the last thread done until the call returns
        "join_ms": sum(r.ret - max(r.main_end, r.others_end) for r in others) * ms,
        "kernels_ms": dict(kernels), "kernel_regions": dict(collections.Counter(r.kernel for r in inside)),
        "gaps_ms": dict(gaps),
    }


def _token_call(model, window: int | None):
    """A function running the token graph of `window` (the largest by default) over a full window, and its key."""
    import torch

    batch = model.neuron_config.batch_size
    ids = torch.randint(0, min(model.config.vocab_size, 1000), (batch, 4))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, eos_token_id=None, do_sample=False)
    windows = sorted(int(key.split("_")[1]) for key in model._graphs if key.startswith("token_"))
    window = window or windows[-1]
    if window not in windows:
        raise SystemExit(f"--window {window}: this model's token graphs have windows {windows}")
    engine = model._engine
    graph, step, cache = model._graphs[f"token_{window}"], engine._step, engine.cache
    slot = window - 1  # the new token in the window's last slot: attention over all of it
    step.slot.fill_(slot)
    step.positions.fill_(slot)
    cache.key_valid[:, : slot + 1] = True
    args = [step.ids, step.positions, step.slot, cache.valid_window(window), step.last, cache.kv, step.batch,
            *engine._sampling_input()]
    return (lambda: graph(list(args))), f"token_{window}"  # the graph empties the list it is given


def generate_overhead(model, rounds: int, new_tokens: int, round_trip) -> list[dict]:
    """Per generation: the median decode step (ms), its time in the token graph, our forward's time outside the
    graph, and generate's outside our forward, with the cores' round trip before and after."""
    import torch

    batch = model.neuron_config.batch_size
    in_graph, in_forward, stamps = [], [], []
    graphs = dict(model._graphs)
    forward = model.forward

    def timed(function, into):
        def run(*args, **kwargs):
            begin = time.perf_counter()
            out = function(*args, **kwargs)
            into.append(time.perf_counter() - begin)
            return out
        return run

    class Clock:  # a streamer: one put for the prompt, then one per new token
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    model._engine.graphs = {key: timed(graph, in_graph) if key.startswith("token_") else graph
                            for key, graph in graphs.items()}  # the engine makes every graph call
    model.forward = timed(forward, in_forward)
    ids = torch.randint(0, min(model.config.vocab_size, 1000), (batch, 16))
    results = []
    try:
        for _ in range(rounds):
            for timings in (in_graph, in_forward, stamps):
                timings.clear()
            before = round_trip()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, eos_token_id=None,
                           do_sample=False, streamer=Clock())
            after = round_trip()
            # put i + 1 (i >= 1) follows forward call i, the i-th decode step (the first call encodes the prompt)
            steps = range(1, len(stamps) - 1)
            results.append({
                "step_ms": 1e3 * statistics.median(stamps[i + 1] - stamps[i] for i in steps),
                "graph_ms": 1e3 * statistics.median(in_graph[i - 1] for i in steps),
                "forward_outside_graph_ms": 1e3 * statistics.median(in_forward[i] - in_graph[i - 1] for i in steps),
                "generate_outside_forward_ms": 1e3 * statistics.median(
                    stamps[i + 1] - stamps[i] - in_forward[i] for i in steps),
                "core_round_trip_ns": [before, after]})
    finally:
        model._engine.graphs, model.forward = graphs, forward
    return results


def run(args) -> dict:
    from optimum_neuronx import NeuronModelForCausalLM

    shim = ctypes.CDLL(None)
    shim.step_shim_dump.restype = ctypes.c_long
    model = NeuronModelForCausalLM.from_pretrained(args.artifact)
    call, graph = _token_call(model, args.window)
    for _ in range(3):
        call()
    trips = CoreRoundTrip()
    round_trip = lambda: trips.measure(trips=5000, batches=1)  # noqa: E731
    names, dump = KernelNames(), Path(os.environ["OPTIMUM_NEURONX_STEP_BREAKDOWN_DIR"]) / "regions.txt"
    groups, stop = [], time.monotonic() + args.seconds
    while not groups or time.monotonic() < stop:
        before, spans = round_trip(), []
        shim.step_shim_record(1)
        for _ in range(args.calls):
            start = time.monotonic_ns()
            call()
            spans.append((start, time.monotonic_ns()))
        shim.step_shim_record(0)
        after = round_trip()
        if shim.step_shim_dump(str(dump).encode()) < 0:
            raise SystemExit(f"could not write {dump}")
        regions = read_regions(dump, names)
        groups.append({"core_round_trip_ns": [before, after],
                       "calls": [call_breakdown(start, end, regions) for start, end in spans]})
    overhead = generate_overhead(model, args.generations, args.new_tokens, round_trip)
    split = placement_split([ns for item in groups + overhead for ns in item["core_round_trip_ns"]])
    by_placement = collections.defaultdict(list)
    for group in groups:
        by_placement[placement(group["core_round_trip_ns"], split)] += group["calls"]
    generate = collections.defaultdict(list)
    for item in overhead:
        generate[placement(item["core_round_trip_ns"], split)].append(item)
    return {"artifact": str(args.artifact), "graph": graph, "calls_per_group": args.calls, "placement_split_ns": split,
            "steps": {where: summarize(calls) for where, calls in by_placement.items()},
            "generate": {where: {key: statistics.median(item[key] for item in items) for key in items[0]
                                 if key != "core_round_trip_ns"} | {"generations": len(items)}
                         for where, items in generate.items()}}


def summarize(calls: list[dict]) -> dict:
    """Medians over calls of every total, and of each kernel's and each gap's ms per call."""
    summary = {"calls": len(calls)}
    for key in ("ms", "regions", "in_regions_ms", "between_regions_ms", "fork_ms", "imbalance_ms", "join_ms"):
        summary[key] = statistics.median(c[key] for c in calls)
    for part in ("kernels_ms", "kernel_regions", "gaps_ms"):
        keys = sorted({key for c in calls for key in c[part]})
        summary[part] = {key: statistics.median(c[part].get(key, 0) for c in calls) for key in keys}
    return summary


def markdown(result: dict) -> str:
    lines = [f"{result['artifact']}, graph {result['graph']} (medians per call; ms unless said)", ""]
    for where, s in result["steps"].items():
        lines += [f"CPUs {where}: {s['calls']} calls", "",
                  "| call | in regions | between regions | fork | imbalance | join | regions |",
                  "|---|---|---|---|---|---|---|",
                  f"| {s['ms']:.3f} | {s['in_regions_ms']:.3f} | {s['between_regions_ms']:.3f} | {s['fork_ms']:.3f} "
                  f"| {s['imbalance_ms']:.3f} | {s['join_ms']:.3f} | {s['regions']:.0f} |", "",
                  "| kernel | regions | ms |", "|---|---|---|"]
        lines += [f"| {k} | {s['kernel_regions'][k]:.0f} | {v:.3f} |" for k, v in
                  sorted(s["kernels_ms"].items(), key=lambda item: -item[1])]
        lines += ["", "| between regions (before -> after) | us |", "|---|---|"]
        lines += [f"| {k} | {1e3 * v:.1f} |" for k, v in sorted(s["gaps_ms"].items(), key=lambda item: -item[1])]
        lines.append("")
    for where, g in result["generate"].items():
        lines += [f"generate, CPUs {where} ({g['generations']} generations): step {g['step_ms']:.3f}, in the graph "
                  f"{g['graph_ms']:.3f}, our forward outside the graph {g['forward_outside_graph_ms']:.3f}, generate "
                  f"outside our forward {g['generate_outside_forward_ms']:.3f}"]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="a saved compiled model (save_pretrained's directory)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run token graph calls")
    parser.add_argument("--calls", type=int, default=10, help="calls per group between two round trips")
    parser.add_argument("--window", type=int, default=None, help="the token graph's window (default: the largest)")
    parser.add_argument("--generations", type=int, default=5, help="generations timed for generate's overhead")
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens per timed generation (>= 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.new_tokens < 3 or args.calls < 1 or args.generations < 1:
        parser.error("--new-tokens must be >= 3, --calls and --generations >= 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get(_CHILD) == "1":
        result = run(args)
        print(markdown(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    # The shim must be in place before libgomp: preloaded into a child process.
    with tempfile.TemporaryDirectory(prefix="step-breakdown-") as directory:
        shim = build_shim(Path(directory))
        preload = " ".join(filter(None, [str(shim), os.environ.get("LD_PRELOAD", "")]))
        env = dict(os.environ, LD_PRELOAD=preload, OPTIMUM_NEURONX_STEP_BREAKDOWN_DIR=directory, **{_CHILD: "1"})
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), *argv], env=env)


if __name__ == "__main__":
    sys.exit(main())
