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


class Group(click.Group):
    """Turns hybridlm's input errors into exit code 2 with the error's own message."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HybridLMError as exc:
            raise BadInput(str(exc)) from None


@click.group(cls=Group)
@click.version_option(package_name="hybridlm")
def cli() -> None:
    """Decoder-only language models as explicit hybrid dynamical systems."""


MODEL_HELP = "Model: a name (smollm2-135m, gpt2, random:gpt2, ...), a hub-layout folder or a .gguf file. Default: the embedded SmolLM2-135M-Instruct."


@cli.command()
@click.argument("prompt")
@click.option("--model", "-m", "model_spec", default=None, help=MODEL_HELP)
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(min=0))
@click.option("--greedy", is_flag=True, help="Greedy decoding (the limit τ → 0).")
@click.option("--temperature", "-t", type=float, default=None, help="Temperature τ > 0 [default: 1].")
@click.option("--top-k", type=int, default=None, help="Keep the K most likely tokens (K ≥ 1).")
@click.option("--top-p", type=float, default=None, help="Nucleus: keep the smallest set of mass ≥ P, P in (0, 1].")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampler (and of random weights).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template; stop at end of turn.")
@click.option("--ids", "as_ids", is_flag=True, help="PROMPT is a list of token ids (comma or space separated).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(prompt, model_spec, max_new_tokens, greedy, temperature, top_k, top_p, seed, chat, as_ids, as_json):
    """Run the token-clock recursion from PROMPT and print the continuation."""
    from hybridlm.errors import InputError
    from hybridlm.kernel import Kernel
    from hybridlm.loading import load_model
    from hybridlm.recursion import token_clock

    if greedy and temperature is not None:
        raise InputError("--greedy and --temperature exclude each other: greedy is the limit τ → 0")
    kernel = Kernel(temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p, greedy=greedy)
    if not as_ids and not prompt.strip():
        raise InputError("empty prompt: give some text (or token ids with --ids)")
    t0 = time.perf_counter()
    model = load_model(model_spec, seed=seed)
    load_s = time.perf_counter() - t0
    tok = model.tokenizer
    prompt_ids = _prompt_ids(prompt, model, as_ids=as_ids, chat=chat)

    steps, shown = [], ""
    t0 = time.perf_counter()
    for step in token_clock(model, prompt_ids, kernel=kernel, max_new_tokens=max_new_tokens, seed=seed):
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
            "stop_reason": "stop_token" if steps and steps[-1].stop else "budget",
            "kernel": kernel.describe(),
            "seed": seed,
            "rebuilds": sum(s.rebuilt for s in steps),
            "load_s": round(load_s, 3),
            "wall_s": round(gen_s, 3),
            "tokens_per_s": round(len(steps) / gen_s, 2) if steps and gen_s > 0 else None,
        }
        click.echo(json.dumps(out, ensure_ascii=False))
    else:
        if tok is None:
            click.echo(" ".join(map(str, generated)), nl=False)
        click.echo()
        click.echo(
            f"[{len(steps)} token steps, {gen_s:.2f} s, {len(steps) / max(gen_s, 1e-9):.1f} tok/s, "
            f"{kernel.describe()}, model {model.source}]",
            err=True,
        )


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def models(as_json):
    """List the models available on this machine and where each comes from."""
    from hybridlm.loading import available_models

    rows = available_models()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "✓" if r["available"] else "✗"
        default = " (default)" if r["default"] else ""
        click.echo(f"{mark} {r['name']:<{width}}  {r['family']:<6} {r['source']}{default}")


def _prompt_ids(prompt: str, model, *, as_ids: bool, chat: bool) -> list[int]:
    from hybridlm.alphabet import check_tokens
    from hybridlm.errors import InputError

    tok = model.tokenizer
    if as_ids:
        parts = prompt.replace(",", " ").split()
        try:
            ids = [int(p) for p in parts]
        except ValueError:
            raise InputError(f"--ids expects integers separated by commas or spaces, got {prompt!r}") from None
    else:
        if tok is None:
            raise InputError(f"model {model.source} has no tokenizer: pass token ids with --ids")
        text = tok.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode(text)
    check_tokens(ids, model.config.vocab_size)
    return ids


def _visible(steps, tok) -> list[int]:
    """Generated ids without a final stop token (it is not part of the answer)."""
    ids = [s.token for s in steps]
    return ids[:-1] if steps and steps[-1].stop else ids


def main() -> None:
    cli(prog_name="hybridlm")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
