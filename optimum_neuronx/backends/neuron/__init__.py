"""The neuron backend, in progress: the decoder's graphs lowered to StableHLO (torch-mlir) and run through PJRT
(jaxlib), on the XLA CPU device here. Not yet a `backend=` choice: `NeuronModelForCausalLM` does not load these
graphs yet. What exists and is tested:

stablehlo.py   `lower_graph`: a torch.export program -> StableHLO text with the weights as arguments and the KV
               cache aliased input -> output (donated), plus its argument manifest
pjrt.py        `PjrtGraph`: such a graph compiled for a PJRT device, run with the cache kept on the device,
               serialized and deserialized without compiling
"""
