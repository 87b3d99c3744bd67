"""What the commands share: parameter types, option groups and the values they build.

Bad input (an empty prompt, an out-of-range token id, a decoding parameter outside its
domain, an unknown model, a broken weight file) ends with a one-line message and exit
code 2, never a traceback: `Group` turns hybridlm's input errors and click's usage errors
into that line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hybridlm.errors import HybridLMError, InputError
from hybridlm.tools.mcp import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from hybridlm.tools import ToolRegistry


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


class ChatTemplateFile(click.ParamType):
    """--chat-template: a Jinja chat template file, read and compiled before any model loads."""

    name = "file"

    def convert(self, value, param, ctx):
        from hybridlm.chat_template import compile_template

        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            self.fail(f"{value}: {getattr(exc, 'strerror', None) or exc}: expected a readable UTF-8 Jinja file", param, ctx)
        try:
            compile_template(text)
        except InputError as exc:
            self.fail(f"{value}: {exc}", param, ctx)
        return text


def chat_template_option(fn):
    """--chat-template FILE: the chat template to render conversations with instead of the model's own."""
    return click.option("--chat-template", "chat_template", type=ChatTemplateFile(), default=None, metavar="FILE",
                        help="A Jinja chat template (transformers' conventions) used instead of the model's own.")(fn)


def with_chat_template(model, template: str | None):
    """`model` with its tokenizer's chat template replaced by `template` (--chat-template), when given."""
    if template is not None:
        if model.tokenizer is None:
            raise InputError(f"--chat-template: the model {model.source} has no tokenizer to render with")
        model.tokenizer.chat_template = template
    return model


SEED, TEXT, MODEL = Seed(), Text(), ModelSpec()
OUTPUT_FILE, OUTPUT_FOLDER = Output("file", "writable"), Output("folder", "creatable_folder")


def control_options(fn):
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


def steering_vector(steer, steer_layer, steer_scale):
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


def build_controllers(model, ban, vector, steer_layer, steer_scale) -> list:
    """The controllers the control options ask for (empty: the uncontrolled system)."""
    out: list = []
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


def control_summary(controllers, step_records: list[list[dict]]) -> dict:
    masses = [r["removed_mass"] for recs in step_records for r in recs if r.get("removed_mass") is not None]
    return {
        "controllers": [c.describe() for c in controllers],
        "steps_filtered": sum(1 for recs in step_records if any("removed_mass" in r for r in recs)),
        "removed_mass_total": round(sum(masses), 6),
        "removed_mass_max": round(max(masses), 6) if masses else 0.0,
        "no_safe_steps": sum(1 for recs in step_records if any(r.get("no_safe_token") for r in recs)),
        "per_step": step_records,
    }


def kernel_options(fn):
    """--min-p, --repeat-penalty, --repeat-last-n: the kernel's inputs beyond τ, top-k and top-p
    (hybridlm.engine.sampling.Kernel), as llama.cpp names them."""
    fn = click.option("--repeat-last-n", type=click.IntRange(min=-1), default=64, show_default=True,
                      help="The repeat penalty's window: the last N tokens of the context (-1: all of it, 0: none).")(fn)
    fn = click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
                      help="Divide a positive logit (multiply a negative one) by R for tokens in the window (1: off).")(fn)
    fn = click.option("--min-p", type=float, default=0.0, show_default=True,
                      help="Keep the tokens with p ≥ M × the most likely token's p, M in [0, 1] (0: off).")(fn)
    return fn


def context_option(fn):
    """--context-policy: what happens at the context horizon T (hybridlm.engine.prefill.ContextPolicy)."""
    def parse(ctx, param, value):
        from hybridlm.engine.prefill import ContextPolicy  # (here: --help and the report need no PyTorch)

        return ContextPolicy.parse(value)

    return click.option("--context-policy", "context_policy", default="block", show_default=True, callback=parse,
                        help="At the horizon T: 'exact' (Π_T at every step past T, a rebuild each step) or "
                             "'block[:δ]' (cut to T − δ once, δ steps follow; δ = T/8 by default).")(fn)


def precision_option(default: str):
    """--precision: the weights' arithmetic (hybridlm.lm.quantize); auto is the grid they were stored on."""

    def add(fn):
        return click.option("--precision", default=default, show_default=True,
                            type=click.Choice(["auto", "float32", "bfloat16", "int8", "int4", "gguf"]),
                            help="float32 (exact), bfloat16, int8, int4 (GGUF's Q4_1 grid), gguf (every matrix on its "
                                 "GGUF file's own grid), or auto: the grid of the model's file (int4 for a Q4_0/Q4_1 "
                                 "GGUF such as the default model's, gguf for other quantised GGUF files such as "
                                 "Q4_K_M, else float32).")(fn)

    return add


