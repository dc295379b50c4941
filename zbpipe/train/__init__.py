"""zbpipe's trainer: a tiny transformer (model.py) trained on a synthetic task (data.py) with
either pipeline library (pipeline.py) in spawned local ranks (zbpipe/launch.py, which also runs
the benchmarks' and the tests' worlds), or as one rank of torchrun's world when its variables
are set (zbpipe/torchrun.py), checked against one process (main.py; `zbpipe train`,
`python -m zbpipe.train`)."""

from .main import main

__all__ = ["main"]
