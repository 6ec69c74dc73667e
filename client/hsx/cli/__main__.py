"""`python -m hsx.cli`: the `hsx` command."""

import sys

from hsx.cli import main

sys.exit(main())
