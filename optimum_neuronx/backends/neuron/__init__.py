"""The neuron backend: graphs lowered to StableHLO (torch-mlir) and run through PJRT (jaxlib) on a Neuron device
where the plugin is installed, else on the XLA CPU device; tensor parallel by XLA SPMD.

stablehlo.py    a torch.export program -> StableHLO with the weights as arguments, the KV cache aliased (donated),
                shardings on the arguments of a partitioned graph
pjrt.py         a StableHLO graph compiled for one or several PJRT devices, run, serialized, deserialized
neuronx_cc.py   the ahead-of-time NEFF compile (neuronx-cc where it is on PATH)
backend.py      the Backend: writes and loads the artifact's graph files and manifest; the on-device KV cache
"""

from .backend import BACKEND, NeuronBackend

__all__ = ["BACKEND", "NeuronBackend"]
