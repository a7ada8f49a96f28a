from .export_config import LLAMA_FAMILY_WEIGHTS, ExportConfig

# Mixtral: Mistral's attention, and a mixture of gated experts instead of the MLP (a softmax router, top-k experts,
# their weights renormalized). Transformers stores each layer's experts stacked: gate_up [E, 2I, H], down [E, H, I].
MOE_WEIGHTS = {
    **{name: sources for name, sources in LLAMA_FAMILY_WEIGHTS.items() if "gate_up" not in name and "down" not in name},
    "layers.{i}.router.weight": ("model.layers.{i}.mlp.gate.weight",),
    "layers.{i}.experts_gate_up.weight": ("model.layers.{i}.mlp.experts.gate_up_proj",),
    "layers.{i}.experts_down.weight": ("model.layers.{i}.mlp.experts.down_proj",),
}

EXPORT_CONFIG = ExportConfig(model_type="mixtral", mlp="moe", weight_map=MOE_WEIGHTS,
                             config_fields={"num_experts": "num_local_experts"})
