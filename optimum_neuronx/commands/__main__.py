"""`python -m optimum_neuronx.commands`: the export command without optimum-cli."""

import sys

from .export import main

sys.exit(main())
