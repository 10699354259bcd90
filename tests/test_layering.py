"""DESIGN's import rules, checked on the package's source: nothing imports upward or in a circle.

Every import counts: at module level, inside functions, under ``TYPE_CHECKING`` and as an
``importlib.import_module("...")`` string. The checks are functions over a ``{module: imports}``
graph, tested on small graphs with a planted cycle and a planted upward edge, then run on
amp_plugin itself. Last, DESIGN's "one public path per name": a module's ``__all__`` lists only
what the module defines.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "amp_plugin"


def _in_package(names: str) -> frozenset[str]:
    return frozenset(f"amp_plugin.{name}" for name in names.split())


# DESIGN's layers, bottom first. A module may import its own layer or one below it;
# "x.*" places every submodule of x.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("bottom", _in_package("_validation _imports")),
    ("kernels", _in_package("kernels kernels.*")),
    (
        "core",
        _in_package(
            "_optim _fit_start _metrics _scaler _scaler_rules _iteration _scale_policy _clipping _sharding "
            "_distributed consistency precision autocast fp32_policy numerics master_weights rounded_updates "
            "_half_weights _schedulers grad_accumulation fp8 spike diagnostics diagnostics.*"
        ),
    ),
    ("step", _in_package("_step")),
    ("run", _in_package("_run")),
    ("adapters", _in_package("lightning lightning.* accelerate")),
    # The package's own __init__ re-exports from the layers below (its Lightning names on first use),
    # so only the command line sits above it.
    ("package", frozenset({"amp_plugin"})),
    ("top", _in_package("cli __main__")),
)

# Third-party packages only the adapters may import, and the optional dependencies a
# function-level import may load (DESIGN: "a function-level import is only for an optional dependency").
FRAMEWORKS = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "accelerate"})
OPTIONAL = FRAMEWORKS | {"apex", "amp_C", "torchao", "matplotlib"}

# Edges that break a rule, each named with the fix it needs (none today). The test fails when an
# entry is no longer in the graph, so the list only shrinks.
ALLOWED_FUNCTION_LEVEL: frozenset[tuple[str, str]] = frozenset()
# Names a module's __all__ lists but another module defines: (module, name).
ALLOWED_REEXPORTS: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Import:
    """One import in a module: its absolute target and where it sits.

    ``from a import b`` names ``a.b`` with ``parent`` ``a``: the module ``a.b`` if there is one, else a
    name in ``a``.
    """

    target: str
    in_function: bool
    parent: str | None = None

    def module(self, modules: Collection[str]) -> str:
        return self.target if self.target in modules or self.parent is None else self.parent


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``; ``KeyError`` for a module DESIGN does not place."""
    for index, (_, members) in enumerate(LAYERS):
        parent = module.rpartition(".")[0]
        if module in members or f"{parent}.*" in members:
            return index
    raise KeyError(f"{module} has no layer: place it in LAYERS (tests/test_layering.py) as DESIGN does")


