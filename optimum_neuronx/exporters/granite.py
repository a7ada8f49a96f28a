from .export_config import ExportConfig

# Granite: Llama's layers with four scalars - embeddings and each residual branch multiplied, the attention scale
# replaced (attention_multiplier), the logits divided (logits_scaling).
EXPORT_CONFIG = ExportConfig(
    model_type="granite", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    scalars={name: name for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                     "logits_scaling")},
)
