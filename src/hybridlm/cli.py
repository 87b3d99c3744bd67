"""The `hybridlm` command line.

Bad input (an empty prompt, an out-of-range token id, a decoding parameter outside its
domain, an unknown model, a broken weight file) ends with a one-line message and exit
code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
import time

import click

from hybridlm.errors import HybridLMError


class BadInput(click.ClickException):
    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the message held


class Group(click.Group):
    """Turns hybridlm's input errors, and click's usage errors of the subcommands, into one line
    and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HybridLMError as exc:
            raise BadInput(str(exc)) from None
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            raise BadInput(f"{exc.format_message()} (see '{where} --help')") from None
        except KeyboardInterrupt:  # Ctrl-C: the shell's convention, 128 + SIGINT (click would say 1)
            click.echo("[interrupted]", err=True)
            ctx.exit(130)


class Seed(click.ParamType):
    """A seed of the sampler: an integer in [0, 2⁶⁴), the range of torch.Generator.manual_seed."""

    name = "seed"
    MAX = 2**64 - 1

    def convert(self, value, param, ctx):
        try:
            seed = value if isinstance(value, int) else int(str(value).strip())
        except ValueError:
            self.fail(f"{str(value)[:40]!r}: expected an integer 0 ≤ seed ≤ 2^64 − 1", param, ctx)
        if not 0 <= seed <= self.MAX:
            self.fail(f"{str(seed)[:40]}: expected an integer 0 ≤ seed ≤ 2^64 − 1 = {self.MAX}", param, ctx)
        return seed


class Text(click.ParamType):
    """Text that must be valid UTF-8 (the shell hands undecodable bytes over as lone surrogates)."""

    name = "text"

    def convert(self, value, param, ctx):
        value = str(value)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = value[exc.start]
            byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"U+{ord(char):04X}"
            self.fail(f"not valid UTF-8 text: {byte} at character {exc.start}", param, ctx)
        return value


class Output(click.ParamType):
    """A file (or folder) to write: opened (or made) before any model loads, with `check`'s reason
    (hybridlm.files) when it cannot be."""

    def __init__(self, name: str, check: str) -> None:
        self.name, self.check = name, check

    def convert(self, value, param, ctx):
        from hybridlm import files

        why = getattr(files, self.check)(value)
        if why is not None:
            self.fail(why, param, ctx)
        return str(value)


class Device(click.ParamType):
    """A torch device: auto, cpu, cuda or cuda:N (here: one this machine has, unless `remote`,
    where the workers' devices count)."""

    name = "device"

    def __init__(self, remote: bool = False) -> None:
        self.remote = remote

    def convert(self, value, param, ctx):
        import re

        text = str(value).strip().lower()
        if text in ("auto", "cpu"):
            return text
        m = re.fullmatch(r"cuda(?::(\d{1,3}))?", text)
        if m is None:
            self.fail(f"{str(value)[:40]!r}: expected auto, cpu, cuda or cuda:N", param, ctx)
        if not self.remote:
            import torch

            index = int(m.group(1) or 0)
            if not torch.cuda.is_available():
                self.fail(f"{value}: this machine has no CUDA device (or torch was built without CUDA)", param, ctx)
            if index >= torch.cuda.device_count():
                self.fail(f"{value}: this machine has {torch.cuda.device_count()} CUDA device(s)", param, ctx)
        return text


class ModelSpec(click.ParamType):
    """--model: a name, a folder or a .gguf file; an empty value is refused before anything loads
    (as a path it would be the current folder)."""

    name = "model"

    def convert(self, value, param, ctx):
        if not str(value).strip():
            self.fail(f"{value!r}: expected a model name (hybridlm models lists them), a folder or a .gguf file",
                      param, ctx)
        return value


SEED, TEXT, MODEL = Seed(), Text(), ModelSpec()
OUTPUT_FILE, OUTPUT_FOLDER = Output("file", "writable"), Output("folder", "creatable_folder")


@click.group(cls=Group)
@click.version_option(package_name="hybridlm")
def cli() -> None:
    """Decoder-only language models as explicit hybrid dynamical systems."""


def _control_options(fn):
    """--ban, --steer, --steer-layer, --steer-scale: the control inputs of `generate` and `agent`."""
    fn = click.option("--steer-scale", type=float, default=1.0, show_default=True,
                      help="α in u = α v: the steering input's gain (finite; 0 = no input).")(fn)
    fn = click.option("--steer-layer", type=int, default=None,
                      help="Layer ℓ of H⁽ℓ⁾ the vector is added to (0 = embedding) [default: the file's].")(fn)
    fn = click.option("--steer", type=click.Path(dir_okay=False), default=None,
                      help="Steering vector file (from `hybridlm steer build`): adds α v to the residual stream.")(fn)
    fn = click.option("--ban", default=None, type=TEXT,
                      help="Comma-separated words the text must never contain (a control-barrier safety filter).")(fn)
    return fn


def _steering_vector(steer, steer_layer, steer_scale):
    """The steering vector of --steer, read and checked before the model loads (None: no steering)."""
    import math

    from hybridlm.errors import InputError

    if steer is None:
        if steer_layer is not None or steer_scale != 1.0:
            raise InputError("--steer-layer and --steer-scale need a steering vector: add --steer FILE")
        return None
    from hybridlm.control import ContrastVector

    if not math.isfinite(steer_scale):
        raise InputError(f"--steer-scale {steer_scale}: expected a finite number")
    return ContrastVector.load(steer)


def _controllers(model, ban, vector, steer_layer, steer_scale) -> list:
    """The controllers the control options ask for (empty: the uncontrolled system)."""
    out = []
    if vector is not None:
        from hybridlm.control import Steering

        steering = Steering(vector, layer=steer_layer, scale=steer_scale)
        steering.hooks(model)  # checks width and layer now, before any generation
        if vector.model and vector.model != model.source:
            click.echo(f"[note: the steering vector was built on {vector.model}, used on {model.source}]", err=True)
        out.append(steering)
    if ban is not None:
        from hybridlm.control import ban_words

        out.append(ban_words([w for w in ban.split(",")], model.tokenizer))
    return out


