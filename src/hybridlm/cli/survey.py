"""`hybridlm survey`: learning as optimal control, ResNets as ODEs, memorisation."""

from __future__ import annotations

import click

from hybridlm.cli.options import OUTPUT_FOLDER, SEED, Group


@click.group(cls=Group)
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
