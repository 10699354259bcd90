"""``amp_plugin._validation``: one message template, true as read, at every raise site.

"``X`` is not allowed here: <why>. Allowed: <what is>. HINT: <the fix>", where ``X`` names a public
call. The AST walk covers every ``fail(...)`` in the package; the representative calls check what a
user actually reads, including calls whose message is built in a lower layer.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amp_plugin
from amp_plugin import AMPPrecision, LossScaler
from amp_plugin._validation import check_bool, check_int, check_number, check_tensor_scalar, fail

PACKAGE = Path(amp_plugin.__file__).parent
TEMPLATE = re.compile(
    r"^(?P<call>[A-Za-z_][\w.]*)(\(.*?\))?\(.*\) is not allowed here: (?P<why>.+?)\. Allowed: .+\. HINT: .+",
    re.S,
)
# Internal helpers a message must never name: the user did not call them.
INTERNAL = ("resolve_settings", "check_arguments", "check_config", "_check", "checked_state")


def _fail_calls() -> list[tuple[Path, ast.Call, str]]:
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fail":
                calls.append((path, node, source))
    return calls


def _public_names() -> set[str]:
    names = set(amp_plugin.__all__)
    for module in pkgutil.walk_packages(amp_plugin.__path__, "amp_plugin."):
        if any(part.startswith("_") for part in module.name.split(".")):
            continue
        names.update(getattr(importlib.import_module(module.name), "__all__", ()))
    return names


def _keyword(node: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def test_the_walk_finds_the_raise_sites() -> None:
    assert len(_fail_calls()) > 100  # every module's validation goes through fail()


@pytest.mark.parametrize(("path", "node", "source"), _fail_calls(), ids=lambda v: "")
def test_every_raise_site_says_why_unless_it_is_a_type_error(path: Path, node: ast.Call, source: str) -> None:
    error = _keyword(node, "error")
    is_type_error = error is not None and ast.get_source_segment(source, error) == "TypeError"
    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
    assert is_type_error or _keyword(node, "why") is not None, f"{where}: fail(...) without why="
    assert {"passed", "allowed", "hint"} <= {k.arg for k in node.keywords}, where


# Private helpers whose checks guard the package's own calls: no user value reaches them unchecked.
INTERNAL_CALLS = {"ShardAwareKernels", "global_norm", "all_reduce_max_"}


def test_every_literal_call_name_is_public() -> None:
    public, wrong = _public_names() | INTERNAL_CALLS, []
    for path, node, _ in _fail_calls():
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            head = re.split(r"[(. ]", node.args[0].value)[0]
            if head not in public:
                wrong.append(f"{path.name}:{node.lineno} {node.args[0].value!r}")
    assert not wrong, wrong


def test_no_message_uses_the_old_template() -> None:
    # "X is not allowed here: .*<requirement>" read as if the requirement were forbidden.
    stale = [
        f"{path.name}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "is not allowed:" in node.value
    ]
    assert not stale, stale


def test_fail_reads_as_one_sentence_per_part() -> None:
    with pytest.raises(ValueError, match=r"^LossScaler") as err:
        fail("LossScaler", passed="min_scale=8.0, max_scale=1.0", why="min_scale is above max_scale",
             allowed="min_scale <= max_scale", hint="swap the two bounds.")  # fmt: skip
    assert str(err.value) == (
        "LossScaler(min_scale=8.0, max_scale=1.0) is not allowed here: min_scale is above max_scale. "
        "Allowed: min_scale <= max_scale. HINT: swap the two bounds."
    )
    with pytest.raises(TypeError, match=r"^f\(x=1\) is not allowed here: wrong type\. Allowed: a str\."):
        fail("f", passed="x=1", allowed="a str", hint="pass one.", error=TypeError)


@pytest.mark.parametrize(
    ("check", "error", "why"),
    [
        (lambda: check_bool("f", "flag", "False"), TypeError, "it is a str, not a bool"),
        (lambda: check_number("f", "x", "1"), TypeError, "it is a str, not a number"),
        (lambda: check_number("f", "x", float("nan")), ValueError, "it is not finite"),
        (lambda: check_number("f", "x", -1.0, low=0.0), ValueError, "it is out of range"),
        (lambda: check_int("f", "n", 1.5), TypeError, "it is a float, not an int"),
        (lambda: check_int("f", "n", 0, low=1), ValueError, "it is below 1"),
        (lambda: check_tensor_scalar("f", "t", torch.ones(2)), ValueError, "it has 2 elements"),
        (
            lambda: check_tensor_scalar("f", "t", torch.ones(1, requires_grad=True)),
            ValueError,
            "it requires grad",
        ),
    ],
)
def test_the_checks_say_why(check: Callable[[], Any], error: type[Exception], why: str) -> None:
    with pytest.raises(error) as err:
        check()
    match = TEMPLATE.match(str(err.value))
    assert match is not None and match["why"] == why, str(err.value)


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# (what the user calls, the public name the message must start with, words the "why" must hold)
REPRESENTATIVE: list[tuple[str, Callable[[], Any], str, str]] = [
    ("bounds", lambda: LossScaler(min_scale=1e4, max_scale=10), "LossScaler", "min_scale is above max_scale"),
    ("growth", lambda: LossScaler(growth_factor=1.0), "LossScaler", "grow"),
    ("enabled", lambda: LossScaler(enabled="False"), "LossScaler", "not a bool"),
    ("backoff", lambda: LossScaler(backoff_factor=2.0), "LossScaler", "shrink"),
    ("load", lambda: LossScaler("cpu").load_state_dict({"scale": 1.0}), "LossScaler.load_state_dict",
     "state"),
    ("precision", lambda: AMPPrecision("16"), "AMPPrecision", "no such precision"),
    ("device", lambda: AMPPrecision("bf16-mixed", device="gpu"), "AMPPrecision", "no such device type"),
    ("scaler", lambda: AMPPrecision("bf16-mixed", scaler=LossScaler()), "AMPPrecision",
     "does not use a loss scaler"),
    ("opt level", lambda: AMPPrecision.from_opt_level("O1", master_weights=True),
     "AMPPrecision.from_opt_level", "cast to half"),
    ("fp8", lambda: AMPPrecision("16-mixed", fp8="tensorwise"), "AMPPrecision", "bf16 autocast"),
    ("kernels", lambda: amp_plugin.get_kernels("triton"), "get_kernels", "no such kernel backend"),
    ("clip", lambda: LossScaler("cpu").clip_grad_norm_(torch.optim.SGD(nn.Linear(1, 1).parameters()), 1, -1),
     "LossScaler.clip_grad_norm_", "order"),
]  # fmt: skip


@pytest.mark.parametrize(("_", "call", "name", "why"), REPRESENTATIVE, ids=[r[0] for r in REPRESENTATIVE])
def test_representative_calls_read_true(_: str, call: Callable[[], Any], name: str, why: str) -> None:
    with pytest.raises((ValueError, TypeError, RuntimeError)) as err:
        call()
    text = str(err.value)
    match = TEMPLATE.match(text)
    assert match is not None, text
    assert match["call"] == name and why in match["why"], text
    assert not any(word in text for word in INTERNAL), text


def test_a_precision_the_device_cannot_run_names_amp_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    # It named the internal resolve_precision(precision=..., device_type=...) before.
    _no_cuda(monkeypatch)
    with pytest.raises(ValueError, match="CUDA") as err:
        AMPPrecision("16-mixed", device="cuda")
    text = str(err.value)
    assert text.startswith(
        "AMPPrecision(precision='16-mixed', device='cuda') is not allowed here: CUDA is not available."
    )
    assert "resolve_precision" not in text


def test_fp8_without_torchao_says_so_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the default precision was refused first, and torchao's absence came only after that fix.
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ImportError, match=r"fp8='tensorwise'\) needs torchao.*HINT: pip install"):
        AMPPrecision(fp8="tensorwise")