def _control_summary(controllers, step_records: list[list[dict]]) -> dict:
    masses = [r["removed_mass"] for recs in step_records for r in recs if r.get("removed_mass") is not None]
    return {
        "controllers": [c.describe() for c in controllers],
        "steps_filtered": sum(1 for recs in step_records if any("removed_mass" in r for r in recs)),
        "removed_mass_total": round(sum(masses), 6),
        "removed_mass_max": round(max(masses), 6) if masses else 0.0,
        "no_safe_steps": sum(1 for recs in step_records if any(r.get("no_safe_token") for r in recs)),
        "per_step": step_records,
    }


def _context_option(fn):
    """--context-policy: what happens at the context horizon T (hybridlm.engine.prefill.ContextPolicy)."""
    from hybridlm.engine.prefill import ContextPolicy

    def parse(ctx, param, value):
        return ContextPolicy.parse(value)

    return click.option("--context-policy", "context_policy", default="block", show_default=True, callback=parse,
                        help="At the horizon T: 'exact' (Π_T at every step past T, a rebuild each step) or "
                             "'block[:δ]' (cut to T − δ once, δ steps follow; δ = T/8 by default).")(fn)


MAX_CONSTRAINT_BYTES = 8 * 2**20  # a schema or grammar file larger than this is not one


def _flag(kind: str) -> str:
    return "--" + kind.replace("_", "-")


def _constraint_source(schema_file, regex, grammar_file):
    """(kind, source) of the output constraint asked for, read and checked before the model loads."""
    from hybridlm.constraints.library import json_grammar, lark_grammar, regex_grammar, validate
    from hybridlm.errors import InputError
    from hybridlm.files import read_text

    if regex == "":
        raise InputError("--regex '': expected a pattern (an empty one would constrain nothing)")
    given = [(k, v) for k, v in (("json_schema", schema_file), ("regex", regex), ("grammar", grammar_file)) if v]
    if len(given) > 1:
        raise InputError(f"{' and '.join(_flag(k) for k, _ in given)} exclude each other: "
                         "give one constraint")
    if not given:
        return None
    kind, value = given[0]
    if kind == "regex":
        validate(regex_grammar(value), "--regex")
        return kind, value
    text = read_text(value, _flag(kind), max_bytes=MAX_CONSTRAINT_BYTES)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except RecursionError:
            raise InputError(f"--json-schema {value}: nested too deeply to read") from None
        except ValueError as exc:
            raise InputError(f"--json-schema {value}: not JSON ({exc})") from None
        validate(json_grammar(schema), "--json-schema")  # the schema's own errors before the model loads
        return kind, schema
    validate(lark_grammar(text), "--grammar")
    return kind, text


def _constraint(source, model, budget: int):
    if source is None:
        return None
    from hybridlm.constraints import grammar_constraint, json_schema_constraint, regex_constraint
    from hybridlm.errors import InputError

    if model.tokenizer is None:
        raise InputError(f"model {model.source} has no tokenizer: a constraint needs one")
    kind, value = source
    build = {"json_schema": json_schema_constraint, "regex": regex_constraint, "grammar": grammar_constraint}[kind]
    constraint = build(model.tokenizer, value, budget=max(budget, 1), vocab_size=model.config.vocab_size)
    shortest = constraint.shortest_completion()
    if shortest is not None and shortest > budget:
        raise InputError(f"--max-new-tokens {budget} cannot hold a value of the {_flag(kind)} constraint: its "
                         f"shortest completion found takes {shortest} tokens")
    return constraint


def _precision_option(default: str):
    """--precision: the weights' arithmetic (hybridlm.lm.quantize); auto is the grid they were stored on."""

    def add(fn):
        return click.option("--precision", default=default, show_default=True,
                            type=click.Choice(["auto", "float32", "bfloat16", "int8", "int4"]),
                            help="float32 (exact), bfloat16, int8, int4 (GGUF's Q4_1 grid), or auto: the grid of the "
                                 "model's file (int4 for a Q4_0/Q4_1 GGUF such as the default model's, else float32).")(fn)

    return add


MODEL_HELP = "Model: a name (smollm2-135m, gpt2, random:gpt2, ...), a hub-layout folder or a .gguf file. Default: the embedded SmolLM2-135M-Instruct."


@cli.command()
@click.argument("prompt", type=TEXT)
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(min=0))
@click.option("--greedy", is_flag=True, help="Greedy decoding (the limit τ → 0).")
@click.option("--temperature", "-t", type=float, default=None, help="Temperature τ > 0 [default: 1].")
@click.option("--top-k", type=int, default=None, help="Keep the K most likely tokens (K ≥ 1).")
@click.option("--top-p", type=float, default=None, help="Nucleus: keep the smallest set of mass ≥ P, P in (0, 1].")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="Subtract A × (times the token was generated) from its logit (OpenAI's frequency penalty).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="Subtract A from the logit of every token generated at least once (OpenAI's presence penalty).")
@click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS",
              help="Add BIAS to the logit of token ID (repeatable; -100 bans it in effect).")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the sampler (and of random weights).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template; stop at end of turn.")
@click.option("--ids", "as_ids", is_flag=True, help="PROMPT is a list of token ids (comma or space separated).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--json-schema", "schema_file", type=click.Path(dir_okay=False), default=None,
              help="Constrain the output to one JSON value valid under the schema in this file.")
@click.option("--regex", default=None, type=TEXT, help="Constrain the output to match this regular expression whole.")
@click.option("--grammar", "grammar_file", type=click.Path(dir_okay=False), default=None,
              help="Constrain the output to a grammar in llguidance's Lark format (this file).")
