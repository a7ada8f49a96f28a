from .export_config import ExportConfig

# Llama: `attention_bias` adds biases to q/k/v and o; `mlp_bias` to the three MLP projections.
EXPORT_CONFIG = ExportConfig(model_type="llama", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias")
