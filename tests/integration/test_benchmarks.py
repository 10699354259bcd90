"""Every benchmark runs end to end in a smoke configuration, prints its table and writes its JSON.

The numbers of a smoke run mean nothing (tiny sizes, a busy machine); what is checked is that
each script still runs against the current package and reports in its documented format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SMOKE_ARGS = {
    "step_overhead.py": ["--quick", "--repeats", "2"],
    "training_speed.py": ["--quick", "--models", "tiny", "tiny-hooks", "--rounds", "1", "--tiny-steps", "10"],
    "monitor_overhead.py": ["--quick"],
    "ddp_overhead.py": ["--quick"],
    "fsdp_overhead.py": ["--quick"],
    "memory.py": ["--quick", "--repeats", "1", "--steps", "1"],
    "numerics_speed.py": ["--quick"],
    "fp32_functions.py": ["--quick"],
    "compile_speed.py": ["--quick", "--setups", "bf16", "fp16"],
    "fabric_speed.py": ["--quick", "--models", "tiny", "--rounds", "1", "--steps", "2"],
}


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE_ARGS)


def test_every_benchmark_has_a_readme_section_and_takes_quick() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    for script in SMOKE_ARGS:
        assert f"## `{script}`" in readme, f"benchmarks/README.md has no section for {script}"
        assert "--quick" in SMOKE_ARGS[script]


@pytest.mark.parametrize("script", sorted(SMOKE_ARGS))
def test_benchmark_smoke_run(script: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *SMOKE_ARGS[script], "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{output[-3000:]}"
    assert any(set(line.strip()) <= {"-", " "} and "--" in line for line in output.splitlines()), output
    result = json.loads(out.read_text())
    assert result["environment"]["torch"]
    assert Path(script).stem in str(result.get("benchmark", script))
