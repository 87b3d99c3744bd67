"""`hybridlm bench`: speed beside the references, in one process."""

from __future__ import annotations

import click

from hybridlm.cli.options import MODEL, MODEL_HELP, OUTPUT_FILE, Device


@click.command()
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
@click.option("--sections", default="decode,prefill,latency,hooks,batch,agreement,rates", show_default=True,
              help="Which figures (also: layers, wall time per block).")
@click.option("--per-layer", is_flag=True, help="Add the wall time of each block, prefill and per decode step.")
@click.option("--no-references", is_flag=True, help="Skip transformers and llama.cpp.")
@click.option("--device", default=None, type=Device(), help="cpu or cuda [default: cuda when present].")
@click.option("--quick", is_flag=True, help="A smoke run: 1 repeat, 16 new tokens, short contexts.")
@click.option("--out", type=OUTPUT_FILE, default=None, help="Write the figures as JSON here.")
@click.option("--real", "real_models", default=None,
              help="Instead: the real-model bench of these GGUF models (comma-separated registry names or paths), "
                   "hybridlm on the file's grid beside llama.cpp, each side in its own process (peak RSS too); "
                   "--repeats rounds, --threads, --new-tokens, --prompt-tokens, --prefill-tokens, --contexts apply.")
def bench(model_spec, threads, repeats, new_tokens, prompt_tokens, prefill_tokens, contexts, precisions, batch,
          sections, per_layer, no_references, device, quick, out, real_models):
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

    if real_models:
        from hybridlm.bench.real import real_bench

        names = [n.strip() for n in real_models.split(",") if n.strip()]
        report = real_bench(names, threads=threads, rounds=repeats, new_tokens=new_tokens, prompt_tokens=prompt_tokens,
                            prefill_tokens=prefill_tokens, contexts=ints(contexts, "contexts"), log=click.echo)
        if out:
            write_report(report, out)
        return
    chosen = tuple(p.strip() for p in precisions.split(",") if p.strip())
    for p in chosen:
        if p not in PRECISIONS:
            raise InputError(f"precision {p!r}: expected one of {', '.join(PRECISIONS)}")
    known = BenchConfig.all_sections
    wanted = tuple(s.strip() for s in sections.split(",") if s.strip()) + (("layers",) if per_layer else ())
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
