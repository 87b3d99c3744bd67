"""`hybridlm trace`: read hybrid-arc traces, replay them."""

from __future__ import annotations

import click

from hybridlm.cli.options import MODEL, MODEL_HELP, Group


@click.group(cls=Group)
def trace():
    """Read hybrid-arc traces."""


@trace.command("show")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--tokens", is_flag=True, help="One line per token step.")
def trace_show(file, tokens):
    """Print the arc recorded in FILE as a timeline."""
    from hybridlm.engine.trace import cut_warnings_to, format_timeline, read_trace

    with cut_warnings_to(lambda m: click.echo(f"[warning: {m}]", err=True)):
        click.echo(format_timeline(read_trace(file), tokens=tokens))


@trace.command("replay")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
def trace_replay(file, model_spec):
    """Re-run the arc of FILE with its seed (observations from the trace) and compare tokens."""
    from hybridlm.agent import replay
    from hybridlm.engine.trace import cut_short, cut_warnings_to, read_trace
    from hybridlm.weights.loading import load_model

    with cut_warnings_to(lambda m: click.echo(f"[warning: {m}]", err=True)):
        check_replayable(file)  # the whole trace, before the model loads
        events = read_trace(file)
        start = next(e for e in events if e["event"] == "start")
        arc, same, first = replay(file, load_model(model_spec, precision=start.get("precision", "float32")))
        if same and cut_short(events):  # a killed run: the replay stopped where the recording does
            steps, jumps = (sum(e["event"] == kind for e in events) for kind in ("token", "jump"))
            click.echo(f"identical as far as recorded: the {steps} recorded token steps and {jumps} "
                       f"jump{'' if jumps == 1 else 's'} were reproduced; the recording is cut there (no end event: "
                       "the run was killed)")
        elif same:
            click.echo(f"identical: {arc.token_steps} token steps, {len(arc.jumps)} jumps reproduced")
        else:
            click.echo(f"differs from token step {first}")
            raise SystemExit(1)


def check_replayable(file) -> None:
    """Every event valid, and a start event replay can rebuild the run from (its kernel and limits built)."""
    import dataclasses

    from hybridlm.agent import Limits
    from hybridlm.engine.trace import check_event, iter_trace
    from hybridlm.engine.sampling import Kernel
    from hybridlm.errors import InputError

    start = next((e for e in iter_trace(file) if e["event"] == "start"), None)
    for _ in iter_trace(file):  # the rest of the file too: replay reads it all
        pass
    if start is None:
        raise InputError(f"{file}: no start event, cannot replay")
    check_event(start, f"{file}: start event", "replayable_start")
    names = [t.get("name") for t in start["tools"]]
    if start["tool_choice"] not in ("auto", "required", "none", *names):
        raise InputError(f"{file}: start event: field 'tool_choice' is {start['tool_choice']!r}: expected auto, "
                         f"required, none or one of the tools {names[:8]}")
    for field, cls in (("kernel", Kernel), ("limits", Limits)):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(start[field]) - known)
        if unknown:
            raise InputError(f"{file}: start event: field '{field}' has {unknown[0]!r}, expected some of {sorted(known)}")
        cls(**start[field])  # its own checks raise InputError naming the value
