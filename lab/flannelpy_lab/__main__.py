"""``python -m flannelpy_lab up|status|pod|down|run|env ...``."""

import sys

from flannelpy_lab.cli import main

sys.exit(main())
