from .export_config import ExportConfig

# SmolLM3: Llama's layers, some without position encoding (no_rope_layers: 1 = RoPE, 0 = NoPE, every 4th by default).
EXPORT_CONFIG = ExportConfig(model_type="smollm3", qkv_bias="attention_bias", o_bias="attention_bias",
                             mlp_bias="mlp_bias", rope_layers="no_rope_layers")
