"""`python -m dtrain.eval`: see cli.py."""

import sys

from dtrain.eval.cli import main

sys.exit(main())