@_precision_option("auto")
@_context_option
@_control_options
def generate(prompt, model_spec, max_new_tokens, greedy, temperature, top_k, top_p, frequency_penalty, presence_penalty,
             logit_bias, seed, chat, as_ids, as_json, schema_file, regex, grammar_file, precision, context_policy, ban,
             steer, steer_layer, steer_scale):
    """Run the token-clock recursion from PROMPT and print the continuation."""
    from hybridlm.errors import InputError
    from hybridlm.engine.clock import sequence, stream
    from hybridlm.engine.sampling import Kernel
    from hybridlm.weights.loading import load_model

    constraint_source = _constraint_source(schema_file, regex, grammar_file)  # read before the model loads
    vector = _steering_vector(steer, steer_layer, steer_scale)
    given_ids = _parse_ids(prompt) if as_ids else None
    if greedy and temperature is not None:
        raise InputError("--greedy and --temperature exclude each other: greedy is the limit τ → 0")
    kernel = Kernel(temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                    logit_bias=_logit_bias(logit_bias))
    if not as_ids and not prompt.strip():
        raise InputError("empty prompt: give some text (or token ids with --ids)")
    t0 = time.perf_counter()
    model = load_model(model_spec, seed=seed, precision=precision)
    load_s = time.perf_counter() - t0
    tok = model.tokenizer
    prompt_ids = _prompt_ids(prompt, model, ids=given_ids, chat=chat)
    if kernel.logit_bias and kernel.logit_bias[-1][0] >= model.config.vocab_size:
        raise InputError(f"--logit-bias: token {kernel.logit_bias[-1][0]} is not below the vocabulary size "
                         f"{model.config.vocab_size}")
    controllers = _controllers(model, ban, vector, steer_layer, steer_scale)
    constraint = _constraint(constraint_source, model, max_new_tokens)
    s = sequence(model, prompt_ids, kernel=kernel, max_new_tokens=max_new_tokens, seed=seed, controllers=controllers,
                 constraint=constraint)

    steps, shown = [], ""
    t0 = time.perf_counter()
    for step in stream(model, s, context=context_policy):
        steps.append(step)
        if not as_json and tok is not None:
            text = tok.decode(_visible(steps, tok))
            if not text.endswith("\ufffd"):
                click.echo(text[len(shown):], nl=False)
                shown = text
    gen_s = time.perf_counter() - t0
    generated = [s.token for s in steps]
    text = tok.decode(_visible(steps, tok)) if tok is not None else None
    if as_json:
        out = {
            "model": model.source,
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "text": text,
            "token_steps": len(steps),
            "stop_reason": s.arc.termination.value,
            "kernel": kernel.describe(),
            "constraint": None if constraint is None else constraint.describe(),
            "context_policy": context_policy.describe(),
            "seed": seed,
            "rebuilds": sum(s.rebuilt for s in steps),
            "load_s": round(load_s, 3),
            "wall_s": round(gen_s, 3),
            "tokens_per_s": round(len(steps) / gen_s, 2) if steps and gen_s > 0 else None,
        }
        if constraint is not None:
            out["constraint_complete"] = constraint.accepting
        if controllers:
            out["control"] = _control_summary(controllers, [list(s.control) for s in steps])
        click.echo(json.dumps(out, ensure_ascii=False))
    else:
        if tok is None:
            click.echo(" ".join(map(str, generated)), nl=False)
        click.echo()
        sys.stdout.flush()
        click.echo(
            f"[{len(steps)} token steps, {gen_s:.2f} s, {len(steps) / max(gen_s, 1e-9):.1f} tok/s, "
            f"{kernel.describe()}, model {model.source}]",
            err=True,
        )
        if controllers:
            c = _control_summary(controllers, [list(s.control) for s in steps])
            click.echo(f"[control: {c['steps_filtered']} steps filtered, removed mass {c['removed_mass_total']:.3f} "
                       f"in total, {c['no_safe_steps']} steps with no safe token]", err=True)
        if constraint is not None and not constraint.accepting:
            click.echo("[warning: the output ends before the constraint's value is complete "
                       f"({s.arc.termination.value})]", err=True)


def _mcp_options(fn):
    """--mcp and --mcp-timeout: MCP tool servers beside the built-in tools (for `agent`, later `serve`)."""
    fn = click.option("--mcp-timeout", type=float, default=30.0, show_default=True,
                      help="Seconds an MCP tool call may take before it becomes a timeout observation.")(fn)
    fn = click.option("--mcp", "mcp", multiple=True,
                      help='An MCP server: a command ("python server.py") for stdio or an http(s)://…/mcp URL '
                           "(repeatable); its tools are offered beside --tools.")(fn)
    return fn


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


@cli.command()
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
@click.option("--max-jumps", default=None, type=click.IntRange(min=0), help="Jump horizon [default: 3; per decision with --plant: 2].")
@click.option("--max-new-tokens", "-n", default=None, type=click.IntRange(min=1),
              help="Token budget of the whole arc [default: 160; per decision with --plant: 40].")
@click.option("--temperature", "-t", type=float, default=None, help="Sample at τ > 0 (default: greedy).")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--trace", "trace_path", type=OUTPUT_FILE, default=None,
              help="Write the hybrid arc to this JSONL file as it happens [with --plant: default PLANT-arc.jsonl].")
