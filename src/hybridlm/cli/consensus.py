"""`hybridlm consensus` and `hybridlm sweep`: the looped transformer's consensus E(k), alone or as a grid."""

from __future__ import annotations

import click

from hybridlm.cli.options import MODEL, MODEL_HELP, OUTPUT_FOLDER, SEED, TEXT, Device, ray_options, runs_on_ray


@click.command()
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--weights", type=click.Choice(["pretrained", "random-fixed", "random-redrawn"]), default="pretrained",
              show_default=True, help="Pretrained, random and fixed across passes, or redrawn every pass.")
@click.option("--attention-only", is_flag=True, help="Remove the MLP sublayer (eq. 0.41).")
@click.option("--block", type=click.Choice(["pre-norm", "sphere"]), default="pre-norm", show_default=True,
              help="The blocks as loaded, or the post-norm sphere block of eqs. 0.39-0.41.")
@click.option("--prompts", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--passes", default=20, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--device", default="auto", show_default=True, type=Device(remote=True),
              help="cpu, cuda, or auto (cuda when present; on Ray, where the workers have one).")
@click.option("--out", type=OUTPUT_FOLDER, default=None, help="Output folder (CSV, JSON, PNG, checkpoint).")
@click.option("--table1", "sentence", default=None, type=TEXT,
              help="Print Table 1: the sentence decoded after 1, 2, 4, 10 passes.")
@click.option("--shard-prompts", type=click.IntRange(min=1), default=None,
              help="With Ray: prompts per shard (a Ray task) [default: 8]; the numbers do not depend on it.")
@ray_options
def consensus(model_spec, weights, attention_only, block, prompts, prompt_len, passes, seed, device, out, sentence,
              shard_prompts, use_ray, ray_address):
    """Loop the blocks and measure consensus E(k) (survey eq. 0.45, Figs. 6–9, Table 1)."""
    from hybridlm.analysis.runner import ConsensusConfig, run_consensus
    from hybridlm.errors import InputError

    on_ray = runs_on_ray(use_ray, ray_address, "--shard-prompts", shard_prompts)
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
        from hybridlm.lm.sphere_block import select_block

        model = select_block(load_model(model_spec, device=device), block)
        for row in table1(model, sentence, attention_only=attention_only):
            click.echo(f"{row['passes']:>3} passes  E={row['E']:.4f}  majority {row['majority_token']!r} "
                       f"{row['majority_share']:.0%}  │ {row['text']!r}")
        return
    if out is None:
        raise InputError("--out DIR is needed for a consensus run (or use --table1)")
    from hybridlm.weights.loading import DEFAULT_MODEL

    cfg = ConsensusConfig(model=model_spec or DEFAULT_MODEL, weights=weights, attention_only=attention_only,
                          prompts=prompts, prompt_len=prompt_len, passes=passes, seed=seed, block=block)
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


@click.command()
@click.argument("spec", type=click.Path(dir_okay=False, exists=True))
@click.option("--out", type=OUTPUT_FOLDER, required=True,
              help="Output folder: runs/<name>/ (each as `consensus --out` writes it), figures/, sweep.json.")
@click.option("--scale", default="survey", show_default=True,
              help="survey: the spec as written; or a scale the spec defines (e.g. small, minutes on a laptop).")
@click.option("--device", default="auto", show_default=True, type=Device(remote=True),
              help="cpu, cuda, or auto (cuda where the workers have one).")
@ray_options
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


def _shard_done(run, result, done, total) -> None:
    ran = result.ran
    click.echo(f"  shard {done}/{total}: prompts {result.start}–{result.stop - 1} of {run.out.name}, "
               f"{ran.get('compute_s', 0):.1f} s on node {str(ran.get('node', '?'))[:8]}", err=True)
