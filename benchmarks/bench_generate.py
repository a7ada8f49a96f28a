"""Generation benchmark: Transformers eager, Transformers static cache + torch.compile (its `generate` compiling
the decode step), and optimum-neuronx compiled graphs (the inductor backend, and the neuron backend's StableHLO graphs
on the XLA CPU device where no Neuron device is), side by side in one run on the same prompts, with the
machine's memory-bandwidth bound.

    python benchmarks/bench_generate.py --quick     # SmolLM2 fp32, batch 1, 128-token prompt (2 cores: 3-5 min)
    python benchmarks/bench_generate.py             # + bf16, batch 4, 512-token prompts, TinyLlama-1.1B shape
    python benchmarks/bench_generate.py --models granite-230m-shape qwen3-moe-400m-shape  # other families (SHAPES)

Each (model, dtype, system, batch size) runs in its own subprocess, so peak RSS is per system and batch size; the
batch sizes of one system take turns, one phase at a time, so their decode repeats alternate and the ratio between
them compares the same minutes. Time to first token (generate with max_new_tokens=1) for each --prompt-tokens
length (random token prompts) at the smallest batch size; per batch size, decode tokens/s on the shortest prompt
((N - 1) new tokens per row over the time from the first new token to the last within the same generation of N,
taken by a streamer, all rows counted), median of --repeats runs after a warm-up. Our model is exported once per
batch size (static shapes); compile time per graph, reload time, and greedy tokens checked against eager for each
export. Roofline: a BLAS matrix-vector product, a plain copy and a multiply + sum compiled like our decode
projections, over a 1 GiB matrix of the job's dtype, give the bandwidth decode can use; the parent process samples
them before and after every timed decode repeat (the job waits meanwhile), so a bound and the rate it bounds come
from the same minutes. Bound = the median over those samples of the fastest probe / bytes read per decode step
(streamed weights + KV cache in use). Before the first job, the checkpoints are made in a process of their own
while the first probe compiles. Writes results.json, results.md and results.png to --output-dir (bench_report.py:
each repeat set against the samples right before and after it).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
# this script's directory is on sys.path when it runs
from bench_report import EXPORT_OPTIONS, OUR_BACKENDS, SYSTEMS, fastest_gb_s, label_repeats, markdown, plot

from optimum_neuronx.configuration import TORCH_DTYPES

# A job prints this line and waits for one line on stdin while its parent samples the
# memory bandwidth: the bound is measured around the very repeats it bounds, by a process that is not timed.
PROBE_REQUEST = "@@bandwidth-probe"
# A job prints this line and waits for one on stdin before each phase it times (see request_turn).
TURN_REQUEST = "@@turn"
TINYLLAMA_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
# Random-weight models of a family's architecture at a size this benchmark runs in minutes: model_type, config.
SHAPES = {
    "tinyllama-1.1b-shape": ("llama", TINYLLAMA_SHAPE),
    # Granite's multipliers, 230M parameters (16 layers, GQA 16/4, tied embeddings)
    "granite-230m-shape": ("granite", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                           num_attention_heads=16, num_key_value_heads=4, vocab_size=49155,
                                           tie_word_embeddings=True, embedding_multiplier=12.0,
                                           residual_multiplier=0.22, attention_multiplier=0.015625,
                                           logits_scaling=8.0, max_position_embeddings=4096)),
    # Qwen3-MoE, 400M parameters of which 86M active: 32 experts a layer, top 4
    "qwen3-moe-400m-shape": ("qwen3_moe", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                               num_key_value_heads=4, head_dim=64, num_experts=32,
                                               num_experts_per_tok=4, moe_intermediate_size=384,
                                               intermediate_size=3072, vocab_size=32000, norm_topk_prob=True,
                                               tie_word_embeddings=False, max_position_embeddings=4096)),
}


# -- models -----------------------------------------------------------------------------------------------
def model_checkpoint(name: str, work: Path) -> Path:
    if name == "smollm2":
        from optimum_neuronx.utils.smollm2 import convert_smollm2

        return convert_smollm2(work / "smollm2")
    directory = work / name
    if not (directory / "config.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        model_type, shape = SHAPES[name]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).save_pretrained(directory)
    return directory


def prepare_checkpoints(models: list[str], work: Path, meanwhile: Callable[[], object],
                        make: Callable[[str, Path], Path] = model_checkpoint) -> dict[str, Path]:
    """Every model's checkpoint (`make`), made in a process of its own while this one runs `meanwhile()` (compiling
    a bandwidth probe): neither is timed, and each keeps a core busy for half a minute or more (SmolLM2's GGUF
    conversion and a probe's kernels take tens of seconds each). Both are done before this returns."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: this one's OpenMP threads do not fork
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        futures = {name: pool.submit(make, name, work) for name in models}
        meanwhile()
        return {name: future.result() for name, future in futures.items()}


def prompt_inputs(checkpoint: Path, batch_size: int, prompt_tokens: int, vocab_size: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (batch_size, prompt_tokens), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# -- one system, in its own process ----------------------------------------------------------------------
def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class TokenClock:
    """A `generate` streamer (Transformers' `BaseStreamer` interface) that only notes when each put arrives: the
    prompt first, then each new token as generate picks it."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _timed(model, inputs, new_tokens: int, **extra) -> float:
    """Seconds for a generation of exactly `new_tokens` per row."""
    return _generation_times(model, inputs, new_tokens, **extra)[0]


def _generation_times(model, inputs, new_tokens: int, **extra) -> tuple[float, float | None]:
    """A generation of exactly `new_tokens` per row: its seconds, and the seconds from its first new token to its
    last (None for one token), which is what decode rates are taken from (a time to first token measured in other
    minutes would let the prefill's drift into them). eos_token_id=None instead of min_new_tokens: the min-length
    logits processor runs `isin` over the whole vocabulary every step, a cost a user's generate does not pay."""
    prompt_tokens = inputs["input_ids"].shape[1]
    clock = TokenClock()
    start = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=new_tokens, eos_token_id=None, do_sample=False,
                            streamer=clock, **extra)
    seconds = time.perf_counter() - start
    if output.shape[1] != prompt_tokens + new_tokens:
        raise RuntimeError(f"generated {output.shape[1] - prompt_tokens} tokens per row, asked for {new_tokens}")
    if len(clock.times) != new_tokens + 1:  # the prompt, then one put per new token
        raise RuntimeError(f"generate streamed {len(clock.times)} times for {new_tokens} new tokens")
    return seconds, (clock.times[-1] - clock.times[1] if new_tokens > 1 else None)


def request_probe() -> None:
    print(PROBE_REQUEST, flush=True)
    sys.stdin.readline()


def request_turn() -> None:
    """Wait until the parent lets this job run. The batch sizes of one system run in processes of their own that
    take turns (load + warm-up + TTFT, then one decode repeat per turn), so their decode repeats alternate and
    the batch-4 / batch-1 ratio compares the same minutes of a host whose bandwidth drifts."""
    print(TURN_REQUEST, flush=True)
    sys.stdin.readline()


def measure(model, inputs: dict, new_tokens: int, repeats: int, probe=lambda: None, turn=lambda: None,
            **extra) -> dict:
    """`inputs`: prompt length -> inputs; decode is timed on the shortest prompt, TTFT on each. `probe()` runs
    before and after every timed decode repeat; `turn()` before each repeat; each repeat's seconds go to
    "decode_repeats". Longer prompts' TTFT comes last: Transformers keeps a static cache for the next generation that fits in it, so a 512-token
    prompt's cache would carry into the decode runs (a graph of another size for torch.compile, attention over
    more slots)."""
    lengths = sorted(inputs)
    shortest = inputs[lengths[0]]
    # Warm-up (and, for torch.compile, compilation) as long as the timed runs: Transformers sizes a static cache
    # to the generation, so a shorter one compiled a graph that the timed runs could not use.
    _timed(model, shortest, new_tokens, **extra)
    compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def time_to_first_token(prompt: dict) -> float:
        _timed(model, prompt, 1, **extra)
        return statistics.median(_timed(model, prompt, 1, **extra) for _ in range(repeats))

    ttft = {lengths[0]: time_to_first_token(shortest)}
    timed_repeats = []
    for repeat in range(repeats):
        turn()
        if repeat == 0:
            probe()
        seconds, decode_seconds = _generation_times(model, shortest, new_tokens, **extra)
        timed_repeats.append({"seconds": seconds, "decode_seconds": decode_seconds})
        probe()
    decode_times = [timed["decode_seconds"] for timed in timed_repeats]
    for length in lengths[1:]:
        ttft[length] = time_to_first_token(inputs[length])
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] != compiled_graphs:
        raise RuntimeError("torch.compile compiled a graph during the timed runs: the warm-up did not compile what "
                           "they run")
    rows = shortest["input_ids"].shape[0]

    def decode_tok_s(seconds: float) -> float:
        return rows * (new_tokens - 1) / seconds

    for timed in timed_repeats:
        timed["decode_tok_s"] = decode_tok_s(timed["decode_seconds"])
    return {"ttft_s": ttft, "decode_tok_s": decode_tok_s(statistics.median(decode_times)),
            "decode_repeats": timed_repeats}


def export_for_batch(job: dict, batch_size: int, prompts: list[int]) -> Path:
    """Our artifact for one batch size (static shapes: a batch-1 request on a batch-4 export computes 4 rows).
    Its context buckets are the prompt lengths timed at that batch size; token buckets reach the decode length."""
    from optimum_neuronx import NeuronModelForCausalLM

    checkpoint, dtype, backend = Path(job["checkpoint"]), job["dtype"], OUR_BACKENDS[job["system"]]
    options = EXPORT_OPTIONS.get(job["system"], {})
    decode_length = prompts[0] + job["new_tokens"]
    sequence_length = max(decode_length, prompts[-1] + 1)
    variant = "".join(f"-{value if isinstance(value, str) else name}" for name, value in options.items())
    export_dir = Path(job["work"]) / (f"{checkpoint.name}-{dtype}-{backend}{variant}-b{batch_size}-"
                                      f"p{'_'.join(map(str, prompts))}")
    if not (export_dir / "neuron_config.json").exists():
        NeuronModelForCausalLM.from_pretrained(
            checkpoint, export=True, compile_cache=False, batch_size=batch_size, sequence_length=sequence_length,
            context_buckets=prompts, token_buckets=sorted({decode_length, sequence_length}), auto_cast_type=dtype,
            backend=backend, **options,
        ).save_pretrained(export_dir)
    return export_dir


def greedy_matches_eager(model, job: dict, batch_size: int) -> str:
    """A fast wrong model is worthless: greedy tokens (16, or --new-tokens if fewer: the export's sequence length is
    sized for those) against eager's at the same dtype, with the verdict of
    `optimum-cli neuron verify` ("yes", "NO", or in half precision "near-tie": differing only at rounding-level
    ties, see optimum_neuronx.verification.Comparison)."""
    from transformers import AutoModelForCausalLM

    from optimum_neuronx.verification import compare_generation

    from optimum_neuronx.verification import reference_from_artifact

    checkpoint, dtype = Path(job["checkpoint"]), TORCH_DTYPES[job["dtype"]]
    if model.neuron_config.quantization:  # the model the export computes: its int8-rounded weights
        reference = reference_from_artifact(model.artifact_dir).to(dtype)
    else:
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    inputs = prompt_inputs(checkpoint, batch_size, min(job["prompt_tokens"]), model.config.vocab_size)
    return compare_generation(reference, model, **inputs, max_new_tokens=min(16, job["new_tokens"])).verdict


def timed_prompts(prompts: list[int], batch_size: int, batch_sizes: list[int]) -> list[int]:
    """Time to first token for every prompt length at the smallest batch; larger batches time decode only."""
    return sorted(prompts) if batch_size == min(batch_sizes) else sorted(prompts)[:1]


def run_system(job: dict) -> dict:
    """One system at one batch size (or, with export_only, our exports for every batch size)."""
    from transformers import AutoModelForCausalLM

    from optimum_neuronx import NeuronModelForCausalLM

    torch.set_num_threads(job["threads"])
    # loading, warm-up and the shortest prompt's time to first token run in this job's first turn (longer
    # prompts' in its last, after the decode repeats)
    request_turn()
    checkpoint, dtype, system = Path(job["checkpoint"]), job["dtype"], job["system"]
    if job.get("export_only"):  # compile in a process of its own, so peak RSS below is the serving process's
        for batch_size in job["batch_sizes"]:
            export_for_batch(job, batch_size, timed_prompts(job["prompt_tokens"], batch_size, job["batch_sizes"]))
        return {}
    batch_size, prompts = job["batch_size"], sorted(job["prompt_tokens"])
    result: dict = {}
    extra = {}
    try:
        if system in OUR_BACKENDS:
            export_dir = export_for_batch(job, batch_size, prompts)
            start = time.perf_counter()
            model = NeuronModelForCausalLM.from_pretrained(export_dir)
            result["reload_s"] = time.perf_counter() - start
            stamp = json.loads((export_dir / "neuron_config.json").read_text())
            result["compile_s_per_graph"] = stamp["compile_time_s"]
            if model.neuron_config.backend == "inductor":
                result["weights_huge_page_share"] = weights_huge_page_share(model)
        else:
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=TORCH_DTYPES[dtype]).eval()
            if system == "transformers static+compile":
                extra = {"cache_implementation": "static", "compile_config": static_cache_compile_config()}
        inputs = {n: prompt_inputs(checkpoint, batch_size, n, model.config.vocab_size) for n in prompts}
        probe = request_probe if job.get("probe") else (lambda: None)
        result.update(measure(model, inputs, job["new_tokens"], job["repeats"], probe, request_turn, **extra))
        if "compile_config" in extra and not hasattr(model, "_compiled_call"):
            raise RuntimeError("generate ran the static cache without compiling its decode step")
        result["peak_rss_gib"] = peak_rss_gib()  # before the check below loads a reference model
        if system in OUR_BACKENDS:
            result["greedy_tokens_match"] = greedy_matches_eager(model, job, batch_size)
    except Exception as err:  # record, don't hide, a system that does not work here
        result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    return result