@click.option("--states", is_flag=True, help="With --trace: also save the final-layer state of each token (safetensors).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_mcp_options
@_plant_options
@_precision_option("auto")
@_context_option
@_control_options
def agent(task, model_spec, tools, kb, tool_choice, parallel, max_jumps, max_new_tokens, temperature, seed,
          trace_path, states, as_json, mcp, mcp_timeout, plant_name, plant_speed, cbf, horizon, period, band,
          figure_path, precision, context_policy, ban, steer, steer_layer, steer_scale):
    """Run TASK through the agentic hybrid automaton (generate ⇄ external modes)."""
    from hybridlm.agent import HybridAgent, Limits
    from hybridlm.agent.mcp import tool_registry
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
    vector = _steering_vector(steer, steer_layer, steer_scale)
    if states and trace_path is None:
        raise InputError("--states saves each token's state beside the trace: add --trace FILE")
    with tool_registry(tools or ("none" if plant_name else "calculator"), kb=kb, mcp=mcp,
                       timeout_s=mcp_timeout) as reg:
        if tool_choice not in ("auto", "required", "none", *reg.tools):
            raise InputError(f"--tool-choice {tool_choice!r}: expected auto, required, none or one of the tools "
                             f"{sorted(reg.tools)[:8]}")
        model = load_model(model_spec, seed=seed, precision=precision)
        controllers = _controllers(model, ban, vector, steer_layer, steer_scale)
        _drop_without_grammar(reg, model)
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
        arc = runner.run(task, trace=trace_path)
    if as_json:
        click.echo(json.dumps(arc.to_dict(), ensure_ascii=False))
        return
    servers = {t.name: t.server for t in reg}
    for j in arc.jumps:
        status = f" [{j.error}]" if j.error else ""
        where = f" @{servers[j.tool]}" if servers.get(j.tool) else ""
        click.echo(f"  jump {j.k} at t={j.t}: {j.tool}{where}({json.dumps(j.arguments)}) → {j.observation[:120]}{status}",
                   err=True)
    click.echo(arc.answer)
    click.echo(f"[{arc.summary()}{', trace ' + trace_path if trace_path else ''}]", err=True)


def _drop_without_grammar(reg, model) -> None:
    """Leave out (and name) the MCP tools whose arguments the call grammar cannot write yet."""
    import warnings

    from hybridlm.agent.automaton import ToolNotOffered, offerable

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ToolNotOffered)
        kept = offerable(reg, model.tokenizer)
    for name in set(reg.tools) - set(kept.tools):
        del reg.tools[name]
    for w in caught:
        if issubclass(w.category, ToolNotOffered):
            click.echo(f"[note: {w.message}]", err=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


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


@cli.command()
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--model-id", default=None, help="The id clients name in 'model' [default: the model's name].")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (127.0.0.1: this machine only; 0.0.0.0 opens it to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@click.option("--tools", default="none", show_default=True,
              help="Server-side tools (calculator, clock, lookup), run by the server for requests that bring no "
                   "tools of their own; none for only --mcp's.")
@click.option("--kb", type=click.Path(dir_okay=False), default=None, help="JSON knowledge base for the lookup tool.")
@click.option("--api-key", envvar="HYBRIDLM_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* [env: HYBRIDLM_API_KEY].")
@click.option("--max-batch", default=32, show_default=True, type=click.IntRange(min=1),
              help="Sequences in one token step (the rest wait in the queue).")
@click.option("--max-queue", default=256, show_default=True, type=click.IntRange(min=0),
              help="Sequences waiting beyond the batch before requests get 503.")
@click.option("--prefix-cache-mb", default=256.0, show_default=True, type=click.FloatRange(min=0),
              help="Memory for cached prefix states (system prompts, tool lists, earlier turns).")
@click.option("--continuation-mb", default=256.0, show_default=True, type=click.FloatRange(min=0),
              help="Memory for the states of arcs stopped at a client-side tool call.")
@click.option("--max-body-mb", default=8.0, show_default=True, type=click.FloatRange(min=0.001),
              help="Largest request body (413 beyond).")
@click.option("--max-jumps", default=3, show_default=True, type=click.IntRange(min=0),
              help="Jump horizon of a request's server-side tool calls.")
@click.option("--max-arcs", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Arcs kept for GET /v1/arcs/{id} (the oldest dropped first).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@_mcp_options
@_precision_option("auto")
@_context_option
def serve(model_spec, model_id, host, port, tools, kb, api_key, max_batch, max_queue, prefix_cache_mb,
          continuation_mb, max_body_mb, max_jumps, max_arcs, log_level, mcp, mcp_timeout, precision, context_policy):
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, tools, streaming)."""
    from hybridlm.agent.mcp import tool_registry
    from hybridlm.errors import InputError
    from hybridlm.server import Service, serve as run_server
    from hybridlm.weights.loading import load_model

    if api_key is not None and not api_key.strip():
        raise InputError("--api-key is empty: give a key, or leave the option out for no key")
    from hybridlm.server.run import bind

    try:  # the port is taken now, so that a busy one is named before the model loads
        sock = bind(host, port)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    with tool_registry(tools, kb=kb, mcp=mcp, timeout_s=mcp_timeout) as reg:
        model = load_model(model_spec, precision=precision)
        _drop_without_grammar(reg, model)
        name = model_id or model_spec or "smollm2-135m"
        service = Service(model, model_id=name, tools=reg if reg.tools else None, max_batch=max_batch,
                          max_queue=max_queue, prefix_cache_mb=prefix_cache_mb, continuation_mb=continuation_mb,
                          context=context_policy, max_jumps=max_jumps, max_arcs=max_arcs)

        def ready(bound_port: int) -> None:
            served = ", ".join(t.name for t in reg) or "none"
            click.echo(f"[hybridlm serve: {name} ({model.precision}) at http://{host}:{bound_port}/v1; "
                       f"server-side tools: {served}]", err=True)

        run_server(service, sock=sock, api_key=api_key, max_body_bytes=int(max_body_mb * 2**20),
                   log_level=log_level, on_ready=ready)


@cli.group(cls=Group)
def steer():
    """Steering vectors: contrast vectors of residual states (activation steering)."""


@steer.command("build")
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--pos", "positive", multiple=True, required=True, type=TEXT, help="A prompt of the positive set (repeat).")
@click.option("--neg", "negative", multiple=True, required=True, type=TEXT, help="A prompt of the negative set (repeat).")
@click.option("--layer", type=int, required=True, help="Layer ℓ of H⁽ℓ⁾ (0 = embedding, L = after the last block).")
@click.option("--out", type=OUTPUT_FILE, required=True, help="Output file (.safetensors).")
def steer_build(model_spec, positive, negative, layer, out):
    """v = mean H⁽ℓ⁾ over the --pos prompts − mean over the --neg prompts; save it to OUT."""
    from hybridlm.control import contrast_vector
    from hybridlm.weights.loading import load_model

    model = load_model(model_spec)
    cv = contrast_vector(model, list(positive), list(negative), layer)
    cv.save(out)
    click.echo(f"wrote {out}: layer {layer}, ‖v‖ = {float(cv.vector.norm()):.3f}, d = {cv.vector.numel()}, "
               f"{len(cv.positive)} positive / {len(cv.negative)} negative prompts, model {cv.model}")


@cli.command()
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1), help="Interleaved repeats per figure.")
@click.option("--new-tokens", default=256, show_default=True, type=click.IntRange(min=1), help="Decode: new tokens.")
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(min=1), help="Decode: prompt length.")
@click.option("--prefill-tokens", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--contexts", default="64,256,1024", show_default=True, help="Latency: context lengths.")
@click.option("--precisions", default="bfloat16,int8,int4", show_default=True,
              help="Reduced-precision paths to run beside float32 (comma-separated; '' for none).")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(min=1), help="Batched generation: B.")
@click.option("--sections", default="decode,prefill,latency,hooks,batch,agreement", show_default=True)
@click.option("--no-references", is_flag=True, help="Skip transformers and llama.cpp.")
@click.option("--device", default=None, type=Device(), help="cpu or cuda [default: cuda when present].")
@click.option("--quick", is_flag=True, help="A smoke run: 1 repeat, 16 new tokens, short contexts.")
@click.option("--out", type=OUTPUT_FILE, default=None, help="Write the figures as JSON here.")
def bench(model_spec, threads, repeats, new_tokens, prompt_tokens, prefill_tokens, contexts, precisions, batch,
          sections, no_references, device, quick, out):
    """Speed beside the references (transformers, llama.cpp), in one process: a table and JSON."""
    from hybridlm.bench import BenchConfig, run_bench, write_report
    from hybridlm.errors import InputError
    from hybridlm.lm.quantize import PRECISIONS

    def ints(text: str, what: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise InputError(f"{what} {text!r}: expected comma-separated integers") from None
        if not values or min(values) < 2:
            raise InputError(f"{what} {text!r}: expected integers ≥ 2")
        return values

    chosen = tuple(p.strip() for p in precisions.split(",") if p.strip())
    for p in chosen:
        if p not in PRECISIONS:
            raise InputError(f"precision {p!r}: expected one of {', '.join(PRECISIONS)}")
    known = BenchConfig.sections
    wanted = tuple(s.strip() for s in sections.split(",") if s.strip())
    for s in wanted:
        if s not in known:
            raise InputError(f"section {s!r}: expected some of {', '.join(known)}")
    cfg = BenchConfig(model=model_spec, threads=threads, repeats=repeats, new_tokens=new_tokens,
                      prompt_tokens=prompt_tokens, prefill_tokens=prefill_tokens, contexts=ints(contexts, "contexts"),
                      precisions=chosen, batch=batch, references=not no_references, sections=wanted,
                      device=None if device == "auto" else device)
    if quick:
        cfg.repeats, cfg.new_tokens, cfg.prefill_tokens, cfg.latency_steps = 1, 16, 64, 4
        cfg.contexts, cfg.batch_new_tokens, cfg.agreement_tokens = (16, 64), 8, 64
        cfg.hook_rounds, cfg.hook_steps, cfg.hook_prefill_rounds, cfg.prefill_rounds = 2, 2, 1, 1
        cfg.prompt_tokens = min(cfg.prompt_tokens, 16)
    report = run_bench(cfg, log=click.echo)
    if out:
        write_report(report, out)
        click.echo(f"wrote {out}")


@cli.group(cls=Group)
def trace():
    """Read hybrid-arc traces."""


@trace.command("show")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--tokens", is_flag=True, help="One line per token step.")
def trace_show(file, tokens):
    """Print the arc recorded in FILE as a timeline."""
    from hybridlm.agent.trace import cut_warnings_to, format_timeline, read_trace

    with cut_warnings_to(lambda m: click.echo(f"[warning: {m}]", err=True)):
        click.echo(format_timeline(read_trace(file), tokens=tokens))


@trace.command("replay")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
def trace_replay(file, model_spec):
    """Re-run the arc of FILE with its seed (observations from the trace) and compare tokens."""
    from hybridlm.agent import replay
    from hybridlm.agent.trace import cut_short, cut_warnings_to, read_trace
    from hybridlm.weights.loading import load_model

    with cut_warnings_to(lambda m: click.echo(f"[warning: {m}]", err=True)):
        _check_replayable(file)  # the whole trace, before the model loads
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


@cli.command()
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

    from hybridlm.agent.trace import cut_warnings_to
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


def _ray_options(fn):
    """--ray and --ray-address: where the shards of prompts or tasks run (hybridlm.distributed)."""
    fn = click.option("--ray-address", default=None, metavar="ADDRESS",
                      help="Run the shards as tasks of the Ray cluster at ADDRESS (host:port of its head node).")(fn)
    fn = click.option("--ray", "use_ray", is_flag=True,
                      help="Run the shards as Ray tasks: join the Ray instance running here, or start one.")(fn)
    return fn


def _on_ray(use_ray, ray_address, what: str, value) -> bool:
    """Whether the command runs on Ray; a sharding option without it is an error."""
    on_ray = bool(use_ray or ray_address)
    if value is not None and not on_ray:
        from hybridlm.errors import InputError

        raise InputError(f"{what} {value} splits the work for Ray: add --ray or --ray-address ADDRESS")
    return on_ray


def _shard_done(run, result, done, total) -> None:
    ran = result.ran
    click.echo(f"  shard {done}/{total}: prompts {result.start}–{result.stop - 1} of {run.out.name}, "
               f"{ran.get('compute_s', 0):.1f} s on node {str(ran.get('node', '?'))[:8]}", err=True)


def _check_replayable(file) -> None:
    """Every event valid, and a start event replay can rebuild the run from (its kernel and limits built)."""
    import dataclasses

    from hybridlm.agent import Limits
    from hybridlm.agent.trace import check_event, iter_trace
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


@cli.group("eval", cls=Group)
def eval_group():
    """Built-in evaluations."""


@eval_group.command("agent")
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--n", "n", default=50, show_default=True, type=click.IntRange(min=1), help="Number of problems.")
@click.option("--modes", default="tools,no-tools", show_default=True)
@click.option("--out", type=OUTPUT_FILE, default=None, help="Write the full report as JSON.")
@click.option("--shard-size", type=click.IntRange(min=1), default=None,
              help="With Ray: problems per shard (a Ray task) [default: 5]. Finished shards are kept beside --out.")
@_precision_option("float32")
@_ray_options
def eval_agent(model_spec, n, modes, out, shard_size, precision, use_ray, ray_address):
    """Arithmetic word problems: accuracy with the calculator and without tools."""
    from hybridlm.agent.evaluation import MODES, evaluate
    from hybridlm.errors import InputError

    chosen = tuple(m.strip() for m in modes.split(","))
    if not set(chosen) <= set(MODES):
        raise InputError(f"--modes {modes!r}: expected tools, no-tools or both")
    on_ray = _on_ray(use_ray, ray_address, "--shard-size", shard_size)
    done = {"count": 0}

    def progress(mode, row):
        done["count"] += 1
        mark = "✓" if row["correct"] else "✗"
        click.echo(f"{mode:>8} {done['count']:>3} {mark} {row['expected']:>12} ← {row['answer'][:60]!r}", err=True)

    if on_ray:
        from hybridlm.distributed import evaluate_sharded, open_pool

        with open_pool(use_ray, ray_address) as pool:
            report = evaluate_sharded(model_spec, pool=pool, n=n, modes=chosen, shard_size=shard_size or 5,
                                      store=f"{out}.shards" if out else None, progress=progress, precision=precision)
    else:
        from hybridlm.weights.loading import load_model

        report = evaluate(load_model(model_spec, precision=precision), n=n, modes=chosen, progress=progress)
    for mode, r in report["modes"].items():
        click.echo(f"{mode:>8}: accuracy {r['accuracy']:.0%} ({round(r['accuracy'] * n)}/{n}), "
                   f"mean jumps {r['mean_jumps']:.2f}, mean wall {r['mean_wall_s']:.2f} s, "
                   f"mean token steps {r['mean_token_steps']:.1f}")
    if out:
        with open(out, "w") as fh:
            json.dump(report, fh, indent=2)


@eval_group.command("bfcl")
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--categories", default="simple_python,live_simple,multiple,parallel", show_default=True,
              help="BFCL categories, comma-separated.")
@click.option("--systems", default="constrained,free,llama.cpp", show_default=True,
              help="constrained (hybridlm), free (hybridlm, no mask in the call), llama.cpp (the reference).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="The first N tasks of each category.")
@click.option("--every", default=1, show_default=True, type=click.IntRange(min=1),
              help="Every K-th task of each category (a sample spread over the whole list); --limit counts these.")
@click.option("--out", type=OUTPUT_FILE, default="bfcl.jsonl", show_default=True,
              help="Results, one JSON line per task (appended as it goes).")
@click.option("--resume", is_flag=True, help="Continue --out: skip the tasks it already holds.")
@_precision_option("auto")
def eval_bfcl(model_spec, categories, systems, limit, every, out, resume, precision):
    """Berkeley Function Calling Leaderboard: BFCL's own data and AST checker (needs bfcl-eval)."""
    from pathlib import Path

    from tqdm import tqdm

    from hybridlm.agent import bfcl
    from hybridlm.errors import InputError

    chosen = [c.strip() for c in categories.split(",") if c.strip()]
    for c in chosen:
        if c not in bfcl.CATEGORIES:
            raise InputError(f"--categories: {c!r} is not one of {', '.join(bfcl.CATEGORIES)}")
    kinds = [s.strip() for s in systems.split(",") if s.strip()]
    for s in kinds:
        if s not in ("constrained", "free", "llama.cpp"):
            raise InputError(f"--systems: {s!r} is not one of constrained, free, llama.cpp")
    bfcl.data_dir()  # the install hint before any slow work
    if Path(out).exists() and not resume:
        raise InputError(f"--out {out} exists: add --resume to continue it, or choose another file")
    model = None
    for kind in kinds:
        if kind == "llama.cpp":
            runner = bfcl.LlamaCppRunner()
        else:
            if model is None:
                from hybridlm.weights.loading import load_model

                model = load_model(model_spec, precision=precision)
            runner = bfcl.HybridRunner(model, constrained=kind == "constrained")
        bfcl.evaluate(runner, chosen, limit=limit, every=every, out=out, resume=True,
                      progress=lambda n, name=runner.name: tqdm(total=n, desc=name, unit="task", file=sys.stderr))
    click.echo(bfcl.format_summary(bfcl.summary(out)))


@cli.command()
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--weights", type=click.Choice(["pretrained", "random-fixed", "random-redrawn"]), default="pretrained",
              show_default=True, help="Pretrained, random and fixed across passes, or redrawn every pass.")
