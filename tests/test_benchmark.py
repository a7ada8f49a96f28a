"""The benchmark's own plumbing: a job in its subprocess, the bandwidth samples taken around its decode repeats."""

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def script_module(name: str, directory: Path = BENCHMARKS):
    sys.path.insert(0, str(directory))  # as when the script runs: its sibling modules import
    try:
        spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(directory))
    return module


@pytest.fixture(scope="module")
def bench():
    return script_module("bench_generate")


@pytest.fixture(scope="module")
def report():
    return script_module("bench_report")


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
        # each timed repeat with its seconds
        assert len(numbers["decode_repeats"]) == 2
        for timed in numbers["decode_repeats"]:
            assert timed["seconds"] > 0 and timed["decode_tok_s"] > 0
            assert 0 < timed["decode_seconds"] < timed["seconds"]
        bandwidth = numbers["bandwidth"]
        assert bandwidth["samples"] == [samples[i] for i in taken]
        assert bandwidth["bound_gb_s"] == statistics.median(10.0 + i for i in taken)
        assert (bandwidth["bound_min_gb_s"], bandwidth["bound_max_gb_s"]) == (10.0 + taken[0], 10.0 + taken[-1])


def test_time_to_first_token_is_timed_at_the_smallest_batch_on_every_prompt(bench):
    assert bench.timed_prompts([512, 128], 1, [4, 1]) == [128, 512]
    assert bench.timed_prompts([512, 128], 4, [4, 1]) == [128]


def test_longer_prompts_time_to_first_token_comes_after_the_decode_repeats(bench, monkeypatch):
    """Transformers reuses a static cache that fits the next generation: a long prompt timed before the decode
    repeats would change the cache (and the compiled graph) they run with. Timed on a clock the stand-in advances
    (no real sleeps: exact under any load)."""
    calls = []
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    class Recorder:  # streams like generate: the prompt, then each new token
        def generate(self, input_ids, attention_mask, max_new_tokens, streamer, **kwargs):
            calls.append((input_ids.shape[1], max_new_tokens))
            streamer.put(input_ids)
            # a prefill slower in the decode runs than in the time-to-first-token runs, as when the host's
            # phase changes between them
            clock[0] += 0.001 if max_new_tokens == 1 else 0.05
            for _ in range(max_new_tokens):
                streamer.put(torch.zeros(input_ids.shape[0], dtype=torch.long))
                clock[0] += 0.002
            streamer.end()
            return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, dtype=torch.long)

    inputs = {n: {"input_ids": torch.ones(1, n, dtype=torch.long), "attention_mask": torch.ones(1, n)}
              for n in (16, 8)}
    result = bench.measure(Recorder(), inputs, new_tokens=4, repeats=2)
    warm_up, short_ttft, decode, long_ttft = [(8, 4)], [(8, 1)] * 3, [(8, 4)] * 2, [(16, 1)] * 3
    assert calls == warm_up + short_ttft + decode + long_ttft
    assert set(result["ttft_s"]) == {8, 16} and result["decode_tok_s"] > 0
    # each repeat's own rate: the 3 tokens after the first over the time from its first token to its last, in that
    # same run (3 steps of 2 ms), not the run's time beyond a time to first token taken in other runs (~56 ms here);
    # the row's from the median of those times
    decode_seconds = [timed["decode_seconds"] for timed in result["decode_repeats"]]
    for timed in result["decode_repeats"]:
        assert timed["decode_tok_s"] == pytest.approx(3 / timed["decode_seconds"])
        assert timed["decode_seconds"] == pytest.approx(0.006)
        assert timed["seconds"] - result["ttft_s"][8] == pytest.approx(0.05 + 0.008 - 0.003)
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


@pytest.mark.slow  # subprocesses that fail and time out
def test_a_failing_or_hung_job_is_recorded_not_raised(bench, tmp_path):
    failed = bench.run_batches(eager_job(tmp_path / "missing", tmp_path), timeout=600, probe=lambda: {})
    assert set(failed) == {1, 2}
    assert all("missing" in numbers["error"] for numbers in failed.values()), failed
    crashed = bench.run_jobs([{"not a job": True}], timeout=600)
    assert "exit 1" in crashed[0]["error"] and "KeyError" in crashed[0]["error"]
    hung = bench.run_batches(eager_job(tmp_path / "missing", tmp_path), timeout=0.1, probe=lambda: {})
    timed_out = {"error": "timed out after 0 s (--job-timeout)"}
    assert hung == {1: timed_out, 2: timed_out}


@pytest.mark.slow  # compiles the bandwidth probes
def test_bandwidth_probe_reports_each_kernel(bench):
    # decode's own dot kernel is probed where decode runs it: a faster loop than the probes would overstate %
    from optimum_neuronx.backends import get_backend

    probe = bench.BandwidthProbe(torch.bfloat16, megabytes=8)
    sample = probe.sample(repeats=1)
    expected = {"gemv_gb_s", "copy_gb_s", "reduction_gb_s"}
    if get_backend("inductor").dot_kernel_isa(torch.bfloat16):
        expected.add("dot_kernel_gb_s")
        out = probe.dot_kernel(probe.x, probe.weight)
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(probe.x.float(), probe.weight.float()),
                                   rtol=2 ** -7, atol=1e-2)
    assert set(sample) == expected
    assert all(value > 0 for value in sample.values())


