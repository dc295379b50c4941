"""`python -m zbpipe ...`: the zbpipe command line (see zbpipe/cli.py)."""

from .cli import main

raise SystemExit(main())
