"""`hybridlm steer`: steering vectors (contrast vectors of residual states)."""

from __future__ import annotations

import click

from hybridlm.cli.options import MODEL, MODEL_HELP, OUTPUT_FILE, TEXT, Group


@click.group(cls=Group)
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
