"""`python -m speckernel ...` is the `speckernel` command."""

import sys

from .cli import main

sys.exit(main())
