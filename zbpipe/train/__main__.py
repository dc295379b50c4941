"""`python -m zbpipe.train`: the trainer (see zbpipe/train/main.py)."""

import sys

from .main import main

sys.exit(main())
