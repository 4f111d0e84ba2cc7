"""`python -m speckernel ...` is the `speckernel` command."""

import sys

from .tools.cli import main

sys.exit(main())
