import sys

from flannelpy.cli import main

sys.exit(main())
