"""Session-scoped fixtures: tiny random checkpoints per architecture, compiled once and shared."""

from __future__ import annotations

import functools
import logging
import os

# Four virtual XLA CPU devices for the neuron backend's tensor-parallel tests; read when jaxlib starts its client.
_DEVICES = "--xla_force_host_platform_device_count"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}=4".strip()

# A worker per graph, not per core: a graph's compile is mostly one thread (tracing, then g++ on its wrapper), so the
# third graph of a tiny export on 2 cores would otherwise run alone after the first two.
os.environ.setdefault("OPTIMUM_NEURONX_COMPILE_WORKERS", "8")

import pytest  # noqa: E402
import torch  # noqa: E402

from optimum_neuronx import NeuronModelForCausalLM  # noqa: E402
from optimum_neuronx.configuration import TORCH_DTYPES  # noqa: E402

# Tiny models with initializer_range=0.2: top-1/top-2 logit gaps ~1e-2, well above numerical noise.
TINY_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
TINY_CONFIGS = {
    # A wider MLP: at batch 3 the down projection's float32 input rows (3 x 1088 x 4 bytes, 13 KiB) are the widest
    # the dot kernel reads in these exports (float32: whole rows, in blocks of 4 weight rows).
    "llama": dict(attention_bias=True, intermediate_size=1088,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}),
    # Sliding windows shorter than the sequence: on every layer (mistral: the cache is a ring of the window's 12
    # slots), on some layers only (qwen2: layer 1; every slot kept for all layers). The parity tests' prompts of
    # 5..14 tokens and 45 new ones: the window cuts into the prompts, then slides across the 32 -> 64 token bucket.
    "mistral": dict(sliding_window=12),
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=12, max_window_layers=1),
    "qwen3": dict(head_dim=32),
    # Every scalar away from 1 (the attention scale too: not head_dim ** -0.5), so that a missing one shows.
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.09, logits_scaling=2.5),
    # LongRoPE whose pretraining length (32) the generations cross: the call that passes it switches frequencies.
    "phi3": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]},
                 original_max_position_embeddings=32),
    # 6 heads of 16 (no KV grouping in gpt2), an odd MLP width (n_inner), gpt2's own activation name.
    "gpt2": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=None, n_inner=200,
                 activation_function="gelu_new"),
    # 8 experts, top 2, of an odd width: a decode step of the shared batch-3 export (3 rows x 2 < 8) gathers only
    # its rows' experts, a prompt runs every expert; qwen3_moe without renormalizing the top-2 weights.
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=72),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False,
                      head_dim=32),
    # Local layers with an 8-token window and their own RoPE, a global one with linear RoPE scaling; query scale
    # not head_dim's; final logits soft-capped.
    "gemma3_text": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=20, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                            "factor": 4.0}},
                        final_logit_softcapping=5.0),
    # The middle layer of three uses no position encoding (NoPE).
    "smollm3": dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1], tie_word_embeddings=False),
}
ARCHITECTURES = tuple(TINY_CONFIGS)
# One family per distinct kind of block, whose bfloat16 numerics differ (llama: the Llama block, tested on its own):
# LayerNorm with learned positions (gpt2), Gemma's norms and soft-capping (gemma3_text), mixture of experts (mixtral).
# The other families are the Llama block with other scalars, RoPE or flags: their fp32 parity covers them.
BF16_BLOCK_KINDS = ("gpt2", "gemma3_text", "mixtral")

# Compiled shapes shared by the parity and engine tests: a batch of 3, one context bucket (a one-row prefill graph:
# continuous batching), two token buckets so that a 40+ token generation crosses the 32 -> 64 boundary.
TINY_EXPORT = dict(batch_size=3, sequence_length=64, context_buckets=[16], token_buckets=[32, 64],
                   continuous_batching=True)
