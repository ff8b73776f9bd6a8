"""The screenshot of ``make demo``'s report in README.md and docs/report.md, taken by a real headless Chromium.

Run from the repository root after ``make demo``::

    .venv/bin/python docs/figures/report_screenshot.py moetrace-demo/report.html

(writes ``docs/figures/report-demo.png``: the whole page at 1280 px, scaled to 900 px wide).
Uses the browser helper of the report's tests (tests/report/browser.py).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "report-demo.png"


def main(report: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.report.browser import browser, open_report, pixel_stats

    with browser() as driver:
        view = open_report(driver, report, full_page=True)
    if view.errors or view.undrawn():
        raise SystemExit(f"{report}: console errors {view.errors}, undrawn figures {view.undrawn()}")
    image = Image.open(io.BytesIO(view.screenshot)).convert("RGB")
    image = image.resize((900, round(image.height * 900 / image.width)), Image.LANCZOS)
    image.quantize(colors=256).save(OUT, optimize=True)  # a palette keeps the file small (figures use few colours)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {image.width}x{image.height}, {pixel_stats(view.screenshot)})")
    return OUT


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "moetrace-demo/report.html"))
