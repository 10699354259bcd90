"""The test harness's own promises (tests/conftest.py), checked in a pytest run of their own.

A GPU machine's xdist worker initialises CUDA in its first CUDA test; Lightning then refuses to
fork ranks, so a ``forks`` test reruns whole in a fresh interpreter. A test that leaves a default
process group behind (Lightning's FSDP on one GPU does) fails, and the next one starts without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each test runs pytest in a subprocess: the one-thread pass of the test command leaves them out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

# Stands in for a process that has initialised CUDA: only the pytest process that loads it. It fakes
# the harness's question, not torch.cuda.is_initialized: on a GPU machine a faked "initialised" makes
# torch skip its lazy init, and the harness's CUDA RNG save then finds no generators.
_CUDA_INITIALISED = "import tests.conftest\ntests.conftest.fork_unsafe = lambda: True\n"


def _pytest(tmp_path: Path, body: str, *plugins: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a test file in ``tmp_path`` with this suite's conftest loaded as a plugin."""
    (tmp_path / "test_body.py").write_text("import pytest\nimport torch\n\n" + body)
    (tmp_path / "cuda_initialised.py").write_text(_CUDA_INITIALISED)
    args = [sys.executable, "-m", "pytest", "test_body.py", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    for plugin in ("tests.conftest", *plugins):
        args += ["-p", plugin]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


def test_a_forks_test_reruns_in_a_fresh_interpreter_once_cuda_is_initialised(tmp_path: Path) -> None:
    body = (
        "@pytest.mark.forks\ndef test_in_a_fresh_interpreter():\n"
        "    import sys\n    assert 'cuda_initialised' not in sys.modules\n\n"
        "@pytest.mark.forks\ndef test_fails_there_too():\n    assert False, 'failed in the child'\n"
    )
    run = _pytest(tmp_path, body, "cuda_initialised")
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert "rerun in a fresh interpreter (CUDA is initialised in this one)" in run.stdout
    assert "failed in the child" in run.stdout
    plain = _pytest(tmp_path, body)  # CUDA not initialised: both run here, where the fake is not loaded
    assert "1 failed, 1 passed" in plain.stdout and "fresh interpreter" not in plain.stdout, plain.stdout


def test_a_leaked_process_group_fails_its_test_and_is_destroyed(tmp_path: Path) -> None:
    body = (
        "import torch.distributed as dist\n\n"
        "def test_leaks(tmp_path):\n"
        "    store = f'file://{tmp_path}/store'\n"
        "    dist.init_process_group('gloo', init_method=store, rank=0, world_size=1)\n\n"
        "def test_next_starts_clean():\n    assert not dist.is_initialized()\n"
    )
    run = _pytest(tmp_path, body)
    assert "torch.distributed.is_initialized() was False, the test left it True" in run.stdout, run.stdout
    assert "2 passed, 1 error" in run.stdout, run.stdout