def weights_huge_page_share(model) -> float:
    """The share of the span of our model's loaded weights in 2 MiB pages: the loader reads them into huge pages,
    and where memory is too full or fragmented for all of them the rest stays in 4 KiB pages, which slows decode
    (optimum_neuronx/huge_pages.py)."""
    from optimum_neuronx.huge_pages import huge_page_share_between

    weights = [w for w in model._weights.values() if w.numel()]
    return huge_page_share_between(min(w.data_ptr() for w in weights), max(w.data_ptr() + w.nbytes for w in weights))


def static_cache_compile_config():
    """Transformers' own recipe for a static cache + torch.compile: `generate` compiles the decode step (the
    prefill, whose length varies, runs eager) with a `CompileConfig`. It does so on accelerators only unless the
    config's `_compile_all_devices` flag (the one Transformers' own tests set) allows the CPU; mode "default", as
    "reduce-overhead" asks for CUDA graphs. Compiling `model.forward` by hand instead compiled the prefill too: a
    second graph (~95 s of a 2-core run's 160 s of compilation) for the same decode speed."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


def peak_rss_gib() -> float:
    """This process's own high-water RSS. Not getrusage's ru_maxrss: Linux carries that across fork + exec, so
    every job would report at least the parent's RSS at spawn time (the bandwidth probe's 2 GiB of matrices)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_jobs(jobs: list[dict], timeout: float, probe=None) -> list[dict]:
    """Each job in a subprocess of its own; they take turns (see request_turn): one runs while the others wait on a
    pipe. A crash or a timeout (`timeout` seconds for all of them) is recorded as that job's result, not raised.
    `probe()` answers the jobs' bandwidth requests; a job's samples land in its result as "bandwidth"."""
    with contextlib.ExitStack() as stack:
        procs, stderrs = [], []
        for job in jobs:
            # stderr to a file, not a pipe: a chatty job can't fill it and block
            stderrs.append(stack.enter_context(tempfile.TemporaryFile("w+")))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--job", json.dumps(dict(job, probe=probe is not None))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderrs[-1], text=True,
                env=dict(os.environ, TOKENIZERS_PARALLELISM="false")))
        timer = threading.Timer(timeout, lambda: [proc.kill() for proc in procs])
        timer.start()
        samples: list[list] = [[] for _ in jobs]
        last = [""] * len(jobs)

        def run_until_turn_ends(i: int) -> bool:
            """Read job i's output until it asks for its next turn (True) or exits (False)."""
            for line in iter(procs[i].stdout.readline, ""):
                if line.startswith(TURN_REQUEST):
                    return True
                if line.startswith(PROBE_REQUEST):
                    samples[i].append(probe())
                    release(procs[i])
                elif line.strip():
                    last[i] = line
            return False

        try:
            waiting = collections.deque(i for i in range(len(jobs)) if run_until_turn_ends(i))
            while waiting:
                i = waiting.popleft()
                if release(procs[i]) and run_until_turn_ends(i):
                    waiting.append(i)
            for proc in procs:
                proc.wait()
        finally:
            timed_out = not timer.is_alive()
            timer.cancel()
            for proc in procs:
                proc.kill()
        results = []
        for i, proc in enumerate(procs):
            if timed_out:
                results.append({"error": f"timed out after {timeout:.0f} s (--job-timeout)"})
            elif proc.returncode != 0:
                stderrs[i].seek(0)
                results.append({"error": f"{failure_line(stderrs[i].read())} (exit {proc.returncode})"[:240]})
            else:
                results.append(json.loads(last[i]))
                if samples[i] and "error" not in results[i]:
                    results[i]["bandwidth"] = bandwidth_summary(samples[i])
    return results


