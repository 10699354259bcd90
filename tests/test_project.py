"""The project's own promises: the README's commands are the ones CI runs; the package's shape."""

from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    torch_first = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0"
    assert all(c.startswith(torch_first) for c in commands)
    assert commands[0].endswith("examples/quickstart.py")


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_lines


def test_readme_test_command_runs_the_tests_at_default_threads_and_at_one() -> None:
    steps = [step.strip() for step in _readme_commands()[1].split("&&")]
    pytest_runs = [step for step in steps if "pytest" in step]
    # A result that holds at only one thread count (an accuracy bound, a test that pins threads
    # and leaks the pin into the next) fails one of the two runs. The one-thread run leaves out the
    # tests marked slow (subprocess runs of examples and benchmarks, which pin their own threads, and
    # multi-process or many-step fits) so that the whole command stays within CI's 15 minutes.
    assert pytest_runs == [
        ".venv/bin/python -m pytest -q",
        'OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m "not slow"',
    ]
    assert steps[-2:] == pytest_runs  # after the set-up, ruff and mypy, so all of them gate it


def test_changelog_follows_keep_a_changelog() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and "### Added" in text
    for release in re.split(r"^## ", text, flags=re.M)[1:]:
        headings = re.findall(r"^### (.+)$", release, re.M)
        repeated = sorted({h for h in headings if headings.count(h) > 1})
        assert not repeated, f"release {release.splitlines()[0]!r} has more than one ### {repeated}"


def test_examples_readme_lists_every_example() -> None:
    rows = re.findall(r"^\| `(\w+\.py)` \|", (ROOT / "examples" / "README.md").read_text(), re.M)
    assert sorted(rows) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_every_markdown_file_named_in_the_project_exists() -> None:
    """A reader who follows a pointer to a guide or a notes file finds it in the repository."""
    tracked = [*ROOT.glob("*.md"), *ROOT.glob("*.toml")]
    for folder in ("amp_plugin", "tests", "docs", "examples", "benchmarks"):
        tracked += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md"}]
    missing = []
    for path in tracked:
        for name in re.findall(r"[\w./-]*\b[A-Za-z_]\w*\.md\b", path.read_text()):
            bare = name.lstrip("./")
            bases = (path.parent, ROOT, ROOT / "docs")
            if not any((base / bare).exists() or (base / name).exists() for base in bases):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


# -- the package's shape -----------------------------------------------------------------------

PACKAGE = ROOT / "amp_plugin"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The import graph and its layers: tests/test_layering.py.


def _public_objects() -> list[tuple[str, str, object]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if any(part.startswith("_") for part in name.split(".")) or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                found.append((name, attr, obj))  # its public path (a private module may define it)
    return found


def test_every_public_function_and_class_has_a_runnable_example() -> None:
    objects = _public_objects()
    assert len(objects) > 40  # the walk found the package's public names
    missing = [f"{m}.{a}" for m, a, obj in objects if ">>>" not in (inspect.getdoc(obj) or "")]
    assert not missing, f"public names without a >>> example in their docstring: {missing}"


def test_xdist_workers_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import conftest

    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        conftest._share_the_cores()
        assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == (4, "4")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        torch.set_num_threads(threads)
        conftest._share_the_cores()
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)
