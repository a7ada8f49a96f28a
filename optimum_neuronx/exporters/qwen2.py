from .export_config import ExportConfig

# Qwen2: q/k/v projections always carry a bias, o_proj never does.
EXPORT_CONFIG = ExportConfig(model_type="qwen2", qkv_bias=True)
