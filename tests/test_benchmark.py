"""The benchmark's own plumbing: a job in its subprocess, the bandwidth samples taken around its decode repeats."""

import importlib.util
import statistics
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "benchmarks" / "bench_generate.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eager_job(checkpoint, work, **overrides):
    return dict(checkpoint=str(checkpoint), dtype="fp32", system="transformers eager", work=str(work),
                batch_sizes=[1, 2], prompt_tokens=[8], new_tokens=4, repeats=2, threads=1, **overrides)


def test_bandwidth_is_sampled_around_every_timed_decode_repeat(bench, tiny_checkpoint, tmp_path):
    samples = []

    def probe():  # sample i reads 10 + i GB/s at its fastest
        samples.append({"gemv_gb_s": 1.0, "copy_gb_s": 10.0 + len(samples), "reduction_gb_s": 2.0})
        return samples[-1]

    result = bench.run_job(eager_job(tiny_checkpoint("llama"), tmp_path), timeout=600, probe=probe)
    assert len(samples) == 2 * 3  # per batch size: before the first repeat and after each of 2
    for batch_size, first in (("1", 0), ("2", 3)):
        numbers = result["batches"][batch_size]
        assert numbers["decode_tok_s"] > 0 and set(numbers["ttft_s"]) == {"8"}
        bandwidth = numbers["bandwidth"]
        assert bandwidth["samples"] == samples[first:first + 3]
        assert bandwidth["bound_gb_s"] == statistics.median(10.0 + i for i in range(first, first + 3))
        assert (bandwidth["bound_min_gb_s"], bandwidth["bound_max_gb_s"]) == (10.0 + first, 12.0 + first)


def test_a_failing_or_hung_job_is_recorded_not_raised(bench, tmp_path):
    failed = bench.run_job(eager_job(tmp_path / "missing", tmp_path), timeout=600, probe=lambda: {})
    assert "exit 1" in failed["error"] and "missing" in failed["error"]
    hung = bench.run_job(eager_job(tmp_path / "missing", tmp_path), timeout=0.1, probe=lambda: {})
    assert hung == {"error": "timed out after 0 s (--job-timeout)"}


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
    assert set(sample) == expected
    assert all(value > 0 for value in sample.values())
