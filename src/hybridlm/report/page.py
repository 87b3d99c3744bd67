"""One HTML file: the view's JSON, the stylesheet and the renderer, all inline.

The page's Content-Security-Policy allows nothing to be fetched (`default-src 'none'`),
so a report cannot reach the network when it is opened, whatever it holds; the renderer
(assets/report.js) is hand-written SVG and DOM code, with no library to load or to
outlive.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Iterable
from functools import cache
from importlib.resources import files
from pathlib import Path

from hybridlm.errors import InputError
from hybridlm.files import write_output
from hybridlm.report.arc import arc_view, load_states, states_beside
from hybridlm.report.runs import consensus_view, detect, survey_view

CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"

TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="generator" content="{generator}">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<main id="report"><noscript>This report is drawn by the script inside this file; the data is the JSON below.</noscript></main>
<div id="tip" hidden></div>
<script type="application/json" id="report-data">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


@cache
def _asset(name: str) -> str:
    return files("hybridlm.report").joinpath("assets", name).read_text(encoding="utf-8")


def _generator() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"hybridlm {version('hybridlm')}"
    except PackageNotFoundError:
        return "hybridlm"


def render(view: dict, title: str) -> str:
    """The page for a view (from arc_view, consensus_view or survey_view)."""
    view = {**view, "meta": {"generator": _generator()}}
    data = json.dumps(view, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    data = data.replace("<", "\\u003c")  # "<" occurs only inside JSON strings: nothing in the data can end the script
    return TEMPLATE.format(csp=CSP, generator=html.escape(_generator()), title=html.escape(title), css=_asset("report.css"),
                           data=data, js=_asset("report.js"))


def render_arc_report(events: Iterable[dict], states=None) -> str:
    """The HTML report of one hybrid arc: its trace events (a list, or a stream read once) and, optionally, its
    final-layer states (an array [token steps, d]); what a server returns for GET /v1/arcs/{id}/report."""
    view = arc_view(events, states)
    task = (view.get("start") or {}).get("task")
    return render(view, f"hybridlm arc · {task}" if task else "hybridlm arc")


def render_consensus_report(folder: str | os.PathLike) -> str:
    view = consensus_view(folder)
    return render(view, view["title"])


def render_survey_report(folder: str | os.PathLike) -> str:
    view = survey_view(folder)
    return render(view, view["title"])


def report_html(path: str | os.PathLike, *, states: str | os.PathLike | None = None) -> tuple[str, str]:
    """(kind, HTML) for a trace file, a consensus run folder or a survey run folder."""
    from hybridlm.engine.trace import iter_trace

    kind = detect(path)
    if kind != "arc":
        if states is not None:
            raise InputError(f"--states {states}: only an agent trace has states; {path} is a {kind} run folder")
        return kind, (render_consensus_report(path) if kind == "consensus" else render_survey_report(path))
    if states is None:
        states_path = states_beside(path)
    elif Path(states).is_file():
        states_path = Path(states)
    else:
        raise InputError(f"--states {states}: no such file")
    # the trace is read as a stream: what the page keeps of it is bounded by what it draws (report.arc.Thinned)
    return kind, render_arc_report(iter_trace(path), load_states(states_path)[0] if states_path else None)


def write_report(path: str | os.PathLike, out: str | os.PathLike, *, states=None) -> tuple[str, Path]:
    kind, text = report_html(path, states=states)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(out, text, "report")
    return kind, out
