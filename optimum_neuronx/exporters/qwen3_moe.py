from .export_config import ExportConfig
from .mixtral import MOE_WEIGHTS

# Qwen3-MoE: Qwen3's attention (q/k norm) with Mixtral's experts, of moe_intermediate_size, renormalized only with
# norm_topk_prob. Every layer must be sparse (dense layers mixed in are refused).
EXPORT_CONFIG = ExportConfig(
    model_type="qwen3_moe", qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp="moe",
    weight_map=MOE_WEIGHTS, config_fields={"intermediate_size": "moe_intermediate_size"},
    required={"decoder_sparse_step": 1, "mlp_only_layers": []},
)