@click.option("--attention-only", is_flag=True, help="Remove the MLP sublayer (eq. 0.41).")
@click.option("--prompts", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--passes", default=20, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--device", default="auto", show_default=True, type=Device(remote=True),
              help="cpu, cuda, or auto (cuda when present; on Ray, where the workers have one).")
@click.option("--out", type=OUTPUT_FOLDER, default=None, help="Output folder (CSV, JSON, PNG, checkpoint).")
@click.option("--table1", "sentence", default=None, type=TEXT, help="Print Table 1: the sentence decoded after 1, 2, 4, 10 passes.")
@click.option("--shard-prompts", type=click.IntRange(min=1), default=None,
              help="With Ray: prompts per shard (a Ray task) [default: 8]; the numbers do not depend on it.")
@_ray_options
def consensus(model_spec, weights, attention_only, prompts, prompt_len, passes, seed, device, out, sentence,
              shard_prompts, use_ray, ray_address):
    """Loop the blocks and measure consensus E(k) (survey eq. 0.45, Figs. 6–9, Table 1)."""
    from hybridlm.analysis.runner import ConsensusConfig, run_consensus
    from hybridlm.errors import InputError

    on_ray = _on_ray(use_ray, ray_address, "--shard-prompts", shard_prompts)
    if sentence is not None and on_ray:
        raise InputError("--table1 runs one sentence in this process: drop --ray / --ray-address")
    if not on_ray:  # on Ray, the workers' GPUs decide; here, this machine's
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            device = Device().convert(device, None, None)
    if sentence is not None:
        from hybridlm.analysis.consensus import table1
        from hybridlm.weights.loading import load_model

        if not sentence.strip():
            raise InputError("--table1 needs a sentence")
        model = load_model(model_spec, device=device)
        for row in table1(model, sentence, attention_only=attention_only):
            click.echo(f"{row['passes']:>3} passes  E={row['E']:.4f}  majority {row['majority_token']!r} "
                       f"{row['majority_share']:.0%}  │ {row['text']!r}")
        return
    if out is None:
        raise InputError("--out DIR is needed for a consensus run (or use --table1)")
    from hybridlm.weights.loading import DEFAULT_MODEL

    cfg = ConsensusConfig(model=model_spec or DEFAULT_MODEL, weights=weights, attention_only=attention_only,
                          prompts=prompts, prompt_len=prompt_len, passes=passes, seed=seed)
    if on_ray:
        from hybridlm.distributed import open_pool, run_consensus_sharded

        with open_pool(use_ray, ray_address, device=device) as pool:
            summary = run_consensus_sharded(cfg, out, pool=pool, shard_prompts=shard_prompts or 8,
                                            on_shard=_shard_done)
    else:
        summary = run_consensus(cfg, out, device=device)
    below = summary["first_layer_step_below_0.05"]
    click.echo(f"E: {summary['E_initial']:.4f} at k=0, {summary['E_after_first_pass']:.4f} after pass 1, "
               f"{summary['E_final']:.4f} after pass {passes} (k={summary['layer_steps']}); "
               f"first k with E < 0.05: {below if below is not None else 'never'}; wrote {out}")


