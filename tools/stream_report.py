"""pytest plugin for a GPU run (``tools/gpu_suite.sh``): outcomes and tracebacks to ``$OUT`` at once.

A run killed at its time limit prints no summary; these files still say what passed and what
failed, and why. Loaded with ``-p stream_report`` and ``tools`` on ``PYTHONPATH``; with xdist only
the controller writes.
"""

from __future__ import annotations

import os
from typing import Any

_OUT = os.environ.get("OUT", "/tmp/out")
_TAG = os.environ.get("STREAM_TAG", "suite")


def pytest_runtest_logreport(report: Any) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or report.outcome != "passed":
        with open(f"{_OUT}/{_TAG}-done.txt", "a") as f:
            f.write(f"{report.outcome} {report.when} {report.duration:.1f}s {report.nodeid}\n")
    if report.outcome == "failed":
        with open(f"{_OUT}/{_TAG}-fail.txt", "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
