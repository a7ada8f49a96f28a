import sys

from ..commands.export import main

sys.exit(main())