# Per family: phi3's LongRoPE re-encodes the sequence once it passes 32 tokens, which takes a context bucket that long.
# Its static batches keep the context graphs: LongRoPE switches a whole batch at once (as Transformers), which a
# one-row prefill graph cannot (its engine test exports with continuous batching).
TINY_EXPORT_OVERRIDES = {"phi3": dict(context_buckets=[16, 64], continuous_batching=False)}
NEURON_EXPORT = dict(TINY_EXPORT, backend="neuron")
# Static batches of the same shapes (context and token graphs: 3, not 5) for the exports whose tests never step
# requests through the engine: what they check does not touch the prefill and fused graphs, which cost compile time.
STATIC_BATCHES = dict(continuous_batching=False)
# The bfloat16 parity exports (one per block kind, both backends): a batch of 2, one bucket of 32.
BF16_EXPORT = dict(batch_size=2, sequence_length=32, context_buckets=[16], token_buckets=[32], auto_cast_type="bf16")
# The real SmolLM2: float32 (smollm2_compiled, test_cli.py's CLI export, the neuron backend's), and int8 in bfloat16.
SMOLLM2_EXPORT = dict(batch_size=2, sequence_length=128, context_buckets=[64], token_buckets=[128])
# The serving tests' export (test_serve.py): 4 slots, prompts past 16 tokens prefilled in chunks.
SERVE_EXPORT = dict(batch_size=4, sequence_length=256, context_buckets=[16], token_buckets=[32, 256],
                    continuous_batching=True)
SMOLLM2_INT8_EXPORT = dict(batch_size=2, sequence_length=256, context_buckets=[256], token_buckets=[256],
                           auto_cast_type="bf16", quantization="int8")


def tiny_export(model_type: str, **overrides) -> dict:
    """The export options of a tiny family's parity tests."""
    return {**TINY_EXPORT, **TINY_EXPORT_OVERRIDES.get(model_type, {}), **overrides}


def build_tiny_checkpoint(model_type: str, directory, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_COMMON, **TINY_CONFIGS[model_type], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """model_type -> directory of a tiny random checkpoint (built once per session)."""
    return functools.cache(lambda model_type: build_tiny_checkpoint(
        model_type, tmp_path_factory.mktemp(f"tiny-{model_type}")))


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint):
    """model_type -> the Transformers eager model of the tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    return functools.cache(lambda model_type: AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint(model_type)).eval())


@pytest.fixture(scope="session")
def compiled_model(tiny_checkpoint):
    """model_type -> the tiny checkpoint exported with TINY_EXPORT (compiled once per session)."""
    return functools.cache(lambda model_type: NeuronModelForCausalLM.from_pretrained(
        tiny_checkpoint(model_type), export=True, **tiny_export(model_type)))


@pytest.fixture(scope="session")
def saved_tiny_llama(compiled_model, tmp_path_factory):
    """The compiled tiny Llama saved to disk (tests copy it before damaging it)."""
    directory = tmp_path_factory.mktemp("saved") / "tiny-llama"
    compiled_model("llama").save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    from optimum_neuronx.utils.smollm2 import convert_smollm2

    return convert_smollm2(tmp_path_factory.mktemp("smollm2") / "checkpoint")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_compiled(smollm2_checkpoint):
    # Same shapes as test_cli.py's SmolLM2 export: one compile per session, the other a compile-cache hit.
    return NeuronModelForCausalLM.from_pretrained(smollm2_checkpoint, export=True, **SMOLLM2_EXPORT)


# Staggered requests for the engine checks: (prompt length, max_tokens, the scheduler step it arrives at). Five
# requests on three slots; 23 and 35 tokens take two and three prefill chunks of 16; on phi3 the 23-token prompt
# passes LongRoPE's switch at 32 while decoding and 35 starts past it.
STAGGERED_REQUESTS = ((5, 8, 0), (23, 12, 0), (9, 5, 2), (35, 10, 3), (3, 7, 6))


def assert_staggered_requests_match_generate_alone(model, seed: int = 3):
    """Requests arriving at different steps, more than the slots, served by the scheduler over `model`'s engine
    (continuous batching): each request's greedy tokens equal `generate` on its prompt alone."""
    from optimum_neuronx.scheduler import Request, Scheduler

    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n, _, _ in STAGGERED_REQUESTS]
    eos = model.generation_config.eos_token_id
    expected = []
    for prompt, (_, max_tokens, _) in zip(prompts, STAGGERED_REQUESTS):
        new = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):]
        expected.append(new.tolist()[:new.tolist().index(eos)] if eos in new.tolist() else new.tolist())
    engine = model._engine
    scheduler = Scheduler(engine, max_waiting=len(prompts))
    fused_calls = []  # the chunk slot of each step a prefill chunk rode along with
    engine.fused_step = lambda *args: fused_calls.append(args[3]) or type(engine).fused_step(engine, *args)
    got, step, arrived = {}, 0, 0
    try:
        while arrived < len(prompts) or len(scheduler):
            while arrived < len(prompts) and STAGGERED_REQUESTS[arrived][2] <= step:
                scheduler.add(Request(prompts[arrived], STAGGERED_REQUESTS[arrived][1], request_id=str(arrived),
                                      stop_token_ids=(eos,)))
                got[str(arrived)] = []
                arrived += 1
            for output in scheduler.step():
                got[output.request_id] += output.token_ids
            step += 1
    finally:
        del engine.fused_step  # the instance's wrapper: the class's method again
    assert [got[str(i)] for i in range(len(prompts))] == expected
    # with fused graphs, the later prompts' chunks rode along with decode steps: the 9- and 3-token ones at least
    # (35 tokens past phi3's LongRoPE switch are encoded in one pass)
    assert len(fused_calls) >= (2 if engine.fused_chunk else 0) and (engine.fused_chunk or not fused_calls)


