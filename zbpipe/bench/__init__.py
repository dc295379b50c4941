"""zbpipe's microbenchmark harness: emulated devices (``emulated``) and, on top of them, the
``zbpipe bench`` command (``python -m zbpipe.bench``, ``zbpipe.bench.run(...)``).

    rows = zbpipe.bench.run(pp=4, microbatches=8, schedules=["1f1b", "zbv"], f=[2.0], i=[2.0], w=[2.0])
"""

from .config import BenchConfig, BenchError
from .command import main, run

__all__ = ["BenchConfig", "BenchError", "main", "run"]
