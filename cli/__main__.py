"""``python -m cli``: the ``voxpipe`` command."""

import sys

from cli.main import main

sys.exit(main())
