"""Run a benchmark script with module attributes of flce set, for A/B runs of a setting in one lease:

    PYTHONPATH=src:benchmark python benchmark/probes/with_setting.py \\
        'flce.kernels.logits_triton.MIN_ROWS=16' -- benchmark/bench.py --shapes 64x4096x128256 ...

Each ``module.attr=expr`` before ``--`` sets ``attr`` of the imported ``module`` to ``eval(expr)``
(``'flce.function._thin_dtypes=lambda device: ()'`` turns the thin grad_weight kernel off). A setting the code
reads at import time into another module is not reached; these are read at each call.
"""
from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path


def apply_setting(setting: str, prefix: str = "") -> None:
    """``module.attr=expr``: sets ``attr`` of the imported module ``prefix + module`` to ``eval(expr)``."""
    target, expr = setting.split("=", 1)
    module, attr = target.rsplit(".", 1)
    setattr(importlib.import_module(prefix + module), attr, eval(expr))  # noqa: S307 - a developer's own command line


def main() -> None:
    split = sys.argv.index("--")
    for setting in sys.argv[1:split]:
        apply_setting(setting)
    sys.argv = sys.argv[split + 1:]
    sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