def imports_in(source: str, module: str, is_package: bool = False) -> Iterator[Import]:
    """Every import in ``source`` (the code of ``module``), wherever it sits, as absolute names.

    ``importlib.import_module`` and ``__import__`` calls count when their argument is a string literal.
    """

    def walk(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                yield from (Import(alias.name, inside) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".")[: len(module.split(".")) - child.level + is_package]
                    base = ".".join([*package, *([child.module] if child.module else [])])
                yield from (Import(f"{base}.{alias.name}", inside, base) for alias in child.names)
            elif isinstance(child, ast.Call) and _is_import_module(child.func):
                first = child.args[0] if child.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    yield Import(first.value, inside)
            yield from walk(child, inside)

    yield from walk(ast.parse(source), False)


def _is_import_module(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for path in sorted((root / "amp_plugin").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def package_imports(root: Path = ROOT) -> dict[str, list[Import]]:
    return {
        name: list(imports_in(path.read_text(), name, path.name == "__init__.py"))
        for name, path in package_modules(root).items()
    }


def internal_graph(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``; a name imported from a module is an edge to it."""
    return {
        name: {i.module(imports) for i in found if i.module(imports) in imports} - {name}
        for name, found in imports.items()
    }


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components (Tarjan), each a set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if dep not in index:
                visit(dep)
                low[name] = min(low[name], low[dep])
            elif dep in stack:
                low[name] = min(low[name], index[dep])
        if low[name] == index[name]:
            component = set()
            while not component or component.isdisjoint({name}):
                component.add(stack.pop())
            components.append(component)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle ``[a, b, ..., a]`` per strongly connected component that has one."""
    found = []
    for component in strongly_connected(graph):
        start = min(component)
        if len(component) == 1 and start not in graph.get(start, ()):
            continue
        came_from: dict[str, str] = {}
        frontier, last = [start], None
        while last is None:  # breadth first inside the component: the shortest way back to start
            name = frontier.pop(0)
            for dep in sorted(graph[name] & component):
                if dep == start:
                    last = name
                    break
                if dep not in came_from:
                    came_from[dep] = name
                    frontier.append(dep)
        path = [last]
        while path[-1] != start:
            path.append(came_from[path[-1]])
        path.reverse()
        found.append([*path, start])
    return sorted(found)


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a lower layer to a higher one, as ``"a (layer) -> b (layer)"``."""
    found = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(name):
                found.append(f"{name} ({LAYERS[layer_of(name)][0]}) -> {dep} ({LAYERS[layer_of(dep)][0]})")
    return found


def layering_problems(graph: dict[str, set[str]]) -> list[str]:
    """What breaks DESIGN's rules in ``graph``: every cycle (one per tangle), and every upward edge."""
    return [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)] + upward_edges(graph)


# -- the checks, on graphs with the problem planted ---------------------------------------------


def test_a_layered_graph_passes() -> None:
    graph = {
        "amp_plugin.cli": {"amp_plugin", "amp_plugin._scaler"},
        "amp_plugin": {"amp_plugin._scaler", "amp_plugin.lightning"},
        "amp_plugin.lightning": {"amp_plugin._step", "amp_plugin._scaler"},
        "amp_plugin._step": {"amp_plugin._scaler"},
        "amp_plugin._scaler": {"amp_plugin._clipping", "amp_plugin.kernels", "amp_plugin._validation"},
        "amp_plugin._clipping": {"amp_plugin.kernels._foreach"},
        "amp_plugin.kernels": {"amp_plugin.kernels._foreach"},
        "amp_plugin.kernels._foreach": {"amp_plugin._validation"},
        "amp_plugin._validation": set(),
    }
    assert layering_problems(graph) == []


def test_a_planted_cycle_is_caught_within_one_layer() -> None:
    graph = {
        "amp_plugin._scaler": {"amp_plugin._clipping"},
        "amp_plugin._clipping": {"amp_plugin._distributed"},
        "amp_plugin._distributed": {"amp_plugin.consistency"},
        "amp_plugin.consistency": {"amp_plugin._scaler"},
    }
    assert layering_problems(graph) == [
        "import cycle: amp_plugin._clipping -> amp_plugin._distributed -> amp_plugin.consistency"
        " -> amp_plugin._scaler -> amp_plugin._clipping"
    ]


def test_a_planted_upward_import_is_caught() -> None:
    graph = {
        "amp_plugin._scaler": {"amp_plugin._step", "amp_plugin._validation"},
        "amp_plugin._step": {"amp_plugin.lightning._plugin"},
        "amp_plugin.lightning._plugin": {"amp_plugin._validation"},
        "amp_plugin._validation": set(),
    }
    assert layering_problems(graph) == [
        "amp_plugin._scaler (core) -> amp_plugin._step (step)",
        "amp_plugin._step (step) -> amp_plugin.lightning._plugin (adapters)",
    ]


def test_a_cycle_through_layers_is_reported_with_its_upward_edge() -> None:
    graph = {
        "amp_plugin.kernels._base": {"amp_plugin._scaler"},
        "amp_plugin._scaler": {"amp_plugin.kernels._base"},
    }
    assert layering_problems(graph) == [
        "import cycle: amp_plugin._scaler -> amp_plugin.kernels._base -> amp_plugin._scaler",
        "amp_plugin.kernels._base (kernels) -> amp_plugin._scaler (core)",
    ]


def test_a_module_without_a_layer_is_refused() -> None:
    with pytest.raises(KeyError, match=r"amp_plugin\.newthing has no layer"):
        layer_of("amp_plugin.newthing")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import lightning.pytorch as pl", {("lightning.pytorch", False)}),
        ("from amp_plugin._scaler import LossScaler", {("amp_plugin._scaler", False)}),
        ("from amp_plugin import _scaler", {("amp_plugin._scaler", False)}),
        ("from amp_plugin import LossScaler", {("amp_plugin", False)}),
        ("def f():\n    from amp_plugin._scaler import X", {("amp_plugin._scaler", True)}),
        ("class C:\n    def f(self):\n        import accelerate", {("accelerate", True)}),
        ("if TYPE_CHECKING:\n    from amp_plugin._scaler import X", {("amp_plugin._scaler", False)}),
        ("try:\n    import apex\nexcept ImportError:\n    pass", {("apex", False)}),
        ("def f():\n    importlib.import_module('amp_plugin.numerics')", {("amp_plugin.numerics", True)}),
        ("m = import_module('amp_plugin.consistency')", {("amp_plugin.consistency", False)}),
        ("from ._base import Kernels", {("amp_plugin.kernels._base", False)}),
        ("from . import _base", {("amp_plugin.kernels._base", False)}),
    ],
)
def test_every_form_of_import_is_seen(source: str, expected: set[tuple[str, bool]]) -> None:
    modules = {"amp_plugin", "amp_plugin._scaler", "amp_plugin.kernels", "amp_plugin.kernels._base"}
    found = {(i.module(modules), i.in_function) for i in imports_in(source, "amp_plugin.kernels._foreach")}
    assert found == expected


# -- the package itself -----------------------------------------------------------------------


def test_the_walk_sees_the_package() -> None:
    imports = package_imports()
    graph = internal_graph(imports)
    assert "amp_plugin._scaler" in graph["amp_plugin._step"]  # a module-level import
    assert "amp_plugin._scaler" in graph["amp_plugin.consistency"]  # under TYPE_CHECKING
    assert Import("accelerate", in_function=True) in imports["amp_plugin.accelerate"]  # an importlib string
    figure = Import("matplotlib.figure.Figure", in_function=True, parent="matplotlib.figure")
    assert figure in imports["amp_plugin.diagnostics._health_plot"]  # an import inside a function


def test_every_module_has_a_layer() -> None:
    assert [layer_of(name) for name in package_modules()]


def test_no_import_cycles_and_nothing_imports_upward() -> None:
    assert layering_problems(internal_graph(package_imports())) == []


def test_only_the_adapters_import_lightning_and_accelerate() -> None:
    adapters = LAYERS[layer_of("amp_plugin.lightning")][1]
    offenders = sorted(
        f"{name} imports {i.target}"
        for name, found in package_imports().items()
        for i in found
        if i.target.split(".")[0] in FRAMEWORKS and layer_of(name) != layer_of("amp_plugin.lightning")
    )
    assert offenders == []
    assert "amp_plugin.lightning.*" in adapters


def test_function_level_imports_are_for_optional_dependencies_only() -> None:
    """An import inside a function loads an optional dependency, or a module of ours that needs one."""
    imports = package_imports()
    needs_optional = _modules_needing_optional(imports)
    offenders = {
        (name, i.module(imports))
        for name, found in imports.items()
        for i in found
        if i.in_function
        and i.target.split(".")[0] != "importlib"
        and i.target.split(".")[0] not in OPTIONAL
        and i.module(imports) in imports
        and i.module(imports) not in needs_optional
    }
    assert offenders - ALLOWED_FUNCTION_LEVEL == set()
    assert offenders >= ALLOWED_FUNCTION_LEVEL  # a fixed edge leaves the allow-list


def _modules_needing_optional(imports: dict[str, list[Import]]) -> set[str]:
    """Our modules that import an optional dependency at module level, directly or through ours."""
    needing = {
        name
        for name, found in imports.items()
        if any(not i.in_function and i.target.split(".")[0] in OPTIONAL for i in found)
    }
    graph = {n: {i.module(imports) for i in f if not i.in_function} for n, f in imports.items()}
    grew = True
    while grew:
        more = {name for name, deps in graph.items() if deps & needing} - needing
        needing |= more
        grew = bool(more)
    return needing


# -- one public path per name -----------------------------------------------------------------


def reexported_names(source: str, module: str, is_package: bool = False) -> list[str]:
    """Names in ``__all__`` that ``source`` imports instead of defining.

    A package's ``__init__`` may export names of its own submodules (``amp_plugin.LossScaler`` is
    at home in the package); any other module's ``__all__`` lists only what it defines.
    """
    defined: set[str] = set()
    imported: dict[str, str] = {}
    exported: list[str] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in tree.body:
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            defined |= names
            if "__all__" in names and isinstance(node.value, (ast.List, ast.Tuple)):
                exported = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.ImportFrom):
            found = next(iter(imports_in(ast.unparse(node), module, is_package)))
            imported |= {a.asname or a.name: found.parent or "" for a in node.names}
    own = module if is_package else None
    return [
        name
        for name in exported
        if name not in defined and not (own and imported.get(name, "").startswith(f"{own}."))
    ]


