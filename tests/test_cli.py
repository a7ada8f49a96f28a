"""optimum-cli export neuron / neuron verify, end to end through subprocesses."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from optimum_neuronx import NeuronModelForCausalLM

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")
DOCS = Path(__file__).parent.parent / "docs" / "cli.md"


def run(*args, timeout=600):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def export_args(model, output, *extra):
    return [OPTIMUM_CLI, "export", "neuron", "--model", str(model), "--batch_size", "3", "--sequence_length", "64",
            "--context_buckets", "16", "--token_buckets", "32,64", "--continuous_batching", *extra, str(output)]


@pytest.fixture(scope="module")
def cli_export(tiny_checkpoint, compiled_model, tmp_path_factory):
    # The parity tests' shapes, compiled in this session first: the CLI's export is a hit in the session's compile
    # cache.
    compiled_model("qwen3")
    output = tmp_path_factory.mktemp("cli") / "tiny-qwen3"
    return output, run(*export_args(tiny_checkpoint("qwen3"), output))


def test_export_prints_plan_and_times_then_verify_passes(cli_export):
    output, result = cli_export
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    assert "Memory estimate: weights" in log
    assert "Buckets: context [16], token generation [32, 64] (5 graphs" in log  # prefill, 2 token, 2 fused
    assert "Compile cache hit" in log
    assert re.search(r"compiled token_32 in \d+\.\d s", result.stdout)  # the times it took when compiled
    assert f"to {output}" in result.stdout
    model = NeuronModelForCausalLM.from_pretrained(output)
    assert model.neuron_config.batch_size == 3 and model.neuron_config.token_buckets == (32, 64)

    verify = run(OPTIMUM_CLI, "neuron", "verify", str(output))
    assert verify.returncode == 0, verify.stdout + verify.stderr[-2000:]
    assert "prompts: 3 of lengths [16, 8, 4], 48 new tokens" in verify.stdout
    assert "greedy tokens match over 48 new tokens" in verify.stdout


def test_python_module_entry_point_and_help_matches_docs():
    result = run(sys.executable, "-m", "optimum_neuronx.commands", "--help")
    assert result.returncode == 0
    documented = DOCS.read_text()
    for option in re.findall(r"(--\w+)", result.stdout):
        assert option in documented, f"{option} is missing from docs/cli.md"
    assert result.stdout.strip() in documented


@pytest.mark.parametrize("extra, message", [
    (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    (["--context_buckets", "a,b"], "expected comma-separated integers"),
], ids=["unknown_flag", "bad_buckets"])
def test_argparse_errors(tiny_checkpoint, tmp_path, extra, message):
    result = run(*export_args(tiny_checkpoint("qwen3"), tmp_path / "out", *extra))
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "out").exists()


def test_missing_model_flag(tmp_path):
    result = run(OPTIMUM_CLI, "export", "neuron", str(tmp_path / "out"))
    assert result.returncode == 2 and "the following arguments are required: --model" in result.stderr


@pytest.mark.parametrize("extra, message", [
    (["--auto_cast_type", "int3"], "error: Unknown auto_cast_type 'int3'"),
    (["--num_cores", "3"], "error: tp_degree (num_cores) 3 is not supported"),
], ids=["dtype", "num_cores"])
def test_bad_values_exit_with_one_line_error(tiny_checkpoint, tmp_path, extra, message):
    result = run(*export_args(tiny_checkpoint("qwen3"), tmp_path / "out", *extra))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert not (tmp_path / "out").exists()


def test_non_empty_output_needs_overwrite(cli_export, tiny_checkpoint):
    output, _ = cli_export
    before = {p.name: p.stat().st_mtime_ns for p in output.iterdir()}
    result = run(*export_args(tiny_checkpoint("qwen3"), output))
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: output directory {output} exists and is not empty; pass --overwrite "
                                     f"to replace its content, or choose another directory")
    assert {p.name: p.stat().st_mtime_ns for p in output.iterdir()} == before


def test_verify_of_a_missing_directory(tmp_path):
    result = run(OPTIMUM_CLI, "neuron", "verify", str(tmp_path / "nothing"))
    assert result.returncode == 1 and "is not a directory" in result.stderr


@pytest.mark.slow
def test_export_smollm2_through_the_cli(smollm2_checkpoint, tmp_path):
    output = tmp_path / "smollm2"
    # The shapes of the smollm2_compiled fixture (conftest.py): whichever runs second is a hit in the session's
    # compile cache, so SmolLM2 compiles once per test session.
    result = run(OPTIMUM_CLI, "export", "neuron", "--model", str(smollm2_checkpoint), "--batch_size", "2",
                 "--sequence_length", "128", "--context_buckets", "64", "--token_buckets", "128", str(output),
                 timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    verify = run(OPTIMUM_CLI, "neuron", "verify", str(output), "--max_new_tokens", "48")
    assert verify.returncode == 0, verify.stdout + verify.stderr[-2000:]
    assert "greedy tokens match over 48 new tokens" in verify.stdout


def test_speed_options_reach_the_neuron_config():
    import argparse

    from optimum_neuronx.commands.export import add_export_arguments, neuron_config_from_args

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args(["--model", "m", "out", "--batch_size", "1", "--sequence_length", "256",
                              "--speculation_length", "3", "--quantization", "int8", "--on_device_sampling"])
    config = neuron_config_from_args(args)
    assert (config.speculation_length, config.quantization, config.on_device_sampling) == (3, "int8", True)
    plain = neuron_config_from_args(parser.parse_args(["--model", "m", "out"]))
    assert (plain.speculation_length, plain.quantization, plain.on_device_sampling) == (0, None, False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "out", "--quantization", "int4"])


def _export_parser():
    import argparse

    from optimum_neuronx.commands.export import add_export_arguments

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    return parser


def test_optimum_neuron_flags_are_accepted_and_abbreviations_refused(caplog):
    """--auto_cast (ignored, said), -O1/-O2/-O3 on the inductor backend (ignored, said); an abbreviation of a flag
    is an error, never another flag (--auto_cast_typ once became --auto_cast_type)."""
    import logging

    from optimum_neuronx.commands.export import neuron_config_from_args

    parser = _export_parser()
    with caplog.at_level(logging.INFO, logger="optimum_neuronx"):
        args = parser.parse_args(["--model", "m", "out", "--auto_cast", "matmul", "--auto_cast_type", "bf16", "-O3"])
        config = neuron_config_from_args(args)
    assert config.auto_cast_type == "bf16" and config.compiler_args == ()
    assert "--auto_cast matmul ignored" in caplog.text and "-O3 ignored" in caplog.text
    neuron = neuron_config_from_args(parser.parse_args(["--model", "m", "out", "--backend", "neuron", "-O3"]))
    assert neuron.compiler_args == ("-O3",)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "out", "--auto_cast_typ", "bf16"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "out", "--sequence", "128"])


def test_estimate_takes_tensor_parallel_size(capsys, tiny_checkpoint):
    import argparse

    from optimum_neuronx.commands.estimate import add_estimate_arguments, run_estimate

    parser = argparse.ArgumentParser()
    add_estimate_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoint("llama")), "--sequence_length", "64",
                              "--tensor_parallel_size", "2"])
    assert args.num_cores == 2 and run_estimate(args) == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--tensor_parallel", "2"])  # no abbreviations here either


def test_module_entry_point_exits_non_zero_on_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "optimum_neuronx.commands", "--model", str(tmp_path / "none"),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "error:" in result.stderr
