"""`hybridlm report`: one self-contained HTML report of a trace or a run folder."""

from __future__ import annotations

import click

from hybridlm.cli.options import OUTPUT_FILE


@click.command()
@click.argument("path", type=click.Path())
@click.option("--out", "-o", type=OUTPUT_FILE, default=None,
              help="The HTML file [default: the trace's name with .html, or report.html in the run folder].")
@click.option("--states", "states_path", type=click.Path(dir_okay=False), default=None,
              help="The states file of an agent trace [default: the .safetensors beside it, when present].")
@click.option("--otel", default=None,
              help="Also export the arc as OpenTelemetry spans: a FILE (OTLP JSON lines, appended) or an http(s) URL "
                   "(OTLP/HTTP, e.g. http://127.0.0.1:4318).")
def report(path, out, states_path, otel):
    """Write one self-contained HTML report of PATH: an agent trace, a consensus run folder or a survey run folder."""
    from pathlib import Path

    from hybridlm.engine.trace import cut_warnings_to
    from hybridlm.errors import InputError
    from hybridlm.report import detect, write_report

    with cut_warnings_to(lambda m: click.echo(f"[warning: {m}]", err=True)):
        kind = detect(path)
        if otel is not None and kind != "arc":
            raise InputError(f"--otel exports an agent arc; {path} is a {kind} run folder")
        if otel is not None:
            from hybridlm.report.otel import export_trace, is_url

            n = export_trace(path, otel)
            click.echo(f"exported {n} spans to {otel}{'' if is_url(otel) else ' (OTLP JSON lines)'}")
        if out is None:
            out = Path(path).with_suffix(".html") if kind == "arc" else Path(path) / "report.html"
        kind, written = write_report(path, out, states=states_path)
        click.echo(f"wrote {written} ({written.stat().st_size / 1024:.0f} KiB, {kind} report)")
