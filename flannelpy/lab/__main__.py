"""``python -m flannelpy.lab up|status|down ...``."""

import sys

from flannelpy.lab.cli import main

sys.exit(main())
