"""``python -m hgraph``: the same as the ``hgraph`` command."""

import sys

from hgraph.cli import main

sys.exit(main())
