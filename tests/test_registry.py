"""Export configs: declarative tables, and refusal of what the static decoder does not implement."""

import pytest
import torch
from transformers import AutoConfig

from conftest import TINY_COMMON, TINY_CONFIGS
from optimum_neuronx import NeuronConfig
from optimum_neuronx.exporters import get_export_config, supported_model_types
from optimum_neuronx.memory import GIB, check_fits_neuron_cores, estimate_memory
from optimum_neuronx.backends.inductor.lowering import Lowering
from optimum_neuronx.modeling.decoder import StaticDecoder

SMALL = NeuronConfig(sequence_length=64)


def _config(model_type, **overrides):
    return AutoConfig.for_model(model_type, **{**TINY_COMMON, **TINY_CONFIGS[model_type], **overrides})


def test_supported_model_types():
    assert supported_model_types() == ("gemma3_text", "gpt2", "granite", "llama", "mistral", "mixtral", "phi3", "qwen2",
                                       "qwen3", "qwen3_moe", "smollm3")


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"model_type 'bloom' is not supported.*Supported model types: gemma3_text, gpt2, granite, "
                                         r"llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe, smollm3"):
        get_export_config("bloom")


@pytest.mark.parametrize("model_type, flags", [
    ("llama", dict(qkv_bias=True, o_bias=True, qk_norm=False, tie_word_embeddings=False)),
    ("mistral", dict(qkv_bias=False, o_bias=False, qk_norm=False, tie_word_embeddings=False)),
    ("qwen2", dict(qkv_bias=True, o_bias=False, qk_norm=False, tie_word_embeddings=True)),
    ("qwen3", dict(qkv_bias=False, o_bias=False, qk_norm=True, tie_word_embeddings=False)),
    ("granite", dict(qkv_bias=False, embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.09,
                     logits_scaling=2.5, nope_layers=())),
    ("phi3", dict(qkv_bias=False, rope_long_after=32, nope_layers=())),
    ("mixtral", dict(mlp="moe", num_experts=8, experts_per_token=2, normalize_expert_weights=True,
                     intermediate_size=72)),
    ("qwen3_moe", dict(mlp="moe", qk_norm=True, num_experts=8, experts_per_token=2, normalize_expert_weights=False,
                       intermediate_size=40)),
    ("gemma3_text", dict(norm="gemma", sandwich_norms=True, qk_norm=True, sliding_window=8, sliding_layers=(0, 2),
                         rope_local_layers=(0, 2), attention_multiplier=20**-0.5, embedding_multiplier=8.0,
                         final_logit_softcapping=5.0, hidden_act="gelu_pytorch_tanh")),
    ("gpt2", dict(qkv_bias=True, o_bias=True, mlp_bias=True, norm="layer", positions="learned", mlp="plain",
                  max_positions=256, num_kv_heads=6, intermediate_size=200, hidden_act="gelu_new",
                  tie_word_embeddings=True)),
    ("smollm3", dict(qkv_bias=False, tie_word_embeddings=False, nope_layers=(1,), attention_multiplier=None,
                     embedding_multiplier=1.0)),
])
def test_flags_and_weight_mapping_cover_every_parameter(model_type, flags):
    from transformers import AutoModelForCausalLM

    config = _config(model_type)
    export_config = get_export_config(model_type)
    spec = export_config.decoder_spec(config, SMALL)
    assert {k: getattr(spec, k) for k in flags} == flags
    hf = AutoModelForCausalLM.from_config(config)
    hf_state = hf.state_dict()
    hf_q = next(hf_state[n] for n in ("model.layers.1.self_attn.q_proj.weight",
                                      "model.layers.1.self_attn.qkv_proj.weight", "transformer.h.1.attn.c_attn.weight")
                if n in hf_state)
    if model_type == "gpt2":
        hf_q = hf_q.t()  # Conv1D stores [in, out]
    with torch.device("meta"):  # the decoder has every parameter of the checkpoint, no more
        assert sum(p.numel() for p in StaticDecoder(spec).parameters()) == sum(p.numel() for p in hf.parameters())
    # Stacked layers (one loop) and, where weights are packed per layer, unrolled ones.
    for lowering, layer_1_qkv in ((Lowering(), lambda w: w["layers.qkv_proj.weight"][1]),
                                  (Lowering(onednn=True, packed_rows=8), lambda w: w["layers.1.qkv_proj.weight"])):
        decoder = StaticDecoder(spec, lowering)
        weights = export_config.convert_weights(hf_state, decoder.parameter_names(), torch.float32, spec.num_layers)
        assert set(weights) == set(decoder.parameter_names())
        assert sum(w.numel() for w in weights.values()) == sum(p.numel() for p in hf.parameters())
        assert torch.equal(layer_1_qkv(weights)[: hf_q.shape[0]], hf_q)
        restored = export_config.restore_weights(weights, hf_state)
        assert set(restored) == {name for name, _ in hf.named_parameters()}
        assert all(torch.equal(restored[name], hf_state[name]) for name in restored)


