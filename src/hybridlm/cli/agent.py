"""`hybridlm agent`: a task through the agentic hybrid automaton, alone or in the loop of a plant."""

from __future__ import annotations

import json

import click

from hybridlm.cli.options import (
    MODEL, MODEL_HELP, OUTPUT_FILE, SEED, TEXT, build_controllers, context_option, control_options,
    chat_template_option, drop_without_grammar, mcp_options, precision_option, steering_vector, tool_registry,
    tool_call_parser_option, use_tool_call_parser, with_chat_template,
)


def _plant_options(fn):
    fn = click.option("--figure", "figure_path", type=OUTPUT_FILE, default=None,
                      help="With --plant: the PNG of the trajectory [default: the trace's name with .png].")(fn)
    fn = click.option("--band", default=None, help="With --plant: the safe band LOW,HIGH of the plant's state "
                      "[default: tank 40,60 cm; room 19,23 °C].")(fn)
    fn = click.option("--period", type=float, default=10.0, show_default=True,
                      help="With --plant: plant seconds between two decisions (also re-prompted on a crossing).")(fn)
    fn = click.option("--horizon", type=float, default=120.0, show_default=True,
                      help="With --plant: plant seconds the run lasts.")(fn)
    fn = click.option("--cbf", is_flag=True, help="With --plant: a control-barrier-function filter on the actuators.")(fn)
    fn = click.option("--plant-speed", type=float, default=1.0, show_default=True,
                      help="With --plant: simulated plant seconds per wall second.")(fn)
    fn = click.option("--plant", "plant_name", default=None,
                      help="Put the agent in the loop of a plant: tank or room (supervisory control).")(fn)
    return fn


@click.command()
@click.argument("task", type=TEXT)
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--tools", default=None,
              help="Comma-separated: calculator, clock, lookup; none for only the MCP servers' or the plant's tools "
                   "[default: calculator; with --plant: none].")
@click.option("--kb", type=click.Path(dir_okay=False), default=None, help="JSON knowledge base for the lookup tool.")
@click.option("--tool-choice", default="required", show_default=True,
              help="required: the first turn opens a tool call; auto: the model decides; none: no tools; or a tool's "
                   "name: the first turn calls that tool.")
@click.option("--parallel-tool-calls", "parallel", is_flag=True,
              help="Several calls in one turn (each a jump, their observations injected in order).")
@click.option("--max-jumps", default=None, type=click.IntRange(min=0),
              help="Jump horizon [default: 3; per decision with --plant: 2].")
@click.option("--max-new-tokens", "-n", default=None, type=click.IntRange(min=1),
              help="Token budget of the whole arc [default: 160; per decision with --plant: 40].")
@click.option("--temperature", "-t", type=float, default=None, help="Sample at τ > 0 (default: greedy).")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--trace", "trace_path", type=OUTPUT_FILE, default=None,
              help="Write the hybrid arc to this JSONL file as it happens [with --plant: default PLANT-arc.jsonl].")