def seed_compile_cache(cache_dir, checkpoint, model):
    """A compile cache at `cache_dir` holding one entry: the graphs of `model` (a session export of `checkpoint`),
    stored as an export stores them, so that cache tests start from a filled cache without compiling."""
    import json

    from optimum_neuronx.artifacts import WEIGHTS_NAME
    from optimum_neuronx.cache import CompileCache
    from optimum_neuronx.exporters.plan import plan_export

    meta = json.loads((model.artifact_dir / "neuron_config.json").read_text())
    key = plan_export(str(checkpoint), model.neuron_config, check_host_memory=False).cache_key()
    graph_files = tuple(name for name in meta["files"] if name != WEIGHTS_NAME)
    CompileCache(cache_dir).store(key, model.artifact_dir, graph_files, meta["compile_time_s"])
    return cache_dir


# The families whose tiny configs slide a window shorter than the sequence (TINY_CONFIGS).
SLIDING_WINDOW_FAMILIES = ("mistral", "qwen2")


def left_padded_prompts(lengths, seed: int):
    """Random prompts of these lengths, left-padded like a tokenizer with padding_side='left' does: (ids, mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        input_ids[row, width - n:] = torch.randint(3, 256, (n,), generator=generator)
        attention_mask[row, width - n:] = 1
    return input_ids, attention_mask


@pytest.fixture
def left_padded_batch():
    """Three prompts of different lengths, left-padded."""
    return left_padded_prompts((5, 9, 14), seed=1)


FRESH_PROCESS_GENERATE = """
import json, logging, sys
import torch  # noqa: E402
import torch._inductor
def refuse(*args, **kwargs):  # loading must never compile: make any attempt fail loudly
    raise AssertionError("compilation attempted while loading")