def release(proc: subprocess.Popen) -> bool:
    """Answer a job waiting on its stdin; False if it is gone (killed by the timeout)."""
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        return True
    except BrokenPipeError:
        return False


def run_batches(job: dict, timeout: float, probe=None) -> dict[int, dict]:
    """One system at each of job["batch_sizes"]: our exports first (compiled in a process of their own, so peak
    RSS is the serving process's), then one process per batch size, taking turns. Batch size -> its numbers."""
    batch_sizes = job["batch_sizes"]
    if job["system"] in OUR_BACKENDS:
        exported = run_jobs([dict(job, export_only=True)], timeout)[0]
        if "error" in exported:
            return {batch_size: exported for batch_size in batch_sizes}
    results = run_jobs([dict(job, batch_size=batch_size,
                             prompt_tokens=timed_prompts(job["prompt_tokens"], batch_size, batch_sizes))
                        for batch_size in batch_sizes], timeout, probe)
    return dict(zip(batch_sizes, results))


def failure_line(stderr: str) -> str:
    """The exception (or fatal error) line of a failed job's stderr, not its last progress bar."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and "%|" not in line]
    errors = [line for line in lines if re.match(r"^(Fatal Python error|[\w.]*(Error|Exception)\b)", line)]
    return (errors or lines or ["no output"])[-1]


# -- roofline ---------------------------------------------------------------------------------------------
class BandwidthProbe:
    """GB/s over a matrix far beyond caches: a BLAS matrix-vector product, a plain copy, and the compiled
    multiply + sum and dot-product kernel our decode graphs use; each `sample()` is the best of `repeats` runs
    of each (a neighbour on a shared host only ever slows a run down). The matrices sit in huge pages where our
    exports' weights do (optimum_neuronx/huge_pages.py): 4 KiB pages streamed ~20% slower in fast memory phases,
    and a bound from them would understate what the memory gives."""

    def __init__(self, dtype: torch.dtype, megabytes: int = 1024):
        cols = 4096
        shape = (megabytes * 2**20 // (cols * dtype.itemsize), cols)
        self.weight = self._matrix(shape, dtype, torch.randn(shape))
        self.x = torch.randn(1, cols).to(dtype)
        self.dst = self._matrix(shape, dtype, torch.zeros(()))
        self.reduction = self._decode_reduction()
        self.dot_kernel = self._dot_kernel()

    @staticmethod
    def _matrix(shape: tuple, dtype: torch.dtype, values: torch.Tensor) -> torch.Tensor:
        """`values` (broadcast) in a matrix of huge pages, collapsed into them as the weights' loader does."""
        from optimum_neuronx.weights_io import HUGE_PAGE_TARGET
        from optimum_neuronx.huge_pages import huge_page_buffer, huge_pages_available, settle

        if not huge_pages_available():
            return torch.empty(shape, dtype=dtype).copy_(values)
        buffer = huge_page_buffer(shape[0] * shape[1] * dtype.itemsize)
        matrix = buffer.view(dtype).view(shape).copy_(values)
        settle(buffer, HUGE_PAGE_TARGET)
        return matrix

    def _decode_reduction(self):
        """The multiply + sum compiled the way our decode graphs' projections are (software prefetch of the rows
        included, see optimum_neuronx.backends.inductor.codegen): a probe slower than the loop decode runs would
        understate the bound. Compiled here, outside any cache, so a cached kernel from before can't stand in."""
        from torch._inductor import config as inductor_config

        from optimum_neuronx.backends.inductor.codegen import decode_codegen

        reduction = torch.compile(lambda w, v: (w * v).sum(-1))
        with decode_codegen(), inductor_config.patch(force_disable_caches=True):
            reduction(self.weight, self.x)
        return reduction

    def _dot_kernel(self):
        """Our dot-product kernel (`rows_matvec`), which decode runs where this CPU has it: compiled into a one-op
        AOTInductor graph (the weight an input, not a constant). None where decode does not use it."""
        from torch._inductor.package import load_package, package_aoti

        from optimum_neuronx.backends import get_backend
        from optimum_neuronx.backends.inductor.custom_kernels import c_shim_options
        from optimum_neuronx.backends.inductor.ops import rows_matvec

        isa = get_backend("inductor").dot_kernel_isa(self.weight.dtype)
        if not isa:
            return None

        class DotKernel(torch.nn.Module):
            def forward(self, x, weight):
                return rows_matvec(x, weight)

        args = (self.x, self.weight)
        program = torch.export.export(DotKernel(), args, strict=False)
        with tempfile.TemporaryDirectory(prefix="bench-dot-kernel-") as directory:
            files = torch._inductor.aot_compile(program.module(), args, options={
                "aot_inductor.package": True, "force_disable_caches": True, **c_shim_options(4, isa)})
            return load_package(package_aoti(str(Path(directory) / "dot.pt2"), files))

    def sample(self, repeats: int = 3) -> dict:
        """Each probe's GB/s ("..._gb_s")."""
        nbytes = self.weight.numel() * self.weight.dtype.itemsize

        def best_gb_s(fn, traffic: int) -> float:
            fn()
            return traffic / min(_seconds(fn) for _ in range(repeats)) / 1e9

        samples = {"gemv_gb_s": best_gb_s(lambda: torch.nn.functional.linear(self.x, self.weight), nbytes),
                   "copy_gb_s": best_gb_s(lambda: self.dst.copy_(self.weight), 2 * nbytes),
                   "reduction_gb_s": best_gb_s(lambda: self.reduction(self.weight, self.x), nbytes)}
        if self.dot_kernel is not None:
            samples["dot_kernel_gb_s"] = best_gb_s(lambda: self.dot_kernel(self.x, self.weight), nbytes)
        return samples