def test_the_bound_is_the_fastest_probe(bench):
    samples = [{"gemv_gb_s": 30.0, "copy_gb_s": 40.0}, {"gemv_gb_s": 50.0, "copy_gb_s": 20.0},
               {"gemv_gb_s": 10.0, "copy_gb_s": 35.0}]
    summary = bench.bandwidth_summary(samples)
    assert (summary["bound_gb_s"], summary["bound_min_gb_s"], summary["bound_max_gb_s"]) == (40.0, 35.0, 50.0)


def _ran(system, batch_size, rates, samples=None, **extra):
    """A row: its decode repeats' rates and the bandwidth samples taken before the first and after each (GB/s of
    the fastest probe)."""
    row = dict(model="m", dtype="fp32", batch_size=batch_size, system=system, tok_s_per_gb_s=2.0, decode_repeats=[
        {"seconds": 1.0, "decode_tok_s": rate} for rate in rates], **extra)
    if samples is not None:
        row["bandwidth"] = {"samples": [{"gemv_gb_s": gb_s / 2, "copy_gb_s": gb_s} for gb_s in samples]}
    return row


def test_each_repeat_is_set_against_the_samples_either_side(report):
    row = _ran(report.SYSTEMS[2], 1, [50.0, 80.0, 99.0], samples=[30.0, 40.0, 60.0, 50.0])
    unsampled = _ran(report.SYSTEMS[0], 1, [10.0])
    report.label_repeats([row, unsampled])
    # bound of a repeat: the fastest probes of the samples before and after it, (30 + 40) / 2 GB/s * 2 tok/s per GB/s
    assert [timed["percent_of_bound"] for timed in row["decode_repeats"]] == pytest.approx(
        [100 * 50 / 70, 100 * 80 / 100, 100 * 99 / 110])
    assert report.percent_of_bound(row) == pytest.approx(80.0)  # their median
    assert "percent_of_bound" not in unsampled["decode_repeats"][0]  # no samples around it: nothing to set it against


def test_the_table_has_one_cell_per_column_and_ratios_to_eager(report):
    def row(system, rate):
        return {"model": "m", "dtype": "fp32", "batch_size": 1, "system": system, "ttft_s": {"8": 0.1},
                "decode_tok_s": rate, "bound_tok_s": 40.0, "peak_rss_gib": 1.0,
                "bandwidth": {"bound_gb_s": 30.0, "bound_min_gb_s": 29.0, "bound_max_gb_s": 31.0}}

    header, _, eager, ours = report.markdown([row(report.SYSTEMS[0], 10.0), row(report.SYSTEMS[2], 30.0)]).splitlines()
    names = [cell.strip() for cell in header.strip("|").split("|")]
    cells = dict(zip(names, (cell.strip() for cell in ours.strip("|").split("|"))))
    assert len(cells) == len(names) == len(ours.strip("|").split("|"))
    assert cells["decode vs eager"] == "3.00x" and cells["% of bound"] == "75%"
    assert "round trip" not in header


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


def test_family_shapes_are_exportable_and_a_moe_step_reads_its_chosen_experts(bench, tmp_path):
    # every preset is a config our export accepts; a decode step of the MoE preset streams top-4 of 32 experts a row
    from transformers import AutoConfig

    from optimum_neuronx import NeuronConfig
    from optimum_neuronx.exporters import get_export_config

    for name, (model_type, shape) in bench.SHAPES.items():
        AutoConfig.for_model(model_type, **shape).save_pretrained(tmp_path / name)
        get_export_config(model_type).decoder_spec(AutoConfig.from_pretrained(tmp_path / name), NeuronConfig())
    moe = tmp_path / "qwen3-moe-400m-shape"
    expert = 3 * 384 * 768 * 4 * 12  # one expert's fp32 bytes over the 12 layers
    one, eight = (bench.bytes_per_decode_step(moe, "fp32", batch, 128) for batch in (1, 8))
    assert eight - one == 28 * expert + 7 * 2 * 12 * 128 * 4 * 64 * 4  # 28 more experts read, and 7 rows' KV


def test_int8_system_is_bounded_by_its_int8_bytes(bench, tmp_path):
    """The int8 system's bound counts its projections at one byte (plus float32 scales); the rest stays bf16."""
    from transformers import AutoConfig

    model_type, shape = bench.SHAPES["tinyllama-1.1b-shape"]
    AutoConfig.for_model(model_type, **shape).save_pretrained(tmp_path / "tiny")
    bf16, int8 = (bench.bytes_per_decode_step(tmp_path / "tiny", "bf16", 1, 128, q) for q in (None, "int8"))
    projections = 22 * (2048 * (2048 + 2 * 256) + 2048 * 2048 + 3 * 2048 * 5632)
    scales = 22 * ((2048 + 2 * 256) + 2048 + 2 * 5632 + 2048) * 4
    assert bf16 - int8 == projections - scales
    assert bench.EXPORT_OPTIONS["optimum-neuronx (inductor, int8)"] == {"quantization": "int8"}
    assert set(bench.EXPORT_OPTIONS) <= set(bench.OUR_BACKENDS) and set(bench.OUR_BACKENDS) <= set(bench.SYSTEMS)
