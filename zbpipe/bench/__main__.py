"""`python -m zbpipe.bench ...`: the same as `zbpipe bench ...`."""

from .command import main

raise SystemExit(main())
