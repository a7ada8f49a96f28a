"""The investigation tools in tools/ (not part of the product benchmark): step_breakdown.py, core_round_trip.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_benchmark import script_module

TOOLS = Path(__file__).parents[1] / "tools"


def two_cpus() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


@pytest.fixture(scope="module")
def round_trip_tool():
    return script_module("core_round_trip", TOOLS)


@pytest.mark.skipif(not two_cpus(), reason="the round trip needs two CPUs")
def test_cores_round_trip_is_measured_between_two_cpus_and_not_on_one(round_trip_tool):
    allowed = os.sched_getaffinity(0)
    two = round_trip_tool.CoreRoundTrip()
    trips = [two.measure(trips=2000) for _ in range(3)]
    # a cache line's round trip between two CPUs: from tens of ns (same core complex) to some microseconds (a
    # descheduled virtual CPU); never nothing
    assert all(0 < ns < 1e6 for ns in trips)
    assert os.sched_getaffinity(0) == allowed  # the calling thread's CPUs restored
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert round_trip_tool.CoreRoundTrip().measure() is None
    finally:
        os.sched_setaffinity(0, allowed)


def test_cores_round_trip_is_the_median_of_its_batches(round_trip_tool):
    class Library:  # one batch of five slowed by the host: the round trip stays the placement's
        def __init__(self, means):
            self.means, self.calls = list(means), []

        def round_trip_ns(self, cpu_a, cpu_b, warmup, trips):
            self.calls.append((cpu_a, cpu_b, warmup, trips))
            return self.means.pop(0)

    round_trip = round_trip_tool.CoreRoundTrip.__new__(round_trip_tool.CoreRoundTrip)
    round_trip._cpus, round_trip._library = [0, 1], Library([60.0, 62.0, 2000.0, 58.0, 61.0])
    assert round_trip.measure(trips=1000) == 61.0
    assert round_trip._library.calls == [(0, 1, 20, 200)] * 5
    round_trip._library = Library([60.0, -1.0, 60.0, 60.0, 60.0])  # a thread that could not be pinned
    assert round_trip.measure() is None


def test_two_placements_of_the_cpus_split_at_the_first_wide_gap_in_their_round_trips(round_trip_tool):
    near, apart = [55.0, 60.0, 72.0, 110.0], [300.0, 320.0, 650.0, 2000.0]
    # the first gap of 2x or more from the shortest: a descheduled CPU's 2000 ns stays with the apart ones
    assert round_trip_tool.placement_split(apart + near + [None]) == pytest.approx((110 * 300) ** 0.5)
    assert round_trip_tool.placement_split(near + [None]) is None  # one placement
    assert round_trip_tool.placement_split([None, None]) is None  # one CPU: no round trips


    assert round_trip_tool.placement([60.0, 70.0], 145.0) == "near"
    assert round_trip_tool.placement([60.0, 320.0], 145.0) == "mixed"
    assert round_trip_tool.placement([300.0, 320.0], 145.0) == "apart"
    assert round_trip_tool.placement([300.0, None], 145.0) == round_trip_tool.placement([60.0], None) == "one placement"


@pytest.fixture(scope="module")
def breakdown():
    return script_module("step_breakdown", TOOLS)


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
    script = TOOLS / "step_breakdown.py"
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


@pytest.fixture(scope="module")
def harness():
    return script_module("kernel_harness", TOOLS)


@pytest.mark.parametrize("dtype, rows, k, tolerance", [("f32", 3, 300, 1e-5), ("bf16", 1, 130, 1e-2)])
def test_kernel_harness_times_the_dot_kernel_against_a_plain_read(harness, dtype, rows, k, tolerance):
    # the harness compiles kernels/harness.cpp with a graph's defines and checks the kernel against float64 sums
    from optimum_neuronx.backends import get_backend

    if not get_backend("inductor").dot_kernel_isa(harness.DTYPES[dtype]):
        pytest.skip(f"this CPU has no variant of the dot kernel for {dtype}")
    result = harness.run(dtype, rows, k, 96, repeats=1)
    assert result["ok"] and (result["rows"], result["k"], result["n"]) == (rows, k, 96)
    assert result["kernel_gb_s"] > 0 and result["read_gb_s"] > 0
    assert result["max_relative_error"] < tolerance
    assert result["isa"] == get_backend("inductor").dot_kernel_isa(harness.DTYPES[dtype])


def test_kernel_harness_refuses_an_unknown_tuning_constant(harness):
    from optimum_neuronx.backends.inductor.custom_kernels import kernel_defines

    with pytest.raises(ValueError, match=r"unknown tuning constants \['row_speed'\]; the kernels take \["):
        kernel_defines("avx2", tuning_overrides={"row_speed": 1})
    defines = kernel_defines("avx2", tuning_overrides={"rows_prefetch_locality": 3})
    assert defines["OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY"] == 3
