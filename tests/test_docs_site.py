"""The documentation site builds with warnings as errors and shows every page and module.

``mkdocs build --strict`` fails on a broken link or anchor, a missing page, and a docstring
griffe cannot read (an ``Args:`` entry naming no parameter, say). The nav must list every
page in docs/, and the API reference must cover every public module, so that the site stays
complete as pages and modules are added.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _need_mkdocs() -> None:
    """Skip where the test extra is not installed (a GPU image, say); CI installs it."""
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs: pip install -e '.[test]'")


def _nav_pages() -> set[str]:
    _need_mkdocs()
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    pages: set[str] = set()

    def walk(item: object) -> None:
        if isinstance(item, str):
            pages.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(config["nav"])
    return pages


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_site_builds_strict(tmp_path: Path) -> None:
    _need_mkdocs()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    scaler = (tmp_path / "reference" / "scaler" / "index.html").read_text()
    # the page documents the public path of the class users call, then its warnings; no private path
    assert scaler.index('id="amp_plugin.LossScaler"') < scaler.index('id="amp_plugin.ScaleFloorWarning"')
    for page in (tmp_path / "reference").rglob("index.html"):  # the reference documents public paths only
        assert not re.search(r'id="amp_plugin(\.\w+)*\._', page.read_text()), page
    # code wraps instead of scrolling sideways; identifiers in tables do not break mid-word
    css = (tmp_path / "css" / "extra.css").read_text()
    assert "pre-wrap" in css and "keep-all" in css
    assert '<link rel="stylesheet" href="../css/extra.css">' in _page(tmp_path, "quickstart")
    # the docstrings' "Example:" sessions render as highlighted code, not as prose
    assert scaler.count('<span class="gp">&gt;&gt;&gt; </span>') > 10
    # Sphinx roles become links to the objects' entries
    assert ":class:" not in scaler and ":func:" not in scaler
    assert 'class="autorefs autorefs-internal"' in scaler
    # Mermaid comes with the site: Material fetches it from a CDN only where no global `mermaid` exists
    diagram = (tmp_path / "how_amp_works" / "index.html").read_text()
    assert '<pre class="mermaid">' in diagram
    assert re.search(r'<script src="\.\./js/mermaid\.min\.js"></script>', diagram)
    assert (tmp_path / "js" / "mermaid.min.js").stat().st_size > 1_000_000
    assert "MIT License" in (tmp_path / "js" / "mermaid.LICENSE").read_text()


def test_every_docs_page_is_in_the_nav() -> None:
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = sorted(pages - _nav_pages())
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}. HINT: add them under a section."


def test_every_public_module_has_a_reference_entry() -> None:
    documented = set(re.findall(r"^::: (\S+)", "\n".join(
        p.read_text() for p in (DOCS / "reference").glob("*.md")), re.M))
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "amp_plugin").rglob("*.py")
    }
    public = {m for m in modules if not any(part.startswith("_") for part in m.split("."))}
    missing = sorted(public - documented)
    assert not missing, f"modules with no `::: module` in docs/reference/*.md: {missing}"
