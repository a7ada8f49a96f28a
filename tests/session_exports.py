"""The session's exports, compiled ahead of the tests that ask for them by a background process at the lowest CPU
priority (conftest's `session_exports_ahead`).

On 2 cores the tests leave a core idle much of the time: single-threaded tracing and lowering, subprocesses starting
up, eager references, the PJRT client's one-graph-at-a-time compiles at the end. The process below spends that idle
time exporting, in the order the tests need them, what the slow tests export with shapes of their own, into the
session's compile cache. A test's own `from_pretrained(export=True)` is then a cache hit, or waits for the export
under way (the cache's lock per key): nothing compiles twice, and every test still exports as before. An entry whose
options drift from its test's only costs that test its own compile.

Not ahead: the exports the first test files need (the tiny Llama, Qwen2 and Qwen3: the foreground gets there first),
and those a test must compile itself (another tuning, a cache miss, the same-process recompile it is about).

Run as `python session_exports.py LOG_PATH TEST_MODULE...`: the entries of those test modules.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import traceback


def ahead_of_time_exports() -> list[tuple[str, str, dict]]:
    """(test module, checkpoint: a TINY_CONFIGS family or "smollm2", export options), in the order the tests ask."""
    from conftest import (ARCHITECTURES, BF16_BLOCK_KINDS, BF16_EXPORT, NEURON_EXPORT, SERVE_EXPORT, SMOLLM2_EXPORT,
                          SMOLLM2_INT8_EXPORT, STATIC_BATCHES, tiny_export)

    foreground_first = ("llama", "qwen2", "qwen3")
    inductor = [("test_parity.py", family, tiny_export(family)) for family in ARCHITECTURES
                if family not in foreground_first]
    inductor += [("test_parity.py", "phi3", tiny_export("phi3", continuous_batching=True))]  # its engine test
    inductor += [("test_parity.py", family, BF16_EXPORT) for family in BF16_BLOCK_KINDS]
    inductor += [
        ("test_quantization.py", "llama", dict(tiny_export("llama", **STATIC_BATCHES), quantization="int8",
                                               backend="inductor")),
        ("test_quantization.py", "smollm2", SMOLLM2_INT8_EXPORT),
        ("test_sampling.py", "llama", dict(tiny_export("llama"), on_device_sampling=True)),
        ("test_speculation.py", "llama", dict(tiny_export("llama", batch_size=1), speculation_length=3)),
        # the server's export, and the checkpoint the Ray replicas export themselves (default buckets)
        ("test_serve.py", "llama", SERVE_EXPORT),
        ("test_serve.py", "llama", dict(batch_size=4, sequence_length=64, continuous_batching=True)),
    ]
    # test_neuron_backend.py and the [neuron] cases of the others run last (they start a PJRT client)
    neuron_exports = [("test_neuron_backend.py", "llama", dict(NEURON_EXPORT, num_cores=tp)) for tp in (1, 2, 4)]
    neuron_exports += [("test_neuron_backend.py", family, dict(tiny_export(family, backend="neuron"), num_cores=1))
                       for family in ARCHITECTURES if family != "llama"]
    neuron_exports += [("test_neuron_backend.py", "phi3", dict(tiny_export("phi3", backend="neuron",
                                                                            continuous_batching=True), num_cores=1))]
    neuron_exports += [("test_neuron_backend.py", family, dict(tiny_export(family, backend="neuron"), num_cores=2))
                       for family in ("gpt2", "mixtral")]
    neuron_exports += [("test_neuron_backend.py", family, dict(NEURON_EXPORT, **STATIC_BATCHES, num_cores=2))
                       for family in ("mistral", "qwen2")]
    neuron_exports += [
        ("test_neuron_backend.py", "llama", dict(NEURON_EXPORT, batch_size=1, num_cores=2, speculation_length=3)),
        ("test_neuron_backend.py", "llama", dict(NEURON_EXPORT, **STATIC_BATCHES, auto_cast_type="bf16")),
        *[("test_neuron_backend.py", family, dict(BF16_EXPORT, backend="neuron")) for family in BF16_BLOCK_KINDS],
        ("test_neuron_backend.py", "smollm2", dict(SMOLLM2_EXPORT, backend="neuron")),
        ("test_quantization.py", "llama", dict(tiny_export("llama", **STATIC_BATCHES), quantization="int8",
                                               backend="neuron")),
        ("test_sampling.py", "llama", dict(tiny_export("llama"), backend="neuron", on_device_sampling=True)),
    ]
    if importlib.util.find_spec("jax") is None:  # the [neuron] extra is not installed: those tests skip
        neuron_exports = []
    return inductor + neuron_exports


def main(log_path: str, modules: list[str]) -> None:
    os.nice(19)  # idle time only: the tests' own work always comes first
    parent = os.getppid()
    logging.basicConfig(filename=log_path, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import build_tiny_checkpoint

    from optimum_neuronx import NeuronModelForCausalLM
    from optimum_neuronx.utils.smollm2 import convert_smollm2

    log = logging.getLogger("session_exports")
    # The checkpoints beside the log, in the session's pytest directory: pytest removes old ones, also when the
    # session ends this process before it is done.
    scratch = os.path.dirname(os.path.abspath(log_path))
    checkpoints = {}
    for module, checkpoint, options in ahead_of_time_exports():
        if module not in modules:
            continue
        if os.getppid() != parent:  # the test session is gone
            return
        start = time.perf_counter()
        try:
            if checkpoint not in checkpoints:
                directory = os.path.join(scratch, checkpoint)
                checkpoints[checkpoint] = (convert_smollm2(directory) if checkpoint == "smollm2"
                                           else build_tiny_checkpoint(checkpoint, directory))
            NeuronModelForCausalLM.from_pretrained(checkpoints[checkpoint], export=True, **options)
            log.info("exported %s %s in %.1f s", checkpoint, options, time.perf_counter() - start)
        except Exception:  # the test that asks for it compiles it, and reports what fails
            log.error("export of %s %s failed:\n%s", checkpoint, options, traceback.format_exc())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
