"""``python -m hgraph``: the same as the ``hgraph`` command."""

import sys

from hgraph.cli.command import main

sys.exit(main())
