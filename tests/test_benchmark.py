"""The benchmark's own plumbing: a job in its subprocess, the bandwidth samples taken around its decode repeats."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _script_module(name: str):
    sys.path.insert(0, str(BENCHMARKS))  # as when the script runs: its sibling modules import
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.fixture(scope="module")
def bench():
    return _script_module("bench_generate")


@pytest.fixture(scope="module")
def report():
    return _script_module("bench_report")


def two_cpus() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


def eager_job(checkpoint, work, **overrides):
    return dict(checkpoint=str(checkpoint), dtype="fp32", system="transformers eager", work=str(work),
                batch_sizes=[1, 2], prompt_tokens=[8], new_tokens=4, repeats=2, threads=1, **overrides)


def test_batch_sizes_take_turns_and_bandwidth_is_sampled_around_every_timed_decode_repeat(
        bench, tiny_checkpoint, tmp_path):
    samples = []

    def probe():  # sample i reads 10 + i GB/s at its fastest
        samples.append({"gemv_gb_s": 1.0, "copy_gb_s": 10.0 + len(samples), "reduction_gb_s": 2.0})
        return samples[-1]

    result = bench.run_batches(eager_job(tiny_checkpoint("llama"), tmp_path), timeout=600, probe=probe)
    # Before the first repeat and after each of 2, per batch size; the repeats alternate between the batch sizes:
    # batch 1 [probe, repeat, probe], batch 2 [probe, repeat, probe], batch 1 [repeat, probe], batch 2 [...].
    assert len(samples) == 2 * 3
    for batch_size, taken in ((1, [0, 1, 4]), (2, [2, 3, 5])):
        numbers = result[batch_size]
        assert numbers["decode_tok_s"] > 0
        assert set(numbers["ttft_s"]) == {"8"}
        assert numbers["peak_rss_gib"] > 0
        # the cores' round trip right before and after each timed repeat, with its seconds
        assert len(numbers["decode_repeats"]) == 2
        for timed in numbers["decode_repeats"]:
            assert timed["seconds"] > 0 and timed["decode_tok_s"] > 0 and len(timed["core_round_trip_ns"]) == 2
            assert 0 < timed["decode_seconds"] < timed["seconds"]
            assert all(ns > 0 if two_cpus() else ns is None for ns in timed["core_round_trip_ns"])
        bandwidth = numbers["bandwidth"]
        assert bandwidth["samples"] == [samples[i] for i in taken]
        assert bandwidth["bound_gb_s"] == statistics.median(10.0 + i for i in taken)
        assert (bandwidth["bound_min_gb_s"], bandwidth["bound_max_gb_s"]) == (10.0 + taken[0], 10.0 + taken[-1])


def test_time_to_first_token_is_timed_at_the_smallest_batch_on_every_prompt(bench):
    assert bench.timed_prompts([512, 128], 1, [4, 1]) == [128, 512]
    assert bench.timed_prompts([512, 128], 4, [4, 1]) == [128]


def test_longer_prompts_time_to_first_token_comes_after_the_decode_repeats(bench):
    """Transformers reuses a static cache that fits the next generation: a long prompt timed before the decode
    repeats would change the cache (and the compiled graph) they run with."""
    calls = []

    class Recorder:  # streams like generate: the prompt, then each new token
        def generate(self, input_ids, attention_mask, max_new_tokens, streamer, **kwargs):
            calls.append((input_ids.shape[1], max_new_tokens))
            streamer.put(input_ids)
            # a prefill slower in the decode runs than in the time-to-first-token runs, as when the host's
            # phase changes between them
            time.sleep(0.001 if max_new_tokens == 1 else 0.05)
            for _ in range(max_new_tokens):
                streamer.put(torch.zeros(input_ids.shape[0], dtype=torch.long))
                time.sleep(0.002)
            streamer.end()
            return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, dtype=torch.long)

    inputs = {n: {"input_ids": torch.ones(1, n, dtype=torch.long), "attention_mask": torch.ones(1, n)}
              for n in (16, 8)}
    result = bench.measure(Recorder(), inputs, new_tokens=4, repeats=2)
    warm_up, short_ttft, decode, long_ttft = [(8, 4)], [(8, 1)] * 3, [(8, 4)] * 2, [(16, 1)] * 3
    assert calls == warm_up + short_ttft + decode + long_ttft
    assert set(result["ttft_s"]) == {8, 16} and result["decode_tok_s"] > 0
    # each repeat's own rate: the 3 tokens after the first over the time from its first token to its last, in that
    # same run (~6 ms of sleeps), not the run's time beyond a time to first token taken in other runs (~56 ms here);
    # the row's from the median of those times
    decode_seconds = [timed["decode_seconds"] for timed in result["decode_repeats"]]
    for timed in result["decode_repeats"]:
        assert timed["decode_tok_s"] == pytest.approx(3 / timed["decode_seconds"])
        assert 0.004 < timed["decode_seconds"] < 0.03 < timed["seconds"] - result["ttft_s"][8]
    assert result["decode_tok_s"] == pytest.approx(3 / statistics.median(decode_seconds))


def test_decode_needs_two_new_tokens(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_generate.py", "--new-tokens", "1"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--new-tokens 1" in capsys.readouterr().err


def test_static_cache_baseline_is_generate_compiling_its_decode_step_on_cpu(bench, reference_model):
    """The baseline is Transformers' own recipe: generate() compiles the decode step, here on a CPU too. Dynamo's
    eager backend stands in for Inductor (the plumbing is under test, not the compiler)."""
    model = reference_model("llama")
    config = bench.static_cache_compile_config()
    config.backend = "eager"
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        prompt = torch.tensor([[1, 5, 9, 4]])
        output = model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None,
                                cache_implementation="static", compile_config=config)
        assert hasattr(model, "_compiled_call")
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
        eager = model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)
        assert torch.equal(output, eager)
    finally:
        model.__dict__.pop("_compiled_call", None)
        model.__dict__.pop("_last_compile_config", None)
        torch._dynamo.reset()


def test_a_failing_or_hung_job_is_recorded_not_raised(bench, tmp_path):
    failed = bench.run_batches(eager_job(tmp_path / "missing", tmp_path), timeout=600, probe=lambda: {})
    assert set(failed) == {1, 2}
    assert all("missing" in numbers["error"] for numbers in failed.values())
    crashed = bench.run_jobs([{"not a job": True}], timeout=600)
    assert "exit 1" in crashed[0]["error"] and "KeyError" in crashed[0]["error"]
    hung = bench.run_batches(eager_job(tmp_path / "missing", tmp_path), timeout=0.1, probe=lambda: {})
    timed_out = {"error": "timed out after 0 s (--job-timeout)"}
    assert hung == {1: timed_out, 2: timed_out}


def test_bandwidth_probe_reports_each_kernel(bench):
    # decode's own dot kernel is probed where decode runs it: a faster loop than the probes would overstate %
    from optimum_neuronx.backends import get_backend

    probe = bench.BandwidthProbe(torch.bfloat16, megabytes=8)
    sample = probe.sample(repeats=1)
    expected = {"gemv_gb_s", "copy_gb_s", "reduction_gb_s"}
    if get_backend("inductor").has_dot_kernel(torch.bfloat16):
        expected.add("dot_kernel_gb_s")
        out = probe.dot_kernel(probe.x, probe.weight)
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(probe.x.float(), probe.weight.float()),
                                   rtol=2 ** -7, atol=1e-2)
    assert set(sample) == expected | {"core_round_trip_ns"}  # before and after the probes
    assert all(value > 0 for name, value in sample.items() if name in expected)
    assert len(sample["core_round_trip_ns"]) == 2
    assert all(ns > 0 if two_cpus() else ns is None for ns in sample["core_round_trip_ns"])


def test_the_bound_is_the_fastest_probe_not_the_cores_round_trip(bench):
    samples = [{"gemv_gb_s": 30.0, "copy_gb_s": 40.0, "core_round_trip_ns": [320.0, 330.0]},
               {"gemv_gb_s": 50.0, "copy_gb_s": 20.0, "core_round_trip_ns": [60.0, 62.0]},
               {"gemv_gb_s": 10.0, "copy_gb_s": 35.0, "core_round_trip_ns": [None, None]}]
    summary = bench.bandwidth_summary(samples)
    assert (summary["bound_gb_s"], summary["bound_min_gb_s"], summary["bound_max_gb_s"]) == (40.0, 35.0, 50.0)


@pytest.mark.skipif(not two_cpus(), reason="the round trip needs two CPUs")
def test_cores_round_trip_is_measured_between_two_cpus_and_not_on_one(bench):
    allowed = os.sched_getaffinity(0)
    two = bench.CoreRoundTrip()
    trips = [two.measure(trips=2000) for _ in range(3)]
    # a cache line's round trip between two CPUs: from tens of ns (same core complex) to some microseconds (a
    # descheduled virtual CPU); never nothing
    assert all(0 < ns < 1e6 for ns in trips)
    assert os.sched_getaffinity(0) == allowed  # the calling thread's CPUs restored
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert bench.CoreRoundTrip().measure() is None
    finally:
        os.sched_setaffinity(0, allowed)


def test_cores_round_trip_is_the_median_of_its_batches(bench):
    class Library:  # one batch of five slowed by the host: the round trip stays the placement's
        def __init__(self, means):
            self.means, self.calls = list(means), []

        def round_trip_ns(self, cpu_a, cpu_b, warmup, trips):
            self.calls.append((cpu_a, cpu_b, warmup, trips))
            return self.means.pop(0)

    round_trip = bench.CoreRoundTrip.__new__(bench.CoreRoundTrip)
    round_trip._cpus, round_trip._library = [0, 1], Library([60.0, 62.0, 2000.0, 58.0, 61.0])
    assert round_trip.measure(trips=1000) == 61.0
    assert round_trip._library.calls == [(0, 1, 20, 200)] * 5
    round_trip._library = Library([60.0, -1.0, 60.0, 60.0, 60.0])  # a thread that could not be pinned
    assert round_trip.measure() is None


def test_the_table_shows_the_round_trips_around_a_rows_decode_repeats(report):
    row = {"model": "m", "dtype": "fp32", "batch_size": 1, "system": report.SYSTEMS[0], "ttft_s": {"8": 0.1},
           "decode_tok_s": 10.0, "bound_tok_s": 20.0, "peak_rss_gib": 1.0,
           "bandwidth": {"bound_gb_s": 30.0, "bound_min_gb_s": 29.0, "bound_max_gb_s": 31.0},
           "decode_repeats": [{"seconds": 1.0, "core_round_trip_ns": [60.0, 320.0]},
                              {"seconds": 1.0, "core_round_trip_ns": [330.0, None]}]}
    header, _, line = report.markdown([row]).splitlines()
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert len(cells) == header.count("|") - 1
    assert cells[header.strip("|").split("|").index(" core round trip ns (spread) ")] == "320 (60-330)"
    del row["decode_repeats"]
    assert "| - |" in report.markdown([row])


def test_two_placements_of_the_cpus_split_at_the_first_wide_gap_in_their_round_trips(report):
    near, apart = [55.0, 60.0, 72.0, 110.0], [300.0, 320.0, 650.0, 2000.0]
    # the first gap of 2x or more from the shortest: a descheduled CPU's 2000 ns stays with the apart ones
    assert report.placement_split(apart + near + [None]) == pytest.approx((110 * 300) ** 0.5)
    assert report.placement_split(near + [None]) is None  # one placement
    assert report.placement_split([None, None]) is None  # one CPU: no round trips


def _ran(system, batch_size, repeats, samples=None, **extra):
    """A row: its decode repeats (rate, round trips at the repeat's ends) and the bandwidth samples taken before
    the first and after each (GB/s of the fastest probe, round trips before and after the probes)."""
    row = dict(model="m", dtype="fp32", batch_size=batch_size, system=system, tok_s_per_gb_s=2.0, decode_repeats=[
        {"seconds": 1.0, "decode_tok_s": rate, "core_round_trip_ns": list(ends)} for rate, ends in repeats], **extra)
    if samples is not None:
        row["bandwidth"] = {"samples": [{"gemv_gb_s": gb_s / 2, "copy_gb_s": gb_s, "core_round_trip_ns": list(ends)}
                                        for gb_s, ends in samples]}
    return row


def test_each_repeat_is_set_against_the_samples_either_side_and_labelled_by_where_the_cpus_ran(report):
    row = _ran(report.SYSTEMS[2], 1, repeats=[(50.0, (60, 70)), (80.0, (70, 320)), (99.0, (330, 320))],
               samples=[(30.0, (62, 61)), (40.0, (64, 66)), (60.0, (310, 305)), (50.0, (300, 320))])
    # the CPUs moved apart while the probes after the repeat ran: its bound is not all from its placement
    moved = _ran(report.SYSTEMS[1], 1, repeats=[(50.0, (60, 70))], samples=[(30.0, (62, 61)), (40.0, (64, 330))])
    unsampled = _ran(report.SYSTEMS[0], 1, repeats=[(10.0, (60, 330))])
    split = report.label_repeats([row, moved, unsampled])
    assert 70 < split < 300
    # bound of a repeat: the fastest probes of the samples before and after it, (30 + 40) / 2 GB/s * 2 tok/s per GB/s
    assert [timed["percent_of_bound"] for timed in row["decode_repeats"]] == pytest.approx(
        [100 * 50 / 70, 100 * 80 / 100, 100 * 99 / 110])
    assert [timed["cpus"] for timed in row["decode_repeats"]] == ["near", "mixed", "apart"]
    assert report.percent_of_bound(row) == pytest.approx(80.0)  # their median
    assert moved["decode_repeats"][0]["cpus"] == "mixed"
    assert "cpus" not in unsampled["decode_repeats"][0]  # no samples around it: nothing to set it against

    one_cpu = _ran(report.SYSTEMS[2], 1, repeats=[(50.0, (None, None))],
                   samples=[(30.0, (None, None)), (40.0, (None, None))])
    steady = _ran(report.SYSTEMS[2], 1, repeats=[(50.0, (60, 70))], samples=[(30.0, (62, 61)), (40.0, (64, 66))])
    assert report.label_repeats([one_cpu]) is None and report.label_repeats([steady]) is None
    assert one_cpu["decode_repeats"][0]["cpus"] == steady["decode_repeats"][0]["cpus"] == "one placement"


def test_the_placement_table_compares_repeats_that_ran_in_the_same_placement(report):
    def labelled(system, batch_size, repeats):
        row = _ran(system, batch_size, [(rate, (0, 0)) for rate, _ in repeats])
        for timed, (_, cpus) in zip(row["decode_repeats"], repeats):
            timed.update(cpus=cpus, percent_of_bound=timed["decode_tok_s"])
        return row

    eager, ours = report.SYSTEMS[0], report.SYSTEMS[2]
    rows = [labelled(eager, 1, [(10.0, "near"), (20.0, "apart"), (12.0, "near")]),
            labelled(ours, 1, [(100.0, "apart"), (70.0, "mixed"), (40.0, "near")]),
            labelled(ours, 4, [(300.0, "apart")]),
            dict(model="m", dtype="fp32", batch_size=2, system=ours, error="failed")]
    lines = report.placement_markdown(rows, 145.0).splitlines()
    assert "below 145 ns" in lines[0]
    header, body = lines[2], lines[4:]
    assert header.strip("|").split("|")[4:] == [" CPUs ", " repeats ", " decode tok/s ", " % of bound ", " vs eager ",
                                                " vs smallest batch "]
    cells = [[cell.strip() for cell in line.strip("|").split("|")][2:] for line in body]
    assert cells == [
        ["1", eager, "near", "2", "11.0", "11%", "1.00x", "1.00x"],
        ["1", eager, "apart", "1", "20.0", "20%", "1.00x", "1.00x"],
        ["1", ours, "near", "1", "40.0", "40%", "3.64x", "1.00x"],  # against eager's near repeats only
        ["1", ours, "apart", "1", "100.0", "100%", "5.00x", "1.00x"],
        ["1", ours, "mixed", "1", "70.0", "70%", "-", "-"],  # a placement that changed is compared with nothing
        ["4", ours, "apart", "1", "300.0", "300%", "-", "3.00x"]]  # no eager batch 4; batch 1 apart
    assert "one placement" in report.placement_markdown(rows, None).splitlines()[0]


def _checkpoint_made_elsewhere(name, work):
    """A stand-in for model_checkpoint, run in the benchmark's spawned process: it finishes only once the parent's
    `meanwhile` has seen it start, so the two cannot have run one after the other."""
    import os
    import time

    (Path(work) / f"{name}.started").touch()
    deadline = time.monotonic() + 60
    while not (Path(work) / "meanwhile-done").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("meanwhile never ran while the checkpoint was being made")
        time.sleep(0.01)
    if name == "broken":
        raise ValueError("no such model: broken")
    return Path(work) / name, os.getpid()


def test_checkpoints_are_made_in_another_process_while_the_probe_compiles(bench, tmp_path):
    import os
    import time

    def meanwhile():
        deadline = time.monotonic() + 60
        while not (tmp_path / "a.started").exists():
            assert time.monotonic() < deadline, "the checkpoint was not being made meanwhile"
            time.sleep(0.01)
        (tmp_path / "meanwhile-done").touch()

    made = bench.prepare_checkpoints(["a", "b"], tmp_path, meanwhile, make=_checkpoint_made_elsewhere)
    assert {name: path for name, (path, _) in made.items()} == {"a": tmp_path / "a", "b": tmp_path / "b"}
    assert all(pid != os.getpid() for _, pid in made.values())
    with pytest.raises(ValueError, match="no such model: broken"):
        bench.prepare_checkpoints(["broken"], tmp_path, lambda: None, make=_checkpoint_made_elsewhere)


def test_weights_huge_page_share_spans_every_loaded_weight(bench, saved_tiny_llama, monkeypatch):
    from optimum_neuronx import NeuronModelForCausalLM
    from optimum_neuronx import huge_pages

    spans = []
    monkeypatch.setattr(huge_pages, "huge_page_share_between", lambda begin, end: spans.append((begin, end)) or 0.25)
    model = NeuronModelForCausalLM.from_pretrained(saved_tiny_llama, huge_pages=False)
    assert bench.weights_huge_page_share(model) == 0.25
    weights = [w for w in model._weights.values() if w.numel()]
    assert spans == [(min(w.data_ptr() for w in weights), max(w.data_ptr() + w.nbytes for w in weights))]


@pytest.fixture(scope="module")
def breakdown():
    return _script_module("step_breakdown")


def test_a_calls_time_splits_into_its_regions_and_the_gaps_between_them(breakdown):
    Region = breakdown.Region
    # call 100..200 ns: region a 110..140 (main 112..138, the other thread 115..135), region b 150..190 (main
    # 151..189, no other thread); a region of another call at 300.
    regions = [Region("a", 110, 140, 112, 138, 115, 135, 135), Region("b", 150, 190, 151, 189, 0, 0, 0),
               Region("a", 300, 310, 301, 309, 302, 308, 308)]
    call = breakdown.call_breakdown(100, 200, regions)
    ns = 1e-6
    assert call["regions"] == 2
    assert call["ms"] == pytest.approx(100 * ns)
    assert call["in_regions_ms"] == pytest.approx(70 * ns)
    assert call["between_regions_ms"] == pytest.approx(30 * ns)
    assert call["gaps_ms"] == pytest.approx({"start -> a": 10 * ns, "a -> b": 10 * ns, "b -> end": 10 * ns})
    assert sum(call["gaps_ms"].values()) == pytest.approx(call["between_regions_ms"])
    assert call["kernels_ms"] == pytest.approx({"a": 30 * ns, "b": 40 * ns})
    # only regions another thread took part in: the last start after the call, the ends' spread, the wait after
    assert call["fork_ms"] == pytest.approx(5 * ns)
    assert call["imbalance_ms"] == pytest.approx(3 * ns)
    assert call["join_ms"] == pytest.approx(2 * ns)


def test_kernels_are_named_from_the_graphs_symbols(breakdown):
    name = breakdown.short_kernel_name
    assert name("bool optimum_neuronx_kernels::dot_rows_parallel<optimum_neuronx_kernels::Float32Lines, 4>(float "
                "const*) [clone ._omp_fn.0]") == "rows_matvec fp32 x4"
    assert name("bool optimum_neuronx_kernels::dot_rows_parallel<optimum_neuronx_kernels::BFloat16Lines, 1>(unsigned "
                "short const*)") == "rows_matvec bf16 x1"
    assert name("void optimum_neuronx_kernels::tiled_dot_parallel<optimum_neuronx_kernels::Float32Tiles, 3, 32>(float "
                "const*) [clone ._omp_fn.0]") == "rows_matvec fp32 tiles x3"
    assert name("void optimum_neuronx_kernels::tiled_dot_parallel<optimum_neuronx_kernels::BFloat16Tiles, 1, 32>("
                "unsigned short const*) [clone ._omp_fn.0]") == "rows_matvec bf16 tiles x1"
    assert name("cpp_fused__to_copy_add_div_mul_sum_5._omp_fn.0") == "inductor 5"
    assert name("bool optimum_neuronx_kernels::decode_attention<unsigned short>(float const*)") == "decode_attention"


def test_step_breakdown_times_the_regions_of_a_saved_models_token_steps(breakdown, saved_tiny_llama, tmp_path):
    out = tmp_path / "breakdown.json"
    script = BENCHMARKS / "step_breakdown.py"
    done = subprocess.run(
        [sys.executable, str(script), str(saved_tiny_llama), "--seconds", "0", "--calls", "3", "--generations", "1",
         "--new-tokens", "3", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["graph"].startswith("token_")
    (steps,) = result["steps"].values()  # one group of calls: one placement
    assert steps["calls"] == 3 and steps["ms"] > 0 and steps["between_regions_ms"] >= 0
    lowering = json.loads((saved_tiny_llama / "neuron_config.json").read_text())
    if lowering["versions"]["compiler"]["lowering"]["dot_rows"]:  # its projections run in the dot kernel's regions
        assert steps["regions"] >= 1
        assert any(kernel.startswith("rows_matvec fp32") for kernel in steps["kernels_ms"])
    (generate,) = result["generate"].values()
    assert generate["generations"] == 1 and generate["step_ms"] > generate["graph_ms"] > 0
    assert "| call | in regions |" in done.stdout
