import sys

from astrai.train.cli import main

sys.exit(main())
