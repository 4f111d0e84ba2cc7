"""`python -m speckernel ...` is the `speckernel` command."""

import sys

from speckernel.tools.cli import main

sys.exit(main())
