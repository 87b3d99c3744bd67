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
    for r in rows:
        r["tool_format"] = tool_format(r)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    fam = max(len(r["family"]) for r in rows)
    tools = max(len(r["tool_format"]) for r in rows)
    for r in rows:
        mark = "✓" if r["available"] else "✗"
        default = " (default)" if r["default"] else ""
        auto = f"auto: {r['precision']}"
        click.echo(f"{mark} {r['name']:<{width}}  {r['family']:<{fam}}  {auto:<13} {r['tool_format']:<{tools}}  "
                   f"{r['source']}{default}")


def tool_format(row: dict) -> str:
    """The call format a model of the list speaks (hybridlm.turns.codecs): its template's, read from its GGUF
    file; the project's default where the template names none (a base model; random weights); "template" for
    a model whose template is read only when it loads."""
    from hybridlm.turns.codecs import DEFAULT, detect
    from hybridlm.weights.gguf_header import read_header
    from hybridlm.weights.loading import _gguf_file

    name = row["name"]
    if name.startswith("random"):
        return DEFAULT
    if name == "PATH" or not row["available"] or row.get("grid") is None:
        return "template"
    path = _gguf_file(name)
    template = read_header(path, vocabulary=False).metadata.get("tokenizer.chat_template") if path is not None else None
    codec = detect(template if isinstance(template, str) else "")
    return codec.name if codec.templated else f"{codec.name} (default)"
