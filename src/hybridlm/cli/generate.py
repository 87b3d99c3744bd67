"""`hybridlm generate`: the token-clock recursion from a prompt, with its kernel, constraint and control inputs."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from hybridlm.cli.options import (
    MODEL, MODEL_HELP, SEED, TEXT, build_controllers, chat_template_option, context_option, control_options, control_summary,
    precision_option, steering_vector, with_chat_template,
)


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
    builds: dict[str, Callable[..., Any]] = {"json_schema": json_schema_constraint, "regex": regex_constraint,
                                             "grammar": grammar_constraint}
    build = builds[kind]
    constraint = build(model.tokenizer, value, budget=max(budget, 1), vocab_size=model.config.vocab_size)
    shortest = constraint.shortest_completion()
    if shortest is not None and shortest > budget:
        raise InputError(f"--max-new-tokens {budget} cannot hold a value of the {_flag(kind)} constraint: its "
                         f"shortest completion found takes {shortest} tokens")
    return constraint


@click.command()
@click.argument("prompt", type=TEXT)
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(min=0))
@click.option("--greedy", is_flag=True, help="Greedy decoding (the limit τ → 0).")
@click.option("--temperature", "-t", type=float, default=None, help="Temperature τ > 0 [default: 1].")
@click.option("--top-k", type=int, default=None, help="Keep the K most likely tokens (K ≥ 1; 0: off, as llama.cpp).")
@click.option("--top-p", type=float, default=None, help="Nucleus: keep the smallest set of mass ≥ P, P in (0, 1].")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="Subtract A × (times the token was generated) from its logit (OpenAI's frequency penalty).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="Subtract A from the logit of every token generated at least once (OpenAI's presence penalty).")
@click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS",
              help="Add BIAS to the logit of token ID (repeatable; -100 bans it in effect).")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the sampler (and of random weights).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template; stop at end of turn.")
@chat_template_option
@click.option("--ids", "as_ids", is_flag=True, help="PROMPT is a list of token ids (comma or space separated).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--json-schema", "schema_file", type=click.Path(dir_okay=False), default=None,
              help="Constrain the output to one JSON value valid under the schema in this file.")
@click.option("--regex", default=None, type=TEXT, help="Constrain the output to match this regular expression whole.")
@click.option("--grammar", "grammar_file", type=click.Path(dir_okay=False), default=None,
              help="Constrain the output to a grammar in llguidance's Lark format (this file).")
@precision_option("auto")
@context_option
@control_options
def generate(prompt, model_spec, max_new_tokens, greedy, temperature, top_k, top_p, frequency_penalty, presence_penalty,
             logit_bias, seed, chat, chat_template, as_ids, as_json, schema_file, regex, grammar_file, precision,
             context_policy, ban,
             steer, steer_layer, steer_scale):
    """Run the token-clock recursion from PROMPT and print the continuation."""
    from hybridlm.errors import InputError
    from hybridlm.engine.clock import sequence, stream
    from hybridlm.engine.sampling import Kernel
    from hybridlm.weights.loading import load_model

    constraint_source = _constraint_source(schema_file, regex, grammar_file)  # read before the model loads
    vector = steering_vector(steer, steer_layer, steer_scale)
    given_ids = _parse_ids(prompt) if as_ids else None
    if greedy and temperature is not None:
        raise InputError("--greedy and --temperature exclude each other: greedy is the limit τ → 0")
    kernel = Kernel(temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                    logit_bias=_logit_bias(logit_bias))
    if not as_ids and not prompt.strip():
        raise InputError("empty prompt: give some text (or token ids with --ids)")
    t0 = time.perf_counter()
    model = with_chat_template(load_model(model_spec, seed=seed, precision=precision), chat_template)
    load_s = time.perf_counter() - t0
    tok = model.tokenizer
    prompt_ids = _prompt_ids(prompt, model, ids=given_ids, chat=chat)
    if kernel.logit_bias and kernel.logit_bias[-1][0] >= model.config.vocab_size:
        raise InputError(f"--logit-bias: token {kernel.logit_bias[-1][0]} is not below the vocabulary size "
                         f"{model.config.vocab_size}")
    controllers = build_controllers(model, ban, vector, steer_layer, steer_scale)
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
            out["control"] = control_summary(controllers, [list(s.control) for s in steps])
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
            c = control_summary(controllers, [list(s.control) for s in steps])
            click.echo(f"[control: {c['steps_filtered']} steps filtered, removed mass {c['removed_mass_total']:.3f} "
                       f"in total, {c['no_safe_steps']} steps with no safe token]", err=True)
        if constraint is not None and not constraint.accepting:
            click.echo("[warning: the output ends before the constraint's value is complete "
                       f"({s.arc.termination.value})]", err=True)


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
        # --chat: the prompt is a user's text inside the template's markup; without it, the prompt is the raw text
        # the model reads, markup included.
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode_markup(prompt)
    check_tokens(ids, model.config.vocab_size)
    return ids


def _visible(steps, tok) -> list[int]:
    """Generated ids without a final stop token (it is not part of the answer)."""
    ids = [s.token for s in steps]
    return ids[:-1] if steps and steps[-1].stop else ids
