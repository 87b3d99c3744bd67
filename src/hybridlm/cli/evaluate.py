"""`hybridlm eval`: the word-problem evaluation of the agent, and BFCL."""

from __future__ import annotations

import json
import sys

import click

from hybridlm.cli.options import (
    MODEL, MODEL_HELP, OUTPUT_FILE, Group, chat_template_option, precision_option, ray_options, runs_on_ray,
    tool_call_parser_option, use_tool_call_parser, with_chat_template,
)


@click.group("eval", cls=Group)
def eval_group():
    """Built-in evaluations."""


@eval_group.command("agent")
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--n", "n", default=50, show_default=True, type=click.IntRange(min=1), help="Number of problems.")
@click.option("--modes", default="tools,no-tools", show_default=True)
@click.option("--out", type=OUTPUT_FILE, default=None, help="Write the full report as JSON.")
@click.option("--shard-size", type=click.IntRange(min=1), default=None,
              help="With Ray: problems per shard (a Ray task) [default: 5]. Finished shards are kept beside --out.")
@precision_option("float32")
@chat_template_option
@tool_call_parser_option
@ray_options
def eval_agent(model_spec, n, modes, out, shard_size, precision, chat_template, use_ray, ray_address, tool_call_parser):
    """Arithmetic word problems: accuracy with the calculator and without tools."""
    from hybridlm.agent.evaluation import MODES, evaluate
    from hybridlm.errors import InputError

    chosen = tuple(m.strip() for m in modes.split(","))
    if not set(chosen) <= set(MODES):
        raise InputError(f"--modes {modes!r}: expected tools, no-tools or both")
    on_ray = runs_on_ray(use_ray, ray_address, "--shard-size", shard_size)
    if on_ray and chat_template is not None:
        raise InputError("--chat-template applies to a model loaded here: drop --ray (the workers load the model's own)")
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

        model = with_chat_template(load_model(model_spec, precision=precision), chat_template)
        use_tool_call_parser(model, tool_call_parser)
        report = evaluate(model, n=n, modes=chosen, progress=progress)
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
              help="constrained (hybridlm), free (hybridlm, no mask in the call), llama.cpp (the reference on the "
                   "same GGUF file: a model whose template takes tools is run on it and parsed as Hermes, strictly "
                   "and leniently; else llama-cpp-python's function calling).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="The first N tasks of each category.")
@click.option("--every", default=1, show_default=True, type=click.IntRange(min=1),
              help="Every K-th task of each category (a sample spread over the whole list); --limit counts these.")
@click.option("--out", type=OUTPUT_FILE, default="bfcl.jsonl", show_default=True,
              help="Results, one JSON line per task (appended as it goes).")
@click.option("--resume", is_flag=True, help="Continue --out: skip the tasks it already holds.")
@precision_option("auto")
@chat_template_option
@tool_call_parser_option
def eval_bfcl(model_spec, categories, systems, limit, every, out, resume, precision, chat_template, tool_call_parser):
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
            runners = bfcl.llama_cpp_runners(model_spec)
        else:
            if model is None:
                from hybridlm.weights.loading import load_model

                model = with_chat_template(load_model(model_spec, precision=precision), chat_template)
                use_tool_call_parser(model, tool_call_parser)
            runners = [bfcl.HybridRunner(model, constrained=kind == "constrained")]
        for runner in runners:
            bfcl.evaluate(runner, chosen, limit=limit, every=every, out=out, resume=True,
                          progress=lambda n, name=runner.name: tqdm(total=n, desc=name, unit="task", file=sys.stderr))
    click.echo(bfcl.format_summary(bfcl.summary(out)))
