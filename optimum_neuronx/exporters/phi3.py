from .export_config import LLAMA_FAMILY_WEIGHTS, ExportConfig

# Phi-3: Llama's layers with q/k/v and gate/up already fused in the checkpoint (in the decoder's order: q, k, v and
# gate, up), and LongRoPE in its long-context checkpoints.
PHI3_WEIGHTS = {
    **LLAMA_FAMILY_WEIGHTS,
    "layers.{i}.qkv_proj.weight": ("model.layers.{i}.self_attn.qkv_proj.weight",),
    "layers.{i}.gate_up_proj.weight": ("model.layers.{i}.mlp.gate_up_proj.weight",),
}

EXPORT_CONFIG = ExportConfig(model_type="phi3", weight_map=PHI3_WEIGHTS)
