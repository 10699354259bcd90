"""The guides' code runs: every ```python block in README.md and docs/*.md is executed.

A block written as a ``>>>`` session runs as a doctest, so its shown output is checked too.
A ``$ python -m amp_plugin ...`` transcript (a usage error, the same on every machine) is
checked against what the command prints.
A block that cannot run here (it needs a GPU, several processes, a user's own model or
data) is preceded by ``<!-- no-run: why -->``; the reason is required. Blocks of one page
run in order in one namespace, so a page can build on the objects its earlier blocks made (a
model, a scaler), as a reader would. A session sees the names of the blocks before it, but
what it defines stays in it (doctest runs it on a copy of the namespace).

Every block, no-run ones included, imports the modules and classes it uses itself (torch,
Lightning, amp_plugin, the standard library, and whatever an earlier block of the page imported),
so a block copied alone into a new file needs no import from another block. A block may use the
objects an earlier block made only on a page that says, before it, that its blocks build on each
other.
"""

from __future__ import annotations

import ast
import builtins
import doctest
import os
import re
from pathlib import Path

import pytest

from tests._torch_features import DYNAMO_AUTOCAST_REASON, DYNAMO_TRACES_AUTOCAST_SWITCHES

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!--\s*no-run:(?P<why>[^>]*)-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks(page: Path) -> list[tuple[int, str, str | None]]:
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("why"))
        for m in _BLOCK.finditer(text)
    ]


def test_every_skipped_block_says_why() -> None:
    for page in PAGES:
        for line, _, why in _blocks(page):
            assert why is None or why.strip(), f"{page.name}:{line}: no-run needs a reason"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a temporary folder
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    compiles = any(why is None and "torch.compile(" in code for _, code, why in _blocks(page))
    if compiles and not DYNAMO_TRACES_AUTOCAST_SWITCHES:  # its compiled code uses fp32 modules or functions
        pytest.skip(f"{page.name} compiles: {DYNAMO_AUTOCAST_REASON}")
    for line, code, why in _blocks(page):
        if why is not None:
            continue
        if code.lstrip().startswith(">>>"):
            _run_doctest(code, namespace, f"{page.name}:{line}")
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{page.name}, the block at line {line} failed: {err!r}") from err


def _library_names() -> set[str]:
    import sys

    import lightning.pytorch
    import lightning.pytorch.callbacks
    import lightning.pytorch.loggers
    import lightning.pytorch.strategies
    import torch

    import amp_plugin

    names = {"torch", "nn", "F", "np", "amp", "apex", "lightning", "amp_plugin", *sys.stdlib_module_names}
    modules = (
        amp_plugin,
        lightning.pytorch,
        lightning.pytorch.callbacks,
        lightning.pytorch.loggers,
        lightning.pytorch.strategies,
        torch.nn,
    )
    for module in modules:
        names.update(n for n in {*dir(module), *getattr(module, "__all__", ())} if n[:1].isupper())
    return names


def _names(code: str) -> tuple[set[str], set[str], set[str]]:
    """What a block reads but does not bind itself (builtins aside), what it imports, what else it binds."""
    if code.lstrip().startswith(">>>"):
        code = "\n".join(example.source for example in doctest.DocTestParser().get_examples(code))
    try:
        tree = ast.parse(code)
    except SyntaxError:  # an excerpt with `...` for arguments
        return set(), set(), set()
    imported: set[str] = set()
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - imported - defined - set(dir(builtins)), imported, defined


_BUILDS_ON = "build on each other"


def _block_problems(page: Path, library: set[str]) -> list[str]:
    """A block must import every module and class it uses itself, wherever an earlier block imported it;
    it may use objects an earlier block made (a model, a scaler) when the page says its blocks build
    on each other, before that block."""
    text, problems = page.read_text(), []
    imported_before: set[str] = set()
    made_before: set[str] = set()
    for line, code, why in _blocks(page):
        free, imported, defined = _names(code)
        if why is None or "excerpt" not in why:  # an excerpt is a few lines of torch's or a script's code
            if names := sorted(free & (library | imported_before)):
                problems.append(f"{page.name}:{line}: uses {', '.join(names)} without importing it")
            reused = sorted(free & made_before - library - imported_before)
            said = text.find(_BUILDS_ON)
            if reused and not 0 <= said < text.index(code):
                problems.append(
                    f"{page.name}:{line}: uses {', '.join(reused)} from an earlier block, and the page does "
                    f"not say (before it) that its blocks {_BUILDS_ON}"
                )
        imported_before |= imported
        if not code.lstrip().startswith(">>>"):  # what a session defines stays in it
            made_before |= defined
    return problems


def test_every_block_imports_the_names_it_uses() -> None:
    """Copied alone into a new file, a block needs no import from another block; a page whose blocks
    reuse each other's objects says so."""
    library = _library_names()
    problems = [problem for page in PAGES for problem in _block_problems(page, library)]
    assert not problems, "\n".join(problems)


# A transcript: a ``` block whose first line is a `$ python -m amp_plugin ...` command.
_TRANSCRIPT = re.compile(r"```\n\$ python -m amp_plugin (?P<args>[^\n]*)\n(?P<shown>.*?)```", re.S)


def test_transcripts_show_what_the_command_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transcript that does not depend on the machine (a usage error) shows the command's real output."""
    from amp_plugin.cli import main

    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps its usage line to the terminal's width
    checked = 0
    for page in PAGES:
        for match in _TRANSCRIPT.finditer(page.read_text()):
            assert main(match["args"].split()) == 2, f"{page.name}: `{match['args']}` is no usage error"
            captured = capsys.readouterr()
            assert captured.out + captured.err == match["shown"], f"{page.name}: `{match['args']}` prints"
            checked += 1
    assert checked, "no transcript found: the pattern above no longer matches the guides"


def _run_doctest(code: str, namespace: dict[str, object], where: str) -> None:
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    test = doctest.DocTestParser().get_doctest(code, namespace, where, where, 0)
    runner = doctest.DocTestRunner(optionflags=flags)
    report: list[str] = []
    runner.run(test, out=report.append, clear_globs=False)
    assert runner.failures == 0, f"{where}: the session's output differs:\n" + "".join(report)
