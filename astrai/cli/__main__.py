"""`python -m astrai.cli ...` is the `astrai` command."""

import sys

from astrai.cli import main

sys.exit(main())