MODEL_HELP = ("Model: a name (smollm2-135m, gpt2, random:gpt2, ...), a hub-layout folder or a .gguf file. "
              "Default: the embedded SmolLM2-135M-Instruct.")


def tool_call_parser_option(fn):
    """--tool-call-parser: the call format (hybridlm.turns.codecs), as vLLM's option of that name; `auto`
    reads it from the model's chat template."""
    from hybridlm.turns.codecs import CODECS

    return click.option("--tool-call-parser", "tool_call_parser", default="auto", show_default=True,
                        type=click.Choice(["auto", *CODECS]),
                        help="The tool-call format: auto (the chat template's, else the default tagged_json), or one "
                             "by name.")(fn)


def use_tool_call_parser(model, name: str | None):
    """The model, its call format overridden by `name` unless that is auto (hybridlm.turns.codec_for reads it)."""
    if name and name != "auto":
        from hybridlm.turns import codec_for

        codec_for(name=name)  # an unknown name: one line before any slow work
        model.tool_call_parser = name
    return model


def mcp_options(fn):
    """--mcp and --mcp-timeout: MCP tool servers beside the built-in tools (for `agent`, later `serve`)."""
    fn = click.option("--mcp-timeout", type=float, default=30.0, show_default=True,
                      help="Seconds an MCP tool call may take before it becomes a timeout observation.")(fn)
    fn = click.option("--mcp", "mcp", multiple=True,
                      help='An MCP server: a command ("python server.py") for stdio or an http(s)://…/mcp URL '
                           "(repeatable); its tools are offered beside --tools.")(fn)
    return fn


def drop_without_grammar(reg, model) -> None:
    """Leave out (and name) the MCP tools whose arguments the call grammar cannot write yet."""
    import warnings

    from hybridlm.turns import ToolNotOffered, codec_for, offerable

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ToolNotOffered)
        kept = offerable(reg, model.tokenizer, codec_for(model))
    for name in set(reg.tools) - set(kept.tools):
        del reg.tools[name]
    for w in caught:
        if issubclass(w.category, ToolNotOffered):
            click.echo(f"[note: {w.message}]", err=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def ray_options(fn):
    """--ray and --ray-address: where the shards of prompts or tasks run (hybridlm.distributed)."""
    fn = click.option("--ray-address", default=None, metavar="ADDRESS",
                      help="Run the shards as tasks of the Ray cluster at ADDRESS (host:port of its head node).")(fn)
    fn = click.option("--ray", "use_ray", is_flag=True,
                      help="Run the shards as Ray tasks: join the Ray instance running here, or start one.")(fn)
    return fn


def runs_on_ray(use_ray, ray_address, what: str, value) -> bool:
    """Whether the command runs on Ray; a sharding option without it is an error."""
    on_ray = bool(use_ray or ray_address)
    if value is not None and not on_ray:
        from hybridlm.errors import InputError

        raise InputError(f"{what} {value} splits the work for Ray: add --ray or --ray-address ADDRESS")
    return on_ray


@contextlib.contextmanager
def tool_registry(tools: str = "calculator", *, kb: str | Path | None = None, mcp: Sequence[str] = (),
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[ToolRegistry]:
    """The registry of the `--tools`, `--kb` and `--mcp` options (for `agent` and `serve`).

    `tools` is a comma-separated list of built-ins, or "none" for only the MCP servers' tools.
    """
    from hybridlm.tools import registry
    from hybridlm.tools.mcp import ServerSpec, check_timeout, mcp_tools

    names = [n.strip() for n in tools.split(",") if n.strip()]
    if not names:
        raise InputError(f"--tools {tools!r}: expected tool names (e.g. calculator,clock) or none")
    check_timeout(timeout_s, "--mcp-timeout")
    if names == ["none"]:
        names = []
    elif "none" in names:
        raise InputError(f"--tools {tools!r}: 'none' cannot be combined with other tools")
    specs = [ServerSpec.parse(s).text for s in mcp]  # every bad value named before any server starts
    reg = registry(names, kb=kb)
    if not specs:
        yield reg
        return
    with mcp_tools(specs, into=reg, timeout_s=timeout_s) as reg:
        yield reg