@click.option("--states", is_flag=True, help="With --trace: also save the final-layer state of each token (safetensors).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--stream", is_flag=True, help="Write the tokens and the jumps to stderr as they happen.")
@mcp_options
@chat_template_option
@tool_call_parser_option
@_plant_options
@precision_option("auto")
@context_option
@control_options
def agent(task, model_spec, tools, kb, tool_choice, parallel, max_jumps, max_new_tokens, temperature, seed,
          trace_path, states, as_json, stream, mcp, mcp_timeout, chat_template, plant_name, plant_speed, cbf, horizon,
          period, band, figure_path, precision, context_policy, ban, steer, steer_layer, steer_scale, tool_call_parser):
    """Run TASK through the agentic hybrid automaton (generate ⇄ external modes)."""
    from hybridlm.agent import HybridAgent, Limits
    from hybridlm.errors import InputError
    from hybridlm.engine.sampling import Kernel
    from hybridlm.weights.loading import load_model

    if not task.strip():
        raise InputError("empty task: give the agent something to do")
    if plant_name is None and (cbf or band or figure_path or plant_speed != 1.0):
        raise InputError("--cbf, --band, --figure and --plant-speed need a plant: add --plant tank (or room)")
    if plant_name is not None:
        plan = _plant_plan(plant_name, plant_speed, horizon, period, band)
    kernel = Kernel(greedy=True) if temperature is None else Kernel(temperature=temperature)
    vector = steering_vector(steer, steer_layer, steer_scale)
    if states and trace_path is None:
        raise InputError("--states saves each token's state beside the trace: add --trace FILE")
    with tool_registry(tools or ("none" if plant_name else "calculator"), kb=kb, mcp=mcp,
                       timeout_s=mcp_timeout) as reg:
        if tool_choice not in ("auto", "required", "none", *reg.tools):
            raise InputError(f"--tool-choice {tool_choice!r}: expected auto, required, none or one of the tools "
                             f"{sorted(reg.tools)[:8]}")
        model = with_chat_template(load_model(model_spec, seed=seed, precision=precision), chat_template)
        use_tool_call_parser(model, tool_call_parser)
        controllers = build_controllers(model, ban, vector, steer_layer, steer_scale)
        drop_without_grammar(reg, model)
        if plant_name is not None:
            if controllers or states:
                raise InputError("--plant takes no --ban/--steer/--states (each decision is a fresh arc)")
            limits = Limits(max_token_steps=max_new_tokens or 40, max_jumps=2 if max_jumps is None else max_jumps)
            _run_plant(model, reg, plan, task, kernel=kernel, limits=limits, tool_choice=tool_choice, seed=seed,
                       cbf=cbf, trace_path=trace_path, figure_path=figure_path, as_json=as_json)
            return
        limits = Limits(max_token_steps=max_new_tokens or 160, max_jumps=3 if max_jumps is None else max_jumps)
        if parallel:  # the calls of a turn are jumps at one token step
            limits = Limits(max_token_steps=limits.max_token_steps, max_jumps=limits.max_jumps,
                            max_jumps_per_step=max(1, limits.max_jumps))
        runner = HybridAgent(model, reg, kernel=kernel, limits=limits, tool_choice=tool_choice, seed=seed,
                             record_states=states, controllers=controllers, parallel_tool_calls=parallel,
                             context=context_policy)
        import warnings

        from hybridlm.engine.trace import TraceWriteWarning

        with warnings.catch_warnings(record=True) as caught:  # a trace cut by a write error: one line, the answer stays
            warnings.simplefilter("always", TraceWriteWarning)
            arc = runner.run(task, trace=trace_path, observers=_watchers(model, stream, as_json))
        for w in caught:
            if issubclass(w.category, TraceWriteWarning):
                click.echo(f"[warning: {w.message}]", err=True)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if as_json:
        click.echo(json.dumps(arc.to_dict(), ensure_ascii=False))
        return
    servers = {t.name: t.server for t in reg}
    for j in [] if stream else arc.jumps:  # (streamed: each jump was written as it landed)
        status = f" [{j.error}]" if j.error else ""
        where = f" @{servers[j.tool]}" if servers.get(j.tool) else ""
        click.echo(f"  jump {j.k} at t={j.t}: {j.tool}{where}({json.dumps(j.arguments)}) → {j.observation[:120]}{status}",
                   err=True)
    click.echo(arc.answer)
    click.echo(f"[{arc.summary()}{', trace ' + trace_path if trace_path else ''}]", err=True)


def _watchers(model, stream: bool, as_json: bool) -> tuple:
    """What watches the run: the stream of tokens and jumps (--stream), else a live progress line
    where stderr is a terminal and the output is not JSON."""
    import sys

    from hybridlm.agent.watch import Progress, Stream

    err = sys.stderr
    if stream:
        return (Stream(model.tokenizer, err),)
    return (Progress(err),) if not as_json and err.isatty() else ()


def _plant_plan(name, speed, horizon, period, band) -> dict:
    """The plant options checked before anything slow starts."""
    import math

    from hybridlm.errors import InputError
    from hybridlm.plant import PLANTS

    if name not in PLANTS:
        raise InputError(f"--plant {name!r}: built-ins are {', '.join(PLANTS)}")
    for option, value in (("--plant-speed", speed), ("--horizon", horizon), ("--period", period)):
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{option} {value}: expected a finite number > 0")
    plan = {"name": name, "speed": speed, "horizon": horizon, "period": period, "band": {}}
    if band is not None:
        try:
            low, high = (float(v) for v in band.split(","))
        except ValueError:
            raise InputError(f"--band {band!r}: expected LOW,HIGH (two numbers)") from None
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise InputError(f"--band {band!r}: expected two finite numbers with LOW < HIGH")
        plan["band"] = {"low": low, "high": high}
    return plan


def _run_plant(model, reg, plan, task, *, kernel, limits, tool_choice, seed, cbf, trace_path, figure_path, as_json):
    from pathlib import Path

    from hybridlm.agent.supervisor import Supervisor
    from hybridlm.plant import WallClock, make_plant

    trace_path = trace_path or f"{plan['name']}-arc.jsonl"
    figure_path = figure_path or str(Path(trace_path).with_suffix(".png"))
    plant = make_plant(plan["name"], clock=WallClock(plan["speed"]), cbf=cbf, **plan["band"])
    supervisor = Supervisor(model, plant, horizon_s=plan["horizon"], period_s=plan["period"], limits=limits,
                            kernel=kernel, tool_choice=tool_choice, seed=seed, tools=reg)
    arc = supervisor.run(task, trace=trace_path, figure=figure_path)
    if as_json:
        click.echo(json.dumps(arc.to_dict(), ensure_ascii=False, default=str))
        return
    for d in arc.decisions:
        calls = ", ".join(f"{j['tool']}({json.dumps(j['arguments'])})" + (f" [{j['error']}]" if j["error"] else "")
                          for j in d.jumps) or "no call"
        click.echo(f"  decision {d.index} ({d.reason}) τ {d.tau0:6.1f} → {d.tau1:6.1f} s, {d.token_steps} token steps, "
                   f"{d.wall_s:.2f} s: {calls}", err=True)
    click.echo(arc.summary())
    click.echo(f"[trace {arc.trace}, figure {arc.figure}]", err=True)
