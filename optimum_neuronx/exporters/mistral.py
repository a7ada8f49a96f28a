from .export_config import ExportConfig

# Mistral: Llama math without biases; its sliding window is checked against sequence_length at export.
EXPORT_CONFIG = ExportConfig(model_type="mistral")