def test_a_planted_reexport_is_caught() -> None:
    module = "from amp_plugin._optim import unwrap_optimizer\n__all__ = ['LossScaler', 'unwrap_optimizer']\n"
    module += "class LossScaler: ..."
    assert reexported_names(module, "amp_plugin._scaler") == ["unwrap_optimizer"]
    package = "from amp_plugin._scaler import LossScaler\nfrom torch import nn\n"
    package += "__all__ = ['LossScaler', 'nn']"
    assert reexported_names(package, "amp_plugin", is_package=True) == ["nn"]
    assert reexported_names(package, "amp_plugin.diagnostics", is_package=True) == ["LossScaler", "nn"]


def test_every_name_has_one_public_path() -> None:
    found = {
        (name, export)
        for name, path in package_modules().items()
        for export in reexported_names(path.read_text(), name, path.name == "__init__.py")
    }
    assert found - ALLOWED_REEXPORTS == set()
    assert found >= ALLOWED_REEXPORTS  # a fixed module leaves the allow-list


def private_calls_across_modules(root: Path = ROOT) -> list[str]:
    """``obj._name(...)`` calls where ``_name`` is a function or method of another module of ours.

    A module's private functions and methods are its own: a call from elsewhere ties that module
    to the other's internals (DESIGN: "Nothing calls a private name of another module"). Calls on
    ``self``/``cls``, a tensor's private methods, and private names no module of ours defines
    (torch's, Lightning's: those go through ``lightning/_compat.py``) are not counted.
    """
    defined: dict[str, set[str]] = {}  # private def name -> the modules that define it
    trees = {name: ast.parse(path.read_text()) for name, path in package_modules(root).items()}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                defined.setdefault(node.name, set()).add(name)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if not isinstance(func, ast.Attribute) or not _private(func.attr):
                continue
            if isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
                continue
            owners = defined.get(func.attr, set())
            if hasattr(torch.Tensor, func.attr):  # a tensor's own (grad._values()), whatever we name ours
                continue
            if owners and name not in owners:
                found.append(f"{name} calls {ast.unparse(func)}() of {', '.join(sorted(owners))}")
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_calls_a_private_function_of_another() -> None:
    assert private_calls_across_modules() == []


