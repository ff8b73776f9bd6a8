"""The HTML page: plotly.js embedded once, one ``<section>`` per :class:`~.sections.Section`, no network.

The figures travel as one JSON document (``<script type="application/json">``) that a small
script hands to ``Plotly.newPlot``; the request selector swaps the routes grid's cells with
``Plotly.restyle``. Nothing is fetched: the file opens offline in any browser.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from pathlib import Path

import plotly
import plotly.io as pio
from plotly.offline import get_plotlyjs

from .._version import __version__
from ..trace.writer import write_text_atomic
from .figures import TEMPLATE
from .sections import Section

__all__ = ["render_page", "write_page"]

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1180px; padding: 0 16px 40px; color: #1d2330; }
header { border-bottom: 1px solid #d8dce4; padding: 12px 0 8px; }
h1 { font-size: 22px; margin: 6px 0; }
h2 { font-size: 18px; margin: 28px 0 4px; }
nav a { margin-right: 14px; font-size: 13px; }
.inputs, .note, .bound { font-size: 12px; color: #5a6372; margin: 2px 0; }
.reading { font-size: 15px; margin: 4px 0 8px; padding: 6px 10px; background: #f2f5fa; border-left: 3px solid #3b6fd8; }
.figure { width: 100%; }
select { font-size: 14px; margin: 4px 0 8px; }
"""

# Draws every figure, then wires the request selector. Any failure is thrown (the browser
# console shows it; the tests fail on it) rather than swallowed.
_SCRIPT = """
(function () {
  const figures = JSON.parse(document.getElementById("mt-figures").textContent);
  const template = JSON.parse(document.getElementById("mt-template").textContent);
  const config = {responsive: true, displaylogo: false};
  for (const [id, fig] of Object.entries(figures)) {
    fig.layout.template = template;
    Plotly.newPlot(id, fig.data, fig.layout, config);
  }
  const choice = document.getElementById("mt-routes-data");
  if (choice) {
    const routes = JSON.parse(choice.textContent);
    const select = document.getElementById("mt-request");
    select.addEventListener("change", function () {
      const r = routes.options[select.selectedIndex];
      Plotly.restyle(routes.figure, {x: [r.x], z: [r.z], text: [r.text]}, [0]);
      Plotly.relayout(routes.figure, {"title.text": r.title});
    });
  }
})();
"""


def _safe(text: str) -> str:
    """JSON text made safe inside ``<script>``: no ``</`` can close the element."""
    return text.replace("</", "<\\/")


def _json(document: object) -> str:
    return _safe(json.dumps(document, separators=(",", ":")))


def _section_html(section: Section) -> str:
    parts = [f'<section id="{section.key}" class="mt-section">', f"<h2>{html.escape(section.title)}</h2>",
             f'<p class="reading">{html.escape(section.reading)}</p>']
    if section.choice is not None:
        options = "".join(f'<option value="{html.escape(o["id"])}">{html.escape(o["label"])}</option>' for o in section.choice.options)
        parts.append(f'<label for="mt-request">request </label><select id="mt-request">{options}</select>')
    for note in section.notes:
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    for figure_id, _ in section.figures:
        parts.append(f'<div id="{figure_id}" class="figure" data-section="{section.key}"></div>')
    parts.append("</section>")
    return "\n".join(parts)


def render_page(sections: Sequence[Section], inputs: Sequence[Path], bound: str) -> str:
    """The whole page as one string."""
    figures = "{" + ",".join(f"{json.dumps(fid)}:{pio.to_json(fig, validate=False)}" for s in sections for fid, fig in s.figures) + "}"
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    choice = next((s.choice for s in sections if s.choice is not None), None)
    routes = "" if choice is None else (
        f'<script type="application/json" id="mt-routes-data">{_json({"figure": choice.figure_id, "options": choice.options})}</script>')
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>moetrace report: {html.escape(', '.join(p.name for p in inputs))}</title>",
        f"<style>{_STYLE}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        "</head><body>",
        '<header><h1>moetrace report</h1>',
        f'<p class="inputs">inputs: {html.escape(", ".join(str(p) for p in inputs))}</p>',
        f'<p class="inputs">moetrace {__version__}, plotly {plotly.__version__} (embedded, works offline), written {made}</p>',
        f'<p class="bound">{html.escape(bound)}</p>',
        f"<nav>{nav}</nav></header>",
        *(_section_html(s) for s in sections),
        f'<script type="application/json" id="mt-template">{_json(pio.templates[TEMPLATE].to_plotly_json())}</script>',
        f'<script type="application/json" id="mt-figures">{_safe(figures)}</script>',
        routes,
        f"<script>{_SCRIPT}</script>",
        "</body></html>",
    ])


def write_page(path: Path, sections: Sequence[Section], inputs: Sequence[Path], bound: str) -> Path:
    """Render and write the page atomically; returns ``path``."""
    return write_text_atomic(path, render_page(sections, inputs, bound))
