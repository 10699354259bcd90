"""Build the documentation site, serve it on localhost and screenshot every page in headless Chromium.

    python docs/_screenshots.py                        # every page in mkdocs.yml's nav -> runs/screenshots/
    python docs/_screenshots.py --pages index.md comparison.md --width 1000
    python docs/_screenshots.py --check-only           # no PNGs: only the rendered-page checks

``mkdocs build --strict`` checks links and anchors; it cannot tell whether a page reads well
or whether its diagrams draw. This script loads each page the way a reader does, in a real
browser with no network beyond localhost (every other host name fails to resolve, so a
script fetched from a CDN would be missing), and writes one PNG per page to look at. It also
reads each page's DOM after its scripts ran and reports, per page, the Mermaid diagrams that
did not turn into a drawing. Exit status 1 when a page failed to load or a diagram did not
draw, 2 when no Chromium is found (``apt-get install chromium`` on Debian).

Not run by the test command's default environment, which has no browser;
``tests/test_docs_screenshots.py`` runs it on two pages where Chromium is installed and skips
otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Quiet, reproducible and offline: localhost only, nothing Chromium would fetch on its own.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost",
    "--virtual-time-budget=8000",  # let the page's scripts (search index, Mermaid) finish
)


def find_browser(explicit: str | None = None) -> str | None:
    """The Chromium executable: ``explicit`` if given, else the first of :data:`BROWSERS` on the PATH."""
    if explicit:
        return explicit if shutil.which(explicit) else None
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, in its order (``reference/scaler.md`` style paths)."""
    from mkdocs.config import load_config

    pages: list[str] = []

    def walk(item: object) -> None:
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(load_config(str(ROOT / "mkdocs.yml"))["nav"])
    return pages


def build_site(site_dir: Path) -> None:
    """``mkdocs build --strict`` into ``site_dir``."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}")


@contextlib.contextmanager
def serve(site_dir: Path) -> Iterator[str]:
    """Serve ``site_dir`` on a free localhost port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def page_url(base: str, page: str) -> str:
    """The URL MkDocs gives ``page``.

    The root for ``index.md``, ``/reference/scaler/`` for ``reference/scaler.md``.
    """
    path = page.removesuffix(".md")
    if path == "index" or path.endswith("/index"):
        path = path.removesuffix("index")
    else:
        path += "/"
    return base + path


def screenshot(browser: str, url: str, png: Path, width: int, height: int) -> None:
    """One PNG of the top ``width`` x ``height`` pixels of ``url``."""
    png.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [browser, *FLAGS, f"--window-size={width},{height}", f"--screenshot={png}", url],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def diagrams_drawn(browser: str, url: str) -> tuple[int, int]:
    """``(diagrams, drawn)``: the Mermaid blocks in the page's HTML, and how many the browser drew."""
    with urllib.request.urlopen(url, timeout=30) as response:
        diagrams = response.read().decode().count('<pre class="mermaid">')
    done = subprocess.run(
        [browser, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    )
    if not done.stdout.strip():
        raise RuntimeError(f"{url}: the browser returned no page ({done.stderr.strip()[-300:]})")
    # Material replaces each drawn <pre class="mermaid"> by a <div class="mermaid"> holding the SVG
    # (in a shadow root, which --dump-dom leaves out, so the drawings are counted by their div).
    return diagrams, done.stdout.count('<div class="mermaid"')


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", default="runs/screenshots", help="folder for the PNGs (default: runs/screenshots)"
    )
    parser.add_argument(
        "--pages", nargs="+", metavar="PAGE", help="docs pages to take (default: the whole nav)"
    )
    parser.add_argument("--width", type=int, default=1280, help="window width in pixels (default: 1280)")
    parser.add_argument("--height", type=int, default=2400, help="window height in pixels (default: 2400)")
    parser.add_argument(
        "--browser", default=None, help=f"Chromium executable (default: the first of {BROWSERS})"
    )
    parser.add_argument("--check-only", action="store_true", help="check the rendered pages, write no PNGs")
    args = parser.parse_args(argv)
    browser = find_browser(args.browser)
    if browser is None:
        print("no Chromium found: apt-get install chromium (or pass --browser PATH)", file=sys.stderr)
        return 2
    pages = args.pages or nav_pages()
    out, problems = Path(args.out), []
    with tempfile.TemporaryDirectory() as tmp:
        build_site(Path(tmp))
        with serve(Path(tmp)) as base:
            for page in pages:
                url = page_url(base, page)
                try:
                    diagrams, drawn = diagrams_drawn(browser, url)
                    if not args.check_only:
                        screenshot(browser, url, out / (page.removesuffix(".md").replace("/", "_") + ".png"),
                                   args.width, args.height)  # fmt: skip
                except (subprocess.SubprocessError, RuntimeError) as err:
                    problems.append(f"{page}: {err}")
                    continue
                if drawn < diagrams:
                    problems.append(f"{page}: {diagrams - drawn} of {diagrams} Mermaid diagrams not drawn")
                print(f"{page:<32} {'ok' if drawn == diagrams else 'NOT DRAWN'}"
                      + (f", {drawn} diagram(s) drawn" if diagrams else ""))  # fmt: skip
    if not args.check_only:
        print(f"{len(pages) - len(problems)} screenshots in {out}/")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