def test_a_private_call_across_modules_is_found(tmp_path: Path) -> None:
    package = tmp_path / "amp_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("class A:\n    def _inner(self):\n        return self._inner2()\n")
    (package / "b.py").write_text("def run(a):\n    return a._inner()\n")
    assert private_calls_across_modules(tmp_path) == ["amp_plugin.b calls a._inner() of amp_plugin.a"]


def private_imports_across_modules(root: Path = ROOT) -> list[str]:
    """``from amp_plugin.x import _name`` where ``_name`` is a private name, not a private module.

    A private module's helpers that other modules use are named without ``_`` (the module itself
    is private); an underscore name stays inside its module.
    """
    modules = package_modules(root)
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("amp_plugin"):
                continue
            for alias in node.names:
                if _private(alias.name) and f"{node.module}.{alias.name}" not in modules:
                    found.append(f"{name} imports {alias.name} from {node.module}")
    return sorted(found)


def test_no_module_imports_a_private_name_of_another() -> None:
    assert private_imports_across_modules() == []


def test_a_private_import_across_modules_is_found(tmp_path: Path) -> None:
    package = tmp_path / "amp_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text("def _helper():\n    return 1\n")
    (package / "b.py").write_text("from amp_plugin import _a\nfrom amp_plugin._a import _helper\n")
    assert private_imports_across_modules(tmp_path) == ["amp_plugin.b imports _helper from amp_plugin._a"]
