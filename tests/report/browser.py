"""Open a report in a real headless Chromium (Debian ``chromium`` + ``chromium-driver``) through Selenium.

:func:`open_report` loads the file, waits until every figure is drawn, and returns what the
page shows: the browser console's errors, each figure's trace types with its data points (from
plotly's own ``_fullData``) and the SVG elements drawn for them, and a screenshot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

# Per figure: its section, its traces (type, data points) and the drawn marks in its SVG.
_FIGURES_JS = """
return Array.from(document.querySelectorAll('div.figure')).map(function (gd) {
  const data = (gd._fullData || []).map(function (t) {
    const n = function (a) { return a ? (a.length || 0) : 0; };
    let points = t._length || n(t.x) || n(t.y);
    if (t.type === 'heatmap') { points = (t.z || []).reduce(function (s, row) { return s + n(row); }, 0); }
    if (t.type === 'sankey') { points = n(t.link && t.link.value); }
    if (t.type === 'indicator') { points = (t.value === undefined || t.value === null) ? 0 : 1; }
    return {type: t.type, points: points};
  });
  const q = function (sel) { return gd.querySelectorAll(sel).length; };
  return {
    id: gd.id, section: gd.dataset.section, drawn: gd.classList.contains('js-plotly-plot'), traces: data,
    marks: {heatmap: q('.hm image'), bar: q('.bars path'), line: q('.scatterlayer path.js-line') + q('.scatterlayer path.point'),
            sankey: q('.sankey-link'), indicator: q('g.numbers text.number')}
  };
});
"""


@dataclasses.dataclass
class PageView:
    """What the browser showed."""

    errors: list[dict[str, Any]]
    sections: list[str]
    figures: list[dict[str, Any]]
    screenshot: bytes

    def undrawn(self) -> list[str]:
        """Figures without a drawn mark for every trace that holds data points."""
        bad = []
        for fig in self.figures:
            marks = fig["marks"]
            if not fig["drawn"] or not fig["traces"]:
                bad.append(fig["id"])
                continue
            for trace in fig["traces"]:
                if trace["points"] <= 0 or marks.get(trace["type"], marks["line"] if trace["type"] == "scatter" else 0) <= 0:
                    bad.append(f"{fig['id']}:{trace['type']}")
        return bad


def available() -> str | None:
    """Why no browser can run here (``None`` when Chromium and its driver are installed)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    return None if not missing else f"{', '.join(missing)} missing: apt-get install chromium chromium-driver"


@contextlib.contextmanager
def browser(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A headless Chromium (root: --no-sandbox) driven by Selenium, closed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(120)
        driver.set_script_timeout(60)
        yield driver
    finally:
        driver.quit()


def wait_drawn(driver: Any, timeout: float = 60.0) -> None:
    """Until every figure div is a drawn plotly plot."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: d.execute_script(
        "const f = document.querySelectorAll('div.figure'); return f.length > 0 && "
        "Array.from(f).every(function (g) { return g.classList.contains('js-plotly-plot') && g._fullLayout; });"))


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """Console entries at SEVERE level (JavaScript errors, failed loads)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def open_report(driver: Any, path: Path, full_page: bool = False) -> PageView:
    """Load ``path``, wait for the figures, read them back, take a screenshot."""
    driver.get(Path(path).resolve().as_uri())
    wait_drawn(driver)
    figures = driver.execute_script(_FIGURES_JS)
    sections = driver.execute_script("return Array.from(document.querySelectorAll('section.mt-section')).map(function (s) { return s.id; });")
    if full_page:
        height = int(driver.execute_script("return document.documentElement.scrollHeight;"))
        driver.set_window_size(1280, min(height + 240, 12000))  # the window frame takes some of it
        wait_drawn(driver)
    shot = driver.get_screenshot_as_png()
    return PageView(console_errors(driver), sections, figures, shot)


def pixel_stats(png: bytes) -> dict[str, float]:
    """Share of non-white pixels and the number of distinct colours of a screenshot."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    flat = image.reshape(-1, 3)
    ink = (flat < 245).any(axis=1).mean()
    colours = len(np.unique(flat[:: max(1, len(flat) // 200000)], axis=0))
    return {"ink": float(ink), "colours": float(colours), "height": float(image.shape[0]), "width": float(image.shape[1])}


def check_page(view: PageView, sections: list[str]) -> None:
    """The checks every report must pass: no console error, the expected sections, every figure drawn, not blank."""
    assert view.errors == [], f"browser console errors: {view.errors}"
    assert view.sections == sections
    assert view.undrawn() == [], f"figures without drawn data points: {view.undrawn()}"
    assert {f["section"] for f in view.figures} == set(sections), "a section without a figure"
    stats = pixel_stats(view.screenshot)
    assert stats["ink"] > 0.03 and stats["colours"] > 50, f"the screenshot looks blank: {stats}"


_GRID_JS = """
const gd = document.getElementById('fig-routes');
const img = gd.querySelector('.hm image');
return {title: gd._fullLayout.title.text, z: gd._fullData[0].z, image: img ? img.getAttribute('href') : null};
"""


def choose_request(driver: Any, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pick option ``index`` of the request selector; the routes grid (title, cells, drawn image) before and after."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    before = driver.execute_script(_GRID_JS)
    Select(driver.find_element(By.ID, "mt-request")).select_by_index(index)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(_GRID_JS)["title"] != before["title"])
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(_GRID_JS)["image"] != before["image"])
    return before, driver.execute_script(_GRID_JS)