@cli.command()
@click.argument("spec", type=click.Path(dir_okay=False, exists=True))
@click.option("--out", type=OUTPUT_FOLDER, required=True,
              help="Output folder: runs/<name>/ (each as `consensus --out` writes it), figures/, sweep.json.")
@click.option("--scale", default="survey", show_default=True,
              help="survey: the spec as written; or a scale the spec defines (e.g. small, minutes on a laptop).")
@click.option("--device", default="auto", show_default=True, type=Device(remote=True),
              help="cpu, cuda, or auto (cuda where the workers have one).")
@_ray_options
def sweep(spec, out, scale, device, use_ray, ray_address):
    """Run a grid of consensus runs from SPEC.yaml (e.g. the survey's Figs. 6–9); a restart resumes."""
    from hybridlm.distributed import load_sweep, open_pool, run_sweep

    plan = load_sweep(spec, scale)  # every mistake in the spec shows before any model loads

    def on_run(run, summary, done, total):
        below = summary["first_layer_step_below_0.05"]
        click.echo(f"[{done}/{total}] {run.name}: E {summary['E_initial']:.4f} → {summary['E_final']:.4f} "
                   f"(k={summary['layer_steps']}), first k with E < 0.05: {below if below is not None else 'never'}",
                   err=True)

    click.echo(f"{len(plan.runs)} runs at scale {plan.scale}", err=True)
    with open_pool(use_ray, ray_address, device=device) as pool:
        record = run_sweep(plan, out, pool, on_run=on_run, on_shard=_shard_done)
    click.echo(f"{len(record['runs'])} runs in {record['wall_s']:.1f} s on {record['pool']['kind']}; "
               f"figures: {', '.join(record['figures'].values()) or 'none'}; wrote {out}")


