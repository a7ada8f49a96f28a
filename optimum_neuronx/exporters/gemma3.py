from .export_config import LLAMA_FAMILY_WEIGHTS, ExportConfig

# Gemma 3 (text, Gemma3ForCausalLM: model_type gemma3_text): RMSNorm scaled by 1 + weight, norms on both sides of each
# branch, q/k norm, embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar ** -0.5, local layers with
# a sliding window and their own RoPE frequencies, optional final logit soft-capping.
GEMMA3_WEIGHTS = {
    **LLAMA_FAMILY_WEIGHTS,
    "layers.{i}.post_attention_norm.weight": ("model.layers.{i}.pre_feedforward_layernorm.weight",),
    "layers.{i}.attn_out_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
    "layers.{i}.mlp_out_norm.weight": ("model.layers.{i}.post_feedforward_layernorm.weight",),
}

EXPORT_CONFIG = ExportConfig(
    model_type="gemma3_text", qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", norm="gemma",
    sandwich_norms=True, weight_map=GEMMA3_WEIGHTS, config_fields={"hidden_act": "hidden_activation"},
    scalars={"embedding_multiplier": lambda c: c.hidden_size**0.5,
             "attention_multiplier": lambda c: c.query_pre_attn_scalar**-0.5,
             "final_logit_softcapping": lambda c: c.final_logit_softcapping or 0.0},
    required={"attn_logit_softcapping": None, "use_bidirectional_attention": False},
)
