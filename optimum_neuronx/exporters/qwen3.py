from .export_config import ExportConfig

# Qwen3: RMSNorm over head_dim on queries and keys before rotary embedding; optional attention bias.
EXPORT_CONFIG = ExportConfig(model_type="qwen3", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True)
