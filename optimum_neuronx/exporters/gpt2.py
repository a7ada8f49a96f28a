from .export_config import ExportConfig

# GPT-2: LayerNorm with biases, learned absolute positions (no RoPE), a plain GELU MLP, biases everywhere, a tied LM
# head. Its Conv1D weights are stored [in, out] (transposed), q/k/v fused in one c_attn.
_LAYER = "transformer.h.{i}."
GPT2_WEIGHTS = {
    "embed_tokens.weight": ("transformer.wte.weight",),
    "embed_positions.weight": ("transformer.wpe.weight",),
    "norm.weight": ("transformer.ln_f.weight",),
    "norm.bias": ("transformer.ln_f.bias",),
    "lm_head.weight": ("lm_head.weight",),
    **{f"layers.{{i}}.{ours}.{kind}": (f"{_LAYER}{theirs}.{kind}",)
       for ours, theirs in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2"), ("qkv_proj", "attn.c_attn"),
                            ("o_proj", "attn.c_proj"), ("up_proj", "mlp.c_fc"), ("down_proj", "mlp.c_proj"))
       for kind in ("weight", "bias")},
}

EXPORT_CONFIG = ExportConfig(
    model_type="gpt2", qkv_bias=True, o_bias=True, mlp_bias=True, norm="layer", positions="learned", mlp="plain",
    weight_map=GPT2_WEIGHTS,
    config_fields={"intermediate_size": "n_inner", "rms_norm_eps": "layer_norm_epsilon",
                   "hidden_act": "activation_function"},
    required={"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    transposed=tuple(f"layers.{{i}}.{name}.weight" for name in ("qkv_proj", "o_proj", "up_proj", "down_proj")),
)
