# Discovered by optimum-cli (namespace optimum.commands.register; no __init__.py here, PEP 420).
from optimum_neuronx.commands.optimum_cli import REGISTER_COMMANDS  # noqa: F401
