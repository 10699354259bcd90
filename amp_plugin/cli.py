"""Command line: ``python -m amp_plugin doctor [--model pkg.module:factory] [--json] [--no-measure] [--ops]``.

``doctor --fp8 [RECIPE] [--model pkg.module:factory]`` reports fp8 instead (see
:func:`amp_plugin.diagnostics.fp8_report`).

Also installed as the ``amp-plugin`` console script; ``--version`` prints the version. Exit
status: 0 when all is well, 1 when the model audit has errors, 2 for a usage error (bad
arguments, a model that cannot be loaded).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from amp_plugin import __version__
from amp_plugin._validation import fail
from amp_plugin.diagnostics import (
    audit_model,
    device_report,
    format_autocast_ops,
    format_device_report,
    probe_autocast_ops,
)
from amp_plugin.diagnostics._audit import AuditReport
from amp_plugin.diagnostics._autocast_ops import AutocastOps
from amp_plugin.diagnostics._fp8_report import format_fp8_report, fp8_hardware, fp8_report
from amp_plugin.fp8 import RECIPES

__all__ = ["load_model", "main"]

_SPEC_FIX = "pass the module path and the factory name, e.g. --model mypackage.models:build_model"
_SPEC_HELP = f"HINT: {_SPEC_FIX}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return the exit status; ``argv`` defaults to ``sys.argv[1:]``.

    Raises:
        TypeError: ``argv`` is neither ``None`` nor a list (or tuple) of strings.

    Example:
        >>> main(["doctor", "--no-measure"])  # doctest: +ELLIPSIS
        amp_plugin doctor
        ...
        0
    """
    if argv is not None and not (isinstance(argv, (list, tuple)) and all(isinstance(a, str) for a in argv)):
        # A plain string would be split into one argument per character, a baffling usage error.
        example = f"main({argv.split()!r})" if isinstance(argv, str) else "main(['doctor', '--json'])"
        fail(
            "main",
            passed=f"argv={argv!r:.80}",
            why="a str would be split into one argument per character" if isinstance(argv, str) else None,
            allowed="None or a list of strings",
            hint=f"{example}.",
            error=TypeError,
        )
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse exits on --help and on bad arguments; report it as a status
        return stop.code if isinstance(stop.code, int) else 2
    if args.command != "doctor":
        parser.print_help(sys.stderr)
        return 2
    if args.fp8 is not None:
        return _doctor_fp8(args.model, args.fp8, args.json)
    return _doctor(model_spec=args.model, as_json=args.json, measure=not args.no_measure, ops=args.ops)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an option it does not know is its error, reported with its options.

    argparse hands a subcommand's unknown arguments back to the top level, whose message names
    neither the subcommand nor what it accepts.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unknown(extras))
        return parsed, extras

    def _unknown(self, extras: list[str]) -> str:
        command = self.prog.rpartition(" ")[2]
        known = [a for a in self._actions if a.option_strings]
        options = ", ".join(
            "/".join(a.option_strings) + (f" {a.metavar}" if a.metavar else "") for a in known
        )
        names = [s for a in known for s in a.option_strings]
        message = (
            f"unrecognized arguments: {' '.join(extras)} ({command} does not know "
            f"{', '.join(map(repr, extras))}; its options: {options})"
        )
        close = difflib.get_close_matches(extras[0].partition("=")[0], names, n=1)
        return message + (f". HINT: did you mean {close[0]}?" if close else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amp-plugin", description="amp_plugin tools.")
    parser.add_argument("--version", action="version", version=f"amp_plugin {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    doctor = commands.add_parser(
        "doctor",
        help="report what this machine supports for mixed precision; audit a model for fp16 hazards",
        description="Report versions, devices, Apex and matmul throughput, recommend a precision, "
        "and optionally audit a model for fp16 hazards.",
    )
    # Here too, so `amp-plugin doctor --version` answers instead of suggesting --json.
    doctor.add_argument("--version", action="version", version=f"amp_plugin {__version__}")
    doctor.add_argument("--model", metavar="MODULE:FACTORY", help="audit the model that FACTORY() returns")
    doctor.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    doctor.add_argument("--no-measure", action="store_true", help="skip the matmul throughput measurement")
    doctor.add_argument("--ops", action="store_true", help="probe the dtype common ops run in under autocast")
    doctor.add_argument(
        "--fp8", nargs="?", const="tensorwise", choices=RECIPES, metavar="RECIPE",
        help="fp8 instead: the device's fp8 hardware and, with --model, which Linear layers fp8 would "
        "convert and each one's fp8 error (SQNR in dB); RECIPE: " + ", ".join(RECIPES)
        + " (default tensorwise)",
    )  # fmt: skip
    return parser


def _doctor(model_spec: str | None, as_json: bool, measure: bool, ops: bool = False) -> int:
    audit: AuditReport | None = None
    if model_spec is not None:
        try:
            audit = audit_model(load_model(model_spec))
        except (ValueError, TypeError, ImportError, RuntimeError) as err:
            print(f"amp-plugin doctor: error: {err}", file=sys.stderr)
            return 2
    report = device_report(measure=measure)
    probes = _probe_ops() if ops else []
    if as_json:
        document: dict[str, Any] = {"device": report, "audit": audit.to_dict() if audit else None}
        if ops:
            document["ops"] = [probe.to_dict() for probe in probes]
        print(json.dumps(document, indent=2))
    else:
        print(format_device_report(report))
        if audit is not None:
            print(f"\n{audit.format()}")
        if ops:
            print(f"\n{format_autocast_ops(probes)}")
    return 0 if audit is None or audit.ok else 1


def _doctor_fp8(model_spec: str | None, recipe: str, as_json: bool) -> int:
    if model_spec is None:  # no layers to count: the hardware line, and how to see the layers
        has, why = fp8_hardware()
        hint = "add --model MODULE:FACTORY to see which Linear layers fp8 would convert, and their fp8 error"
        if as_json:
            print(
                json.dumps(
                    {"recipe": recipe, "hardware": {"fp8": has, "detail": why}, "layers": None}, indent=2
                )
            )
        else:
            print(f"fp8 (recipe {recipe})\n  fp8 hardware: {why}\n  HINT: {hint}")
        return 0
    try:
        model = load_model(model_spec)
        with _quiet_torchao_import():
            report = fp8_report(model, recipe)
    except (ValueError, TypeError, ImportError, RuntimeError) as err:
        print(f"amp-plugin doctor: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if as_json else format_fp8_report(report))
    return 0


# Loggers whose import-time warnings say nothing about the user's model: torchao's optional CUDA
# extensions that do not load on this machine, and torch's notice about torchao's enum registration.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """Silence the import-time warnings of :data:`_IMPORT_NOISE` for the doctor's run; levels are restored."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _probe_ops() -> list[AutocastOps]:
    # The CPU lists, and CUDA's where present (they differ); both autocast dtypes on each.
    probes = [probe_autocast_ops("cpu", dtype) for dtype in (torch.bfloat16, torch.float16)]
    if torch.cuda.is_available():
        cuda_dtypes = (torch.float16, torch.bfloat16) if torch.cuda.is_bf16_supported() else (torch.float16,)
        probes += [probe_autocast_ops("cuda", dtype) for dtype in cuda_dtypes]
    return probes


def load_model(spec: str) -> nn.Module:
    """Import ``package.module:factory`` (the factory may be dotted) and call it without arguments.

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: ``spec`` is malformed or names a missing attribute.
        ImportError: the module cannot be imported.
        TypeError: the factory is not callable or does not return a ``torch.nn.Module``.
        RuntimeError: the factory raised.

    Example:
        >>> load_model("torch.nn:Identity")
        Identity()
    """
    if not isinstance(spec, str):
        fail(
            "load_model",
            passed=f"spec={spec!r:.80}",
            allowed="a 'package.module:factory' str",
            hint=_SPEC_FIX,
            error=TypeError,
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(
            f"--model {spec!r} is not a factory spec; expected 'package.module:factory'. {_SPEC_HELP}"
        )
    with _cwd_importable():
        try:
            factory: Any = importlib.import_module(module_name)
        # A broken module raises anything at import, not only ImportError; a script calls sys.exit.
        except (Exception, SystemExit) as err:
            hint = (
                'put its script part under `if __name__ == "__main__":`'
                if isinstance(err, SystemExit)
                else "run from the directory that holds the package, or install it"
            )
            raise ImportError(
                f"--model {spec!r}: importing {module_name!r} failed ({type(err).__name__}: {err}); "
                f"expected an importable module. HINT: {hint}."
            ) from err
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(
                f"--model {spec!r}: {module_name!r} has no attribute {attr!r}; expected a callable that "
                f"returns the model. {_SPEC_HELP}"
            )
        factory = getattr(factory, part)
    return _call_factory(spec, attr, factory)


def _call_factory(spec: str, attr: str, factory: Any) -> nn.Module:
    if not callable(factory):
        raise TypeError(
            f"--model {spec!r}: {attr!r} is a {type(factory).__name__}, not callable; expected a function "
            f"or class that takes no arguments and returns a torch.nn.Module. {_SPEC_HELP}"
        )
    try:
        model = factory()
    except (Exception, SystemExit) as err:  # argparse in a factory exits; KeyboardInterrupt still stops
        raise RuntimeError(
            f"--model {spec!r}: calling {attr}() raised {type(err).__name__}: {err}. HINT: the factory is "
            "called with no arguments; wrap the model's constructor in a function that fills them in."
        ) from err
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"--model {spec!r}: {attr}() returned a {type(model).__name__}; expected a torch.nn.Module. "
            "HINT: return the model instance itself (not a tuple, a class or a data module)."
        )
    return model


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    # `python -m` puts the working directory on sys.path, the `amp-plugin` console script does not;
    # both should find a model defined next to where the user runs the command.
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)
