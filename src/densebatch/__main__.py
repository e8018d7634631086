"""``python -m densebatch`` (and ``torchrun ... -m densebatch train ...``): the command line."""

import sys

from densebatch.cli import main

sys.exit(main())