def bandwidth_summary(samples: list[dict]) -> dict:
    """The bound of one measurement: per sample the fastest probe (a BLAS GEMV can be compute-limited, bf16
    without bf16 dot products, and a bound below what a system reaches would measure the probe, not the memory),
    then the median over the samples taken around its decode repeats, with their spread."""
    fastest = [fastest_gb_s(sample) for sample in samples]
    return {"bound_gb_s": statistics.median(fastest), "bound_min_gb_s": min(fastest),
            "bound_max_gb_s": max(fastest), "samples": samples}


def bytes_per_decode_step(checkpoint: Path, dtype: str, batch_size: int, cached_tokens: int,
                          quantization: str | None = None) -> int:
    from transformers import AutoConfig

    from optimum_neuronx import NeuronConfig
    from optimum_neuronx.exporters import get_export_config
    from optimum_neuronx.memory import weight_bytes

    config = AutoConfig.from_pretrained(checkpoint)
    neuron_config = NeuronConfig(sequence_length=cached_tokens, context_buckets=[cached_tokens],
                                 token_buckets=[cached_tokens], auto_cast_type=dtype, quantization=quantization)
    spec = get_export_config(config.model_type).decoder_spec(config, neuron_config)
    size = neuron_config.torch_dtype.itemsize
    kv = 2 * spec.num_layers * batch_size * cached_tokens * spec.num_kv_heads * spec.head_dim * size
    # An untied embedding table is only gathered from (one row per token), not streamed.
    gathered = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    if spec.mlp == "moe":  # a step reads the experts its tokens pick, at most batch_size * top-k of them a layer
        unread = spec.num_experts - min(spec.num_experts, batch_size * spec.experts_per_token)
        gathered += unread * 3 * spec.intermediate_size * spec.hidden_size * spec.num_layers
    return weight_bytes(spec, neuron_config) - gathered * size + kv  # int8 projections at 1 byte (+ scales)


