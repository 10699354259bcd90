"""``python -m amp_plugin``: the command line of :mod:`amp_plugin.cli`."""

from __future__ import annotations

from amp_plugin.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
