"""`python -m optimum_neuronx.commands`: the export command without optimum-cli."""

from .export import main

main()
