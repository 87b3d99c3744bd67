"""Seeing a run: one self-contained HTML file for an agent arc, a consensus run or a survey run.

`hybridlm report PATH -o report.html`; `render_arc_report(events, states=None)` for a
server. `hybridlm.report.otel` exports an arc as OpenTelemetry spans (the `report` extra).
"""

from hybridlm.report.arc import arc_view, load_states, pca_2d
from hybridlm.report.page import (
    render_arc_report, render_consensus_report, render_survey_report, report_html, write_report,
)
from hybridlm.report.runs import consensus_view, detect, survey_view

__all__ = [
    "arc_view", "consensus_view", "detect", "load_states", "pca_2d", "render_arc_report", "render_consensus_report",
    "render_survey_report", "report_html", "survey_view", "write_report",
]