# Speculation by prompt lookup: a request whose answer repeats its prompt (rewrite a paragraph), SmolLM2 chat.
REWRITE_PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper climbed "
    "the narrow stairs to light the lamp, and every morning he wrote in his logbook the ships he had seen pass. When "
    "the keeper grew old, the town decided to replace the lamp with an automatic light, but the people still climbed "
    "the hill on summer evenings to watch the beam sweep across the dark water.")
REWRITE_REQUEST = "Rewrite the following paragraph in the past perfect tense, keeping every sentence:\n\n"


def measure_prompt_lookup(work: Path, speculation_length: int, new_tokens: int, repeats: int) -> dict:
    """SmolLM2 fp32, batch 1, on the rewrite request: plain greedy decoding and greedy with prompt lookup
    (generate(prompt_lookup_num_tokens=k) on an export with verification graphs for k drafted tokens), repeats
    alternating; tokens/s over the whole generation, whether the text is identical, and the share of drafted tokens
    accepted."""
    from transformers import AutoTokenizer

    from optimum_neuronx import NeuronModelForCausalLM
    from optimum_neuronx.kv_cache import CacheHandle

    checkpoint = model_checkpoint("smollm2", work)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": REWRITE_REQUEST + REWRITE_PARAGRAPH}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(text, return_tensors="pt")
    prompt = inputs["input_ids"].shape[1]
    model = NeuronModelForCausalLM.from_pretrained(
        checkpoint, export=True, compile_cache=False, batch_size=1, sequence_length=512, context_buckets=[256],
        token_buckets=[256, 512], speculation_length=speculation_length)
    passes = []
    forward = model.forward

    @functools.wraps(forward)  # generate reads forward's signature (logits_to_keep)
    def counted(*args, **kwargs):  # the target's passes after the prompt: each scores 1 + drafted tokens
        ids = kwargs.get("input_ids", args[0] if args else None)
        if any(isinstance(kwargs.get(name), CacheHandle) for name in ("cache", "past_key_values")):
            passes.append(ids.shape[1])  # continuing the model's own cache (the prompt comes with a fresh one)
        return forward(*args, **kwargs)

    model.forward = counted
    runs = {"greedy": {}, "prompt lookup": {"prompt_lookup_num_tokens": speculation_length}}
    seconds, outputs = {name: [] for name in runs}, {}
    for name, extra in runs.items():  # warm-up
        model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **extra)
    for _ in range(repeats):
        for name, extra in runs.items():
            passes.clear()
            start = time.perf_counter()
            outputs[name] = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **extra)
            seconds[name].append(time.perf_counter() - start)
    generated = outputs["greedy"].shape[1] - prompt
    drafted = sum(n - 1 for n in passes)
    accepted = generated - 1 - len(passes)  # each pass yields its accepted drafts + 1 token
    rates = {name: generated / statistics.median(times) for name, times in seconds.items()}
    return {"model": "smollm2", "dtype": "fp32", "speculation_length": speculation_length, "prompt_tokens": prompt,
            "new_tokens": generated, "greedy_tok_s": rates["greedy"], "prompt_lookup_tok_s": rates["prompt lookup"],
            "speedup": rates["prompt lookup"] / rates["greedy"],
            "identical_text": bool(torch.equal(outputs["greedy"], outputs["prompt lookup"])),
            "acceptance": accepted / drafted if drafted else 0.0, "passes": len(passes)}