@pytest.mark.parametrize("model_type, overrides, message", [
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"llama: config.rope_parameters\['rope_type'\] = 'dynamic' is not supported.*default, linear, llama3, yarn"),
    ("qwen2", dict(layer_types=["chunked_attention", "full_attention"]),
     r"qwen2: config.layer_types holds \['chunked_attention'\].*full_attention, sliding_attention"),
    ("llama", dict(hidden_act="swish_glu"), r"config.hidden_act = 'swish_glu' is not supported"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True),
     r"gpt2: config.scale_attn_by_inverse_layer_idx = True is not supported by the static decoder \(only False\)"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), r"qwen3_moe: config.mlp_only_layers = \[0\] is not supported"),
    ("mixtral", dict(num_experts_per_tok=9), r"mixtral: config.num_experts_per_tok = 9 must lie between 1 and .* \(8\)"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0),
     r"gemma3_text: config.attn_logit_softcapping = 50.0 is not supported by the static decoder \(only None\)"),
    ("smollm3", dict(no_rope_layers=[1, 2, 1]), r"smollm3: config.no_rope_layers must hold one 0 or 1 per layer \(3\)"),
])
def test_unsupported_config_features_are_refused(model_type, overrides, message):
    with pytest.raises(ValueError, match=message):
        get_export_config(model_type).decoder_spec(_config(model_type, **overrides), SMALL)


def test_sliding_windows_per_layer():
    spec = lambda model_type, **kw: get_export_config(model_type).decoder_spec(_config(model_type, **kw), SMALL)  # noqa
    assert (spec("mistral", sliding_window=4096).sliding_window, spec("mistral", sliding_window=4096).sliding_layers) == (0, ())  # covers all
    assert (spec("mistral", sliding_window=16).sliding_window, spec("mistral", sliding_window=16).sliding_layers) == (
        16, (0, 1))
    qwen2 = spec("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert (qwen2.sliding_window, qwen2.sliding_layers) == (16, (1,))
    assert spec("qwen2", use_sliding_window=False, sliding_window=16).sliding_window == 0


def test_memory_plan_for_a_1b_llama():
    config = AutoConfig.for_model("llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                  num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    neuron_config = NeuronConfig(batch_size=4, sequence_length=2048, auto_cast_type="bf16")
    spec = get_export_config("llama").decoder_spec(config, neuron_config)
    estimate = estimate_memory(spec, neuron_config)
    assert abs(estimate.weight_bytes / 1e9 - 2.2) < 0.01  # 1.1B parameters x 2 bytes
    assert estimate.kv_cache_bytes == 2 * 22 * 4 * 2048 * 4 * 64 * 2
    assert estimate.min_tp_degree == 1
    big = NeuronConfig(batch_size=128, sequence_length=4096, auto_cast_type="fp32", tp_degree=1)
    big_estimate = estimate_memory(spec, big)
    assert big_estimate.total_bytes > 16 * GIB
    with pytest.raises(ValueError, match=r"tp_degree \(num_cores\) = 1 needs .* GiB per NeuronCore.*use num_cores="):
        check_fits_neuron_cores(big_estimate)


def test_memory_plan_counts_a_window_only_cache(tmp_path, capsys):
    # Mistral-7B-v0.1's 4096-token window on every layer: at 16384 tokens its cache holds 4096 slots per layer
    from optimum_neuronx.commands.estimate import main

    config = AutoConfig.for_model("mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                  max_position_embeddings=32768, sliding_window=4096)
    neuron_config = NeuronConfig(batch_size=1, sequence_length=16384, auto_cast_type="bf16", tp_degree=8)
    spec = get_export_config("mistral").decoder_spec(config, neuron_config)
    assert spec.cache_places and spec.kv_cache_shape(1, 16384) == (32, 2, 1, 8, 4096, 128)
    assert estimate_memory(spec, neuron_config).kv_cache_bytes == 2 * 32 * 4096 * 8 * 128 * 2  # 0.5 GiB, not 2
    config.save_pretrained(tmp_path / "mistral")
    assert main(["--model", str(tmp_path / "mistral"), "--sequence_length", "16384", "--auto_cast_type", "bf16"]) == 0
    assert "KV cache:      0.50 GiB" in capsys.readouterr().out


def test_longrope_needs_a_context_bucket_past_its_switch():
    config = _config("phi3")
    with pytest.raises(ValueError, match=r"phi3: LongRoPE switches .* past original_max_position_embeddings = 32.*"
                                         r"context bucket of at least 33 tokens; the largest is 16"):
        get_export_config("phi3").decoder_spec(config, NeuronConfig(sequence_length=64, context_buckets=[16]))
    spec = get_export_config("phi3").decoder_spec(config, NeuronConfig(sequence_length=32, context_buckets=[16]))
    assert spec.rope_long_after == 32 and len(spec.rope_long_inv_freq) == len(spec.rope_inv_freq)
