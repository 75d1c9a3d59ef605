"""The docs site as a reader sees it: built strictly, served on 127.0.0.1 and opened in headless Chromium (Debian's
``chromium``; ``make test`` installs it). On the home, quick start, vLLM and one mask page, no table or code
block may be wider than the page's content area or hide part of its text behind a horizontal scroll, and no block
quote may start in the middle of a sentence (a line of running text that begins with ``>``).

The page is measured in the DOM, not in pixels: the server adds a small script to each page it serves with
``?measure``, which writes what it found into the page; ``chromium --dump-dom`` hands the page back. Screenshots
of the pages are taken too: ``LEANK_SCREENSHOTS=DIR`` keeps them in DIR.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"home": "", "quick start": "quickstart/", "vllm": "vllm/", "a mask": "masks/smollm2-135m-instruct-s3/"}
WIDTH = 1280  # a laptop's browser window
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--disable-extensions", "--mute-audio", f"--window-size={WIDTH},2400"]

# Runs in the page once it has loaded (the theme's own script has wrapped its tables by then): every table and code
# block of the article against the article's box, every block quote with the text before it; the findings go into
# a <pre id="leank-measure"> that --dump-dom returns.
MEASURE = """
<script>
window.addEventListener("load", () => setTimeout(() => {
  const article = document.querySelector("article.md-content__inner") || document.body;
  const box = article.getBoundingClientRect();
  const out = {article: {left: box.left, right: box.right}, wide: [], quotes: [], checked: 0};
  for (const el of article.querySelectorAll("table, pre, pre > code")) {
    const r = el.getBoundingClientRect();
    out.checked += 1;
    const hidden = el.scrollWidth - el.clientWidth;
    let view = el.parentElement, clipped = 0;  // a scrolling wrapper (the theme's) hides what it cannot show
    while (view && view !== article) {
      clipped = Math.max(clipped, view.scrollWidth - view.clientWidth);
      view = view.parentElement;
    }
    if (r.right > box.right + 1 || hidden > 1 || clipped > 1) {
      out.wide.push({tag: el.tagName.toLowerCase(), right: Math.round(r.right), hidden: hidden, clipped: clipped,
                     text: el.innerText.slice(0, 80)});
    }
  }
  for (const q of article.querySelectorAll("blockquote")) {
    const prev = q.previousElementSibling;
    out.quotes.push({text: q.innerText.trim().slice(0, 80),
                     before: prev && prev.tagName === "P" ? prev.innerText.trim().slice(-80) : ""});
  }
  const pre = document.createElement("pre");
  pre.id = "leank-measure";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 300));
</script>
"""


def mid_sentence(quote: dict[str, str]) -> bool:
    """A block quote a reader takes for running text: it starts with no capital (``= 80% tasks ...``, from a line
    beginning ``>= 80%``), or the paragraph right before it stops without ending its sentence."""
    text, before = quote["text"], quote["before"]
    starts_low = bool(text) and not re.match(r"[A-Z\"'“(\[*_`]", text)
    return starts_low or bool(before and not re.search(r"[.:!?)\]]$", before))


class Handler(SimpleHTTPRequestHandler):
    """Serves the built site; an HTML page asked for with ``?measure`` gets :data:`MEASURE` before ``</body>``."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path, _, query = self.path.partition("?")
        if query != "measure":
            return super().do_GET()
        file = Path(self.translate_path(path))
        file = file / "index.html" if file.is_dir() else file
        page = file.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>", 1).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[str]:
    """The site, built as `make docs` builds it, at http://127.0.0.1:PORT/."""
    if CHROMIUM is None:
        pytest.skip("needs chromium (Debian's; `make test` installs it: apt-get install -y chromium)")
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def chromium(*args: str) -> str:
    """Headless Chromium with a profile of its own, which it removes; its stdout."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def measure(url: str) -> dict:
    dom = chromium("--run-all-compositor-stages-before-draw", "--virtual-time-budget=10000", "--dump-dom",
                   url + "?measure")
    found = re.search(r'<pre id="leank-measure">(.*?)</pre>', dom, re.S)
    assert found, f"{url}: the measuring script did not run"
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.parametrize("name", list(PAGES))
def test_page_fits_the_reader_window(served, name, tmp_path):
    """No table or code block spills past the article or hides text behind a scroll; no block quote cuts a
    sentence; and the page renders to a screenshot (kept in LEANK_SCREENSHOTS when set)."""
    url = served + PAGES[name]
    keep = os.environ.get("LEANK_SCREENSHOTS")
    shot = Path(keep) / f"{name.replace(' ', '-')}.png" if keep else tmp_path / "page.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    chromium("--run-all-compositor-stages-before-draw", "--virtual-time-budget=10000", f"--screenshot={shot}", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    found = measure(url)
    assert found["checked"] > 0, f"{name}: no table or code block measured"
    cut = [q for q in found["quotes"] if mid_sentence(q)]
    assert (found["wide"], cut) == ([], []), (f"{name}: wider than the page's {found['article']}: {found['wide']}; "
                                             f"block quotes in running text: {cut}")


def test_the_checks_catch_what_they_look_for():
    """The sentence rule on the cases it must tell apart."""
    assert mid_sentence({"text": "= 80% tasks make the headline)", "before": "the suite's tasks (those where"})
    assert mid_sentence({"text": "Quoted", "before": "the paragraph goes on and"})
    assert not mid_sentence({"text": "Quoted from the paper.", "before": "The authors write:"})
