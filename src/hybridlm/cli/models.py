"""`hybridlm models`: what can be loaded here, and from where."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def models(as_json):
    """List the models available on this machine and where each comes from."""
    from hybridlm.weights.loading import available_models

    rows = available_models()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    fam = max(len(r["family"]) for r in rows)
    for r in rows:
        mark = "✓" if r["available"] else "✗"
        default = " (default)" if r["default"] else ""
        auto = f"auto: {r['precision']}"
        click.echo(f"{mark} {r['name']:<{width}}  {r['family']:<{fam}}  {auto:<13} {r['source']}{default}")