torch._inductor.aot_compile = refuse
torch.export.export = refuse
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from optimum_neuronx import NeuronModelForCausalLM  # noqa: E402
model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
inputs = {k: torch.tensor(v) for k, v in json.loads(sys.argv[2]).items()}
out = model.generate(**inputs, max_new_tokens=int(sys.argv[3]), do_sample=False)
print(json.dumps(out.tolist()))
"""


def generate_in_fresh_process(model_ref, inputs, max_new_tokens, env=None, check=True):
    """Load `model_ref` (directory or Hub id) in a new Python process and greedy-generate; return tokens."""
    import json
    import subprocess
    import sys

    payload = json.dumps({k: v.tolist() for k, v in inputs.items()})
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS_GENERATE, str(model_ref), payload,
                             str(max_new_tokens)], capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    tokens = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
    return result, tokens


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles more than the inner loop's two shared exports (the tiny Llama on "
                                       "each backend), or runs the real SmolLM2; CI runs every test")
    config.addinivalue_line("markers", "pjrt: starts a PJRT client (jaxlib) in the test process; runs after the rest")
    logging.getLogger("optimum_neuronx").setLevel(logging.INFO)


@pytest.fixture(scope="session", autouse=True)
def isolated_compile_cache(tmp_path_factory):
    """Every export in the tests uses a compile cache and a provenance record of its own session, never the user's."""
    from optimum_neuronx.cache import CACHE_ENV
    from optimum_neuronx.trust import PROVENANCE_ENV

    previous = {name: os.environ.get(name) for name in (CACHE_ENV, PROVENANCE_ENV)}
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("compile-cache"))
    os.environ[PROVENANCE_ENV] = str(tmp_path_factory.mktemp("provenance"))
    yield os.environ[CACHE_ENV]
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def session_exports_ahead(request, isolated_compile_cache, tmp_path_factory):
    """Compile the slow tests' exports ahead of them in the session's compile cache, on idle CPU time
    (session_exports.py). Only where the run selects slow tests; OPTIMUM_NEURONX_TEST_AHEAD=0 turns it off."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    items = request.session.items
    modules = sorted({item.path.name for item in items if item.get_closest_marker("slow")})
    if not modules or os.environ.get("OPTIMUM_NEURONX_TEST_AHEAD", "1") == "0":
        yield None
        return
    log = tmp_path_factory.mktemp("session-exports") / "exports.log"
    # A process group of its own (its compile workers and compilers in it) in the tests' session: with the kernel's
    # autogroups, only processes of one session compete by nice value.
    with open(log.with_suffix(".err"), "w") as errors:
        process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("session_exports.py")), str(log),
                                    *modules], process_group=0, stdout=subprocess.DEVNULL, stderr=errors)
    yield log
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def assert_bf16_logits_within_tolerance(model, tiny_checkpoint, reference_model, input_ids, attention_mask,
                                        model_type: str = "llama"):
    """Teacher-forced logits of a bfloat16 export (a prompt, then 10 more tokens on its cache) against the float32
    reference: within twice what Transformers eager in bfloat16 strays from it, bfloat16's own rounding noise."""
    from transformers import AutoModelForCausalLM

    eager_bf16 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), dtype=torch.bfloat16).eval()
    continuation = torch.randint(3, 256, (input_ids.shape[0], 10), generator=torch.Generator().manual_seed(3))
    full_ids = torch.cat([input_ids, continuation], 1)
    full_mask = torch.cat([attention_mask, torch.ones_like(continuation)], 1)
    positions = slice(input_ids.shape[1] - 1, None)
    # Positions from the mask, as generate passes them (a plain forward would count the padding too, which models with
    # learned absolute positions, gpt2, see)
    position_ids = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    with torch.no_grad():
        fp32 = reference_model(model_type)(input_ids=full_ids, attention_mask=full_mask,
                                           position_ids=position_ids).logits[:, positions]
        eager = eager_bf16(input_ids=full_ids, attention_mask=full_mask, position_ids=position_ids).logits[:, positions]
        eager = eager.float()
    first = model(input_ids=input_ids, attention_mask=attention_mask)
    steps = model(continuation, attention_mask=full_mask, past_key_values=first.past_key_values, logits_to_keep=0)
    ours = torch.cat([first.logits, steps.logits], 1)
    ours_error = (ours - fp32).abs().max().item()
    eager_error = (eager - fp32).abs().max().item()
    print(f"{model_type} bf16 vs fp32 reference: max |logit diff| ours {ours_error:.3f}, Transformers eager bf16 {eager_error:.3f}"
          f" (ours vs eager bf16: {(ours - eager).abs().max().item():.3f}; largest |logit| {fp32.abs().max():.1f})")
    assert ours_error <= 2 * eager_error + 1e-2


DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # as the tuning table names them


def tune(patch, **values):
    """Override this CPU's entries of the inductor tuning table (kernels/tuning.json) for one test."""
    from optimum_neuronx.backends.inductor import tuning

    name = tuning.profile_name(tuning.cpu_identity())
    patch.setitem(tuning.PROFILES, name, {**tuning.PROFILES.get(name, {}), **values})


# Fixtures that compile graphs or kernel packages of their own (or start the Hub server and its subprocesses): the
# tests that use them are `slow`, out of the inner loop.
SLOW_FIXTURES = {"smollm2_compiled", "smollm2_bf16_pair", "speculative", "sampling_model", "int8_llama",
                 "kernel_package", "attention_package", "int8_kernel_package", "tiled_package", "tiled_llama",
                 "filled_cache", "cli_export", "hub", "bf16_llama"}


def pytest_collection_modifyitems(config, items):
    """Tests that use a compiling fixture are marked `slow`. Tests marked `pjrt` (they start a PJRT client, jaxlib) run
    last: a process with its threads compiles without forked workers (backends/workers.py), which would slow every
    export after them."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("pjrt") is not None)


@pytest.fixture(autouse=True)
def pjrt_clients_are_marked(request):
    """A test that starts the process's first PJRT client must carry the `pjrt` marker (the ordering reads it)."""
    from optimum_neuronx.backends.workers import pjrt_started

    before = pjrt_started()
    yield
    if not before and pjrt_started() and request.node.get_closest_marker("pjrt") is None:
        pytest.fail(f"{request.node.nodeid} started a PJRT client but is not marked @pytest.mark.pjrt: every export "
                    f"after it compiles one graph at a time. Mark it.", pytrace=False)