def environment() -> dict:
    from optimum_neuronx.backends.inductor.tuning import cpu_fields

    fields = cpu_fields()
    flags = " ".join(f for f in fields.get("flags", "").split() if f.startswith(("avx", "amx", "fma")))
    model_name = fields.get("model name", platform.machine()) if fields else ""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": model_name, "cpu_flags": flags,
            "python": platform.python_version()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2, fp32, batch 1, 128-token prompt")
    parser.add_argument("--models", nargs="+", default=["smollm2", "tinyllama-1.1b-shape"],
                        choices=["smollm2", *SHAPES])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[128, 512],
                        help="time to first token for each; decode on the shortest")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work-dir", type=Path, default=None, help="checkpoints and exports (default: temporary)")
    parser.add_argument("--job-timeout", type=float, default=1800, help="seconds one (model, dtype, system) may take")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="K",
                        help="also time speculation by prompt lookup (K drafted tokens a pass) against plain greedy, "
                             "SmolLM2 fp32 batch 1 on a rewrite request")
    parser.add_argument("--only-prompt-lookup", action="store_true", help="skip the systems: --prompt-lookup only")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # internal: run one system in this process
    args = parser.parse_args()
    if args.job:
        print(json.dumps(run_system(json.loads(args.job))))
        return
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: decode is timed from the first new token to the last, so it "
                     "needs at least 2 (default 64)")
    if args.quick:
        args.models, args.dtypes, args.batch_sizes, args.prompt_tokens = ["smollm2"], ["fp32"], [1], [128]
    if args.only_prompt_lookup:
        if not args.prompt_lookup:
            parser.error("--only-prompt-lookup needs --prompt-lookup K")
        args.models = []
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    env = environment()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        probes: dict[str, BandwidthProbe] = {}  # one per dtype, for every model

        def probe_for(dtype: str) -> BandwidthProbe:
            if dtype not in probes:
                probes[dtype] = BandwidthProbe(TORCH_DTYPES[dtype])
            return probes[dtype]

        checkpoints = prepare_checkpoints(args.models, work, meanwhile=lambda: probe_for(args.dtypes[0]))
        for model_name in args.models:
            checkpoint = checkpoints[model_name]
            for dtype in args.dtypes:
                probe = probe_for(dtype)
                for system in args.systems:
                    job = dict(checkpoint=str(checkpoint), dtype=dtype, system=system, work=str(work),
                               batch_sizes=args.batch_sizes, prompt_tokens=args.prompt_tokens,
                               new_tokens=args.new_tokens, repeats=args.repeats, threads=env["threads"])
                    logging.info("running %s %s %s", model_name, dtype, system)
                    start = time.perf_counter()
                    batches = run_batches(job, args.job_timeout, probe.sample)
                    logging.info("  done in %.0f s", time.perf_counter() - start)
                    for batch_size, numbers in batches.items():
                        row = dict(model=model_name, dtype=dtype, batch_size=batch_size, system=system, **numbers)
                        if "bandwidth" in numbers:
                            step_bytes = bytes_per_decode_step(checkpoint, dtype, batch_size,
                                                               min(args.prompt_tokens) + args.new_tokens // 2,
                                                               EXPORT_OPTIONS.get(system, {}).get("quantization"))
                            row["tok_s_per_gb_s"] = 1e9 / step_bytes * batch_size
                            row["bound_tok_s"] = numbers["bandwidth"]["bound_gb_s"] * row["tok_s_per_gb_s"]
                        rows.append(row)
        lookup = measure_prompt_lookup(work, args.prompt_lookup, 128, args.repeats) if args.prompt_lookup else None
    label_repeats(rows)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps({"environment": env, "results": rows,
                                                              "prompt_lookup": lookup}, indent=2))
    table = markdown(rows)
    (args.output_dir / "results.md").write_text(table + "\n")
    plot(rows, args.output_dir / "results.png")
    print(json.dumps(env))
    print(table)
    if lookup:
        print(f"prompt lookup (k={lookup['speculation_length']}), SmolLM2 fp32 batch 1, rewrite request: "
              f"{lookup['prompt_lookup_tok_s']:.1f} tok/s vs greedy {lookup['greedy_tok_s']:.1f} "
              f"({lookup['speedup']:.2f}x), {lookup['new_tokens']} new tokens in {lookup['passes']} passes, "
              f"{100 * lookup['acceptance']:.0f}% of drafted tokens accepted, identical text: "
              f"{lookup['identical_text']}")
    for r in rows:  # one export per (model, dtype, batch size)
        if "compile_s_per_graph" in r:
            pages = (f", weights in huge pages {100 * r['weights_huge_page_share']:.0f}%"
                     if "weights_huge_page_share" in r else "")
            print(f"{r['model']} {r['dtype']} batch {r['batch_size']} {r['system']}: compile s/graph "
                  f"{r['compile_s_per_graph']}, reload {r['reload_s']:.2f} s{pages}")


if __name__ == "__main__":
    main()