@cli.command()
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


@cli.group(cls=Group)
def survey():
    """Learning as optimal control, ResNets as ODEs, memorisation (survey eqs. 0.18–0.38)."""


def _survey_depths(text: str) -> list[int]:
    from hybridlm.errors import InputError

    try:
        depths = [int(p) for p in text.replace(",", " ").split()]
    except ValueError:
        raise InputError(f"--depths expects integers ℓ ≥ 2 separated by commas, got {text!r}") from None
    if len(depths) < 2:
        raise InputError(f"--depths {text!r}: expected at least two depths")
    return depths


def _survey_table(rows: list[tuple[str, str]], out) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")
    click.echo(f"wrote {out}")


@survey.command("adjoint")
@click.option("--out", type=OUTPUT_FOLDER, required=True, help="Output folder (JSON, PNG).")
@click.option("--depth", default=8, show_default=True, type=int, help="Layers ℓ (ℓ ≥ 2).")
@click.option("--width", default=6, show_default=True, type=int, help="Neurons n per layer.")
@click.option("--samples", default=16, show_default=True, type=int)
@click.option("--steps", default=300, show_default=True, type=int, help="Gradient-descent steps (0.32).")
@click.option("--lr", default=0.5, show_default=True, type=float, help="Step size η of (0.32).")
@click.option("--seed", default=0, show_default=True, type=SEED)
def survey_adjoint(out, depth, width, samples, steps, lr, seed):
    """Backpropagation as a discrete adjoint (0.24)–(0.34) and the costate (0.37)."""
    from hybridlm.optimal.runs import run_adjoint

    s = run_adjoint(out, depth=depth, width=width, samples=samples, steps=steps, lr=lr, seed=seed)
    rows = [("adjoint vs autograd, max rel. error", f"{s['max_gradient_error']:.2e}")]
    rows += [(f"costate {rule} vs adjoint", f"{e:.2e}") for rule, e in s["max_costate_error"].items()]
    rows += [(f"train {kind} (0.32)", f"loss {t['loss_before']:.4g} → {t['loss_after']:.4g}")
             for kind, t in s["training"].items()]
    _survey_table(rows, out)


