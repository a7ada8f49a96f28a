"""Export Transformers causal LMs to static-shape compiled graphs: AWS Neuron (StableHLO through PJRT) and the CPU
(AOTInductor)."""

from .configuration import NeuronConfig
from .version import __version__

__all__ = ["NeuronConfig", "NeuronModelForCausalLM", "pipeline", "__version__"]


def __getattr__(name):
    # The runtime pulls in transformers; import it only when asked for.
    if name == "NeuronModelForCausalLM":
        from .runtime import NeuronModelForCausalLM

        return NeuronModelForCausalLM
    if name == "pipeline":
        from .pipelines import pipeline

        return pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
