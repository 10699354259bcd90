"""The site in a real browser: ``docs/_screenshots.py`` on two pages, where Chromium is installed.

The pages load from localhost with every other host unreachable, so the Mermaid diagram must be
drawn by the script the site ships, not by one fetched from a CDN.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "_screenshots.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_screenshots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_page_urls_follow_mkdocs() -> None:
    script = _script()
    assert script.page_url("http://localhost:1/", "index.md") == "http://localhost:1/"
    assert script.page_url("http://localhost:1/", "comparison.md") == "http://localhost:1/comparison/"
    assert script.page_url("http://localhost:1/", "reference/index.md") == "http://localhost:1/reference/"
    assert (
        script.page_url("http://localhost:1/", "reference/scaler.md")
        == "http://localhost:1/reference/scaler/"
    )
    pytest.importorskip("mkdocs", reason="the nav is read by mkdocs: pip install -e '.[test]'")
    assert "comparison.md" in script.nav_pages()


def test_the_site_draws_its_diagram_offline_and_screenshots_its_pages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    if script.find_browser() is None:
        pytest.skip("needs Chromium (apt-get install chromium)")
    pages = ["how_amp_works.md", "comparison.md"]
    assert script.main(["--pages", *pages, "--out", str(tmp_path), "--width", "800", "--height", "600"]) == 0
    assert "how_amp_works.md                 ok, 1 diagram(s) drawn" in capsys.readouterr().out
    for name in ("how_amp_works.png", "comparison.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
