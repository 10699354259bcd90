"""No test assumes that CUDA is absent: every ``Trainer``/``Fabric`` the suite runs names its accelerator.

Lightning's default, ``accelerator="auto"``, takes a GPU where there is one: a Trainer built without
``accelerator=`` trains on CUDA on a GPU machine (and ``devices=2`` fails there with one GPU),
so a test written and passed on a CPU fails on a GPU. Read from the source (AST), so it holds
on any machine:

- ``tests/``, ``examples/``, ``benchmarks/``: every call passes ``accelerator=`` by keyword.
- The docs' code blocks that ``tests/test_docs.py`` runs: a call passes ``accelerator=``, or unpacks
  a ``**name`` that the page binds to a dict with an ``"accelerator"`` key; or the Trainer is only
  built, never run (a snippet that shows the arguments, or one that shows Lightning's error),
  which is the same on every machine. The no-run blocks are the reader's code, not the suite's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.test_docs import PAGES, _blocks

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("Trainer", "Fabric")
RUNS = ("fit", "validate", "test", "predict", "launch", "setup", "run")


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    """``Trainer(...)``/``Fabric(...)`` calls, by bare or dotted name (``L.Trainer(...)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in CLASSES:
                yield node


def _pins(call: ast.Call, pinning_dicts: frozenset[str] | set[str] = frozenset()) -> bool:
    """``accelerator=`` by keyword, or ``**name`` of a dict that has it."""
    return any(
        k.arg == "accelerator"
        or (k.arg is None and isinstance(k.value, ast.Name) and k.value.id in pinning_dicts)
        for k in call.keywords
    )


def _pinning_dicts(tree: ast.AST) -> set[str]:
    """Names bound to ``dict(accelerator=...)`` or ``{"accelerator": ...}``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            keys = (
                {k.arg for k in value.keywords}
                if isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "dict"
                else {k.value for k in value.keys if isinstance(k, ast.Constant)}
                if isinstance(value, ast.Dict)
                else set()
            )
            if "accelerator" in keys:
                names.add(node.targets[0].id)
    return names


def _runs(statement: ast.stmt, name: str) -> bool:
    """``statement`` calls ``name.fit(...)``, ``name.launch(...)``, ...: the Trainer or Fabric runs."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in RUNS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == name
        for node in ast.walk(statement)
    )


def _binds(statement: ast.stmt, name: str) -> bool:
    return isinstance(statement, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in statement.targets
    )


def _only_built(call: ast.Call, statements: list[ast.stmt], index: int) -> bool:
    """The call is a statement of its own (built for its error), or bound to a name that does not run
    before the name is bound again (``statements[index]`` holds the call)."""
    for node in ast.walk(statements[index]):
        if isinstance(node, ast.Expr) and node.value is call:
            return True
        if isinstance(node, ast.Assign) and node.value is call:
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if len(names) != len(node.targets):
                return False
            for name in names:
                for later in statements[index + 1 :]:
                    if _runs(later, name):
                        return False
                    if _binds(later, name):
                        break
            return True
    return False


def _source(code: str) -> str:
    """A block's Python: a ``>>>`` session without its prompts and its shown output."""
    if not code.lstrip().startswith(">>>"):
        return code
    return "\n".join(line[4:] for line in code.splitlines() if line.startswith((">>> ", "... ")))


def test_every_trainer_and_fabric_in_the_code_names_its_accelerator() -> None:
    files = [
        p for folder in ("tests", "examples", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))
    ]
    assert len(files) > 50
    unpinned = [
        f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call)[:100]}"
        for path in files
        for call in _calls(ast.parse(path.read_text()))
        if not _pins(call)
    ]
    assert not unpinned, "HINT: pass accelerator='cpu' (or the device fixture's value):\n" + "\n".join(
        unpinned
    )


def test_every_trainer_and_fabric_the_docs_run_names_its_accelerator() -> None:
    unpinned, seen = [], 0
    for page in PAGES:
        # A page's blocks run in order in one namespace: one list of statements, each with its line.
        statements = [
            (line, statement)
            for line, code, why in _blocks(page)
            if why is None
            for statement in ast.parse(_source(code)).body
        ]
        body = [statement for _, statement in statements]
        pinning = _pinning_dicts(ast.Module(body=body, type_ignores=[]))
        for index, (line, statement) in enumerate(statements):
            for call in _calls(statement):
                seen += 1
                if not (_pins(call, pinning) or _only_built(call, body, index)):
                    unpinned.append(f"{page.name}:{line + call.lineno - 1}: {ast.unparse(call)[:100]}")
    assert seen > 5
    assert not unpinned, "HINT: pass accelerator='cpu' to a Trainer the page runs:\n" + "\n".join(unpinned)


def test_the_check_finds_an_unpinned_trainer() -> None:
    """The checks can fail: only the Trainer that runs without an accelerator is reported."""
    tree = ast.parse(
        "quiet = dict(accelerator='cpu')\n"
        "a = Trainer(max_steps=1)\na.fit(m)\n"  # line 2: runs on whatever "auto" finds
        "b = L.Trainer(accelerator='cpu')\nb.fit(m)\n"
        "c = Fabric(**quiet)\nc.launch(f)\n"
        "d = Trainer(plugins=[p])\n"  # built, never run
        "Trainer(precision='16-mixed', plugins=[p])\n"  # built for its error
        "d = Trainer(accelerator='cpu')\nd.fit(m)\n"  # d was bound again, pinned, before it ran
    )
    body, pinning = tree.body, _pinning_dicts(tree)
    verdicts = {
        call.lineno: _pins(call, pinning) or _only_built(call, body, index)
        for index, statement in enumerate(body)
        for call in _calls(statement)
    }
    assert verdicts == {2: False, 4: True, 6: True, 8: True, 9: True, 10: True}


def test_every_fully_shard_in_the_code_names_its_mesh() -> None:
    """``fully_shard`` without ``mesh=`` shards over torch's accelerator: CUDA where there is one.

    The gloo processes of the tests and benchmarks then put their shards on one GPU, where gloo
    cannot reduce-scatter them; a CPU mesh (``init_device_mesh("cpu", (world,))``) says what they mean.
    """
    folders = ("tests", "examples", "benchmarks")
    files = [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    calls = [
        (path, node)
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", "")) == "fully_shard"
    ]
    assert len(calls) > 5
    unpinned = [f"{path.relative_to(ROOT)}:{call.lineno}" for path, call in calls if not _names_mesh(call)]
    assert not unpinned, "HINT: pass mesh=init_device_mesh('cpu', (world,)):\n" + "\n".join(unpinned)


def _names_mesh(call: ast.Call) -> bool:
    return len(call.args) > 1 or any(k.arg in ("mesh", None) for k in call.keywords)
