"""`python -m optimum_neuronx.serve --model ...`: the OpenAI-compatible server (server/launch.py)."""

import sys

from .server.launch import main

if __name__ == "__main__":
    sys.exit(main())
