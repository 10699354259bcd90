"""The feature comparison cannot go stale: every test it cites exists.

docs/comparison.md and README.md back each amp_plugin claim with a reference written as
``tests/<path>.py::<test_name>``. Each reference must name a file under tests/ that defines
a test function (or method) of that name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "comparison.md", ROOT / "README.md"]
_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def references(text: str) -> list[tuple[str, str]]:
    """The ``(path, test name)`` pairs cited in ``text``, in order."""
    return _REF.findall(text)


def defined_tests(path: Path) -> set[str]:
    """The names of the test functions and methods that ``path`` defines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    }


def test_references_are_parsed_from_code_spans_and_links() -> None:
    text = "a `tests/unit/scaler/test_scaler.py::test_x` and [b](tests/integration/test_ddp.py::test_y)"
    assert references(text) == [
        ("tests/unit/scaler/test_scaler.py", "test_x"), ("tests/integration/test_ddp.py", "test_y"),
    ]  # fmt: skip


def test_a_missing_test_is_noticed() -> None:
    scaler_tests = defined_tests(ROOT / "tests/unit/scaler/test_scaler.py")
    assert "test_bit_identical_to_torch_grad_scaler" in scaler_tests
    assert "test_no_such_test" not in scaler_tests


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cited_test_exists(page: Path) -> None:
    cited = references(page.read_text())
    assert len(cited) >= 10, f"{page.name} cites only {len(cited)} tests; the comparison table is gone?"
    missing = []
    for path, name in cited:
        file = ROOT / path
        if not file.is_file() or name not in defined_tests(file):
            missing.append(f"{path}::{name}")
    assert not missing, f"{page.name} cites tests that do not exist: {missing}"


def _table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| |")
    ]


def test_the_comparison_table_keeps_its_evidence_below_it() -> None:
    """Test ids in a 7-column table wrap one character per line: each row's tests go in a list below."""
    text = (ROOT / "docs" / "comparison.md").read_text()
    rows = _table_rows(text)
    assert len(rows) >= 10
    assert not [row[0] for row in rows if references(" ".join(row))], "test ids in the table's cells"
    evidence = text.partition("## The tests behind each row")[2].partition("\n## ")[0]
    listed = re.findall(r"^- \*\*(.+?)\*\*$", evidence, re.M)
    assert listed == [row[0] for row in rows]  # one entry per row, in the table's order
    assert len(references(evidence)) >= len(rows)
