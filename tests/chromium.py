"""Render a page in headless Chromium (Debian's `chromium`): a screenshot, and the DOM after
load with each image's load state written into it by a small script added to a copy."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

# conftest's `chromium` fixture: waits for .ci/run's package install, skips without chromium
needs_chromium = pytest.mark.usefixtures("chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars")
# Runs at `load`, when every <img> has loaded or failed; naturalWidth is 0 for a failed one.
# The page's scroll width is read before the probe's own <pre> is added.
IMAGE_CHECK = """<script>
window.addEventListener("load", () => {
  const width = document.documentElement.scrollWidth;
  const out = document.createElement("pre");
  out.id = "image-check";
  out.textContent = JSON.stringify({width, images: [...document.images].map(
    (img) => ({alt: img.alt, complete: img.complete, width: img.naturalWidth}))});
  document.body.appendChild(out);
});
</script>"""


def _chromium(*args: str) -> str:
    chromium = shutil.which("chromium")
    assert chromium is not None
    proc = subprocess.run(
        [chromium, *FLAGS, *args], capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 2400) -> None:
    _chromium(f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri())


def loaded_dom(page: Path, width: int = 1400) -> tuple[str, list[dict[str, Any]], int]:
    """(the DOM after load in a window `width` px wide, [{alt, complete, width}] per image,
    the page's scroll width: above `width` where something overflows the window)."""
    probe = page.with_name(f"{page.stem}.probe.html")
    probe.write_text(page.read_text().replace("</body>", IMAGE_CHECK + "</body>"))
    dom = _chromium(f"--window-size={width},1000", "--dump-dom", probe.as_uri())
    start = dom.index('<pre id="image-check">') + len('<pre id="image-check">')
    check = json.loads(html.unescape(dom[start : dom.index("</pre>", start)]))
    return dom, check["images"], check["width"]
