"""``python -m flannelpy.lab up|status|down ...``."""

import sys

from flannelpy_lab.cli import main

sys.exit(main())