@survey.command("euler")
@click.option("--out", type=OUTPUT_FOLDER, required=True, help="Output folder (JSON, PNG).")
@click.option("--depths", default="8,16,32,64,128", show_default=True, help="Depths ℓ, comma separated.")
@click.option("--width", default=4, show_default=True, type=int)
@click.option("--samples", default=8, show_default=True, type=int)
@click.option("--kind", type=click.Choice(["affine", "sinusoid"]), default="affine", show_default=True,
              help="W(t) = W0 + t W1, or W0 + sin(2πt) W1.")
@click.option("--seed", default=0, show_default=True, type=SEED)
def survey_euler(out, depths, width, samples, kind, seed):
    """ResNets as Euler discretisations: error (0.21) vs depth and log-log slopes."""
    from hybridlm.optimal.runs import run_euler

    s = run_euler(out, depths=_survey_depths(depths), width=width, samples=samples, seed=seed, kind=kind)
    _survey_table([(name, f"slope {s['slopes'][name]:+.3f}  error at ℓ={s['depths'][-1]}: {e[-1]:.2e}")
                   for name, e in s["errors"].items()], out)


@survey.command("memorise")
@click.option("--out", type=OUTPUT_FOLDER, required=True, help="Output folder (JSON, PNG).")
@click.option("--depths", default="2,4,8,16,32", show_default=True, help="Depths ℓ, comma separated.")
@click.option("--samples", default=12, show_default=True, type=int)
@click.option("--steps", default=300, show_default=True, type=int, help="Adam steps per depth.")
@click.option("--lr", default=0.05, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=SEED)
def survey_memorise(out, depths, samples, steps, lr, seed):
    """Memorisation as simultaneous control: one input steers all samples; error vs depth."""
    from hybridlm.optimal.runs import run_memorise

    s = run_memorise(out, depths=_survey_depths(depths), samples=samples, steps=steps, lr=lr, seed=seed)
    _survey_table([(f"ℓ = {r['depth']} (n = {r['width']})", f"max error {r['max_error']:.2e}  rms {r['rms_error']:.2e}")
                   for r in s["runs"]], out)


@survey.command("neural-ode")
@click.option("--out", type=OUTPUT_FOLDER, required=True, help="Output folder (JSON, PNG).")
@click.option("--steps", default=150, show_default=True, type=int, help="Adam steps.")
@click.option("--samples", default=64, show_default=True, type=int)
@click.option("--lr", default=0.02, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=SEED)
def survey_neural_ode(out, steps, samples, lr, seed):
    """A Neural ODE trained with torchdiffeq's adjoint solver; adjoint vs autograd gradient."""
    from hybridlm.optimal.runs import run_neural_ode

    s = run_neural_ode(out, steps=steps, samples=samples, lr=lr, seed=seed)
    _survey_table([("loss", f"{s['loss_before']:.4g} → {s['loss_after']:.4g} in {steps} steps"),
                   ("adjoint vs autograd, rel. error", f"{s['adjoint_vs_autograd']:.2e}")], out)


def _logit_bias(entries) -> dict[int, float]:
    """--logit-bias ID=BIAS entries as {id: bias}; one line naming a malformed entry."""
    from hybridlm.errors import InputError

    out = {}
    for entry in entries:
        token, sep, bias = entry.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(token)] = float(bias)
        except ValueError:
            raise InputError(f"--logit-bias {entry!r}: expected ID=BIAS, e.g. 50256=-100") from None
    return out


def _parse_ids(prompt: str) -> list[int]:
    """--ids: the prompt as token ids, read before the model loads (the vocabulary is checked after)."""
    from hybridlm.errors import InputError

    parts = prompt.replace(",", " ").split()
    if not parts:
        raise InputError(f"empty prompt: --ids expects token ids separated by commas or spaces, got {prompt[:40]!r}")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise InputError(f"--ids expects integers separated by commas or spaces, got {prompt[:60]!r}") from None
    negative = next((i for i in ids if i < 0), None)
    if negative is not None:
        raise InputError(f"--ids: token id {negative} is negative; ids count from 0")
    return ids


def _prompt_ids(prompt: str, model, *, ids: list[int] | None, chat: bool) -> list[int]:
    from hybridlm.alphabet import check_tokens
    from hybridlm.errors import InputError

    tok = model.tokenizer
    if ids is None:
        if tok is None:
            raise InputError(f"model {model.source} has no tokenizer: pass token ids with --ids")
        text = tok.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode_markup(text)
    check_tokens(ids, model.config.vocab_size)
    return ids


def _visible(steps, tok) -> list[int]:
    """Generated ids without a final stop token (it is not part of the answer)."""
    ids = [s.token for s in steps]
    return ids[:-1] if steps and steps[-1].stop else ids


def main() -> None:
    from hybridlm.memory import configure

    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    configure(long_running=command == "serve")  # the process is ours (see hybridlm.memory)
    cli(prog_name="hybridlm")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
