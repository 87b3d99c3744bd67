"""`hybridlm serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import click

from hybridlm.cli.options import (
    MODEL, MODEL_HELP, Device, chat_template_option, context_option, drop_without_grammar, mcp_options,
    precision_option, tool_call_parser_option, tool_registry, use_tool_call_parser, with_chat_template,
)


@click.command()
@click.option("--model", "-m", "model_spec", default=None, type=MODEL, help=MODEL_HELP)
@click.option("--served-model-name", "--model-id", "names", multiple=True, metavar="NAME[,NAME...]",
              help="The names clients may give in 'model' (repeatable or comma-separated; the first is the id "
                   "/v1/models lists first) [default: the model's name].")
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
@click.option("--prefill-chunk", default=None, show_default="the canonical grid's scale, 128",
              type=click.IntRange(min=0),
              help="Prompt tokens prefilled between two token steps of the running streams, at the start of a "
                   "context (deeper in it fewer, costing the same: a long prompt waits its turn chunk by chunk); "
                   "0: a prompt in one piece, the others waiting.")
@click.option("--max-jumps", default=3, show_default=True, type=click.IntRange(min=0),
              help="Jump horizon of a request's server-side tool calls.")
@click.option("--max-calls", default=3, show_default=True, type=click.IntRange(min=1),
              help="Call horizon of one assistant turn: the most calls it makes (parallel_tool_calls), whoever runs them.")
@click.option("--repeat-calls", is_flag=True,
              help="Let a turn make a call identical to one it made already (by default such a repeat ends the turn "
                   "unmade: a small model's loop).")
@click.option("--max-arcs", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Arcs kept for GET /v1/arcs/{id} (the oldest dropped first).")
@click.option("--allowed-hosts", default="", metavar="NAMES",
              help="Comma-separated host names the server answers besides its address and localhost (a name "
                   "behind a proxy; '*' for any). Other Host headers get 421 (DNS rebinding).")
@click.option("--allowed-origins", default="", metavar="ORIGINS",
              help="Comma-separated web origins (https://app.example) whose pages may call the server (CORS); "
                   "'*' for any. Other origins get 403.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="CPU threads of the model's arithmetic (torch's intra-op threads) [default: torch's].")
@click.option("--device", default="cpu", show_default=True, type=Device(), help="cpu, cuda or cuda:N.")
@mcp_options
@chat_template_option
@tool_call_parser_option
@precision_option("auto")
@context_option
def serve(model_spec, names, host, port, tools, kb, api_key, max_batch, max_queue, prefix_cache_mb,
          continuation_mb, max_body_mb, prefill_chunk, max_jumps, max_calls, repeat_calls, max_arcs, allowed_hosts,
          allowed_origins, log_level, threads, device, mcp, mcp_timeout, chat_template, precision, context_policy,
          tool_call_parser):
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, tools, streaming)."""
    from hybridlm.errors import InputError
    from hybridlm.server import Service, serve as run_server
    from hybridlm.weights.loading import load_model

    if api_key is not None and not api_key.strip():
        raise InputError("--api-key is empty: give a key, or leave the option out for no key")
    from hybridlm.server.run import bind

    hosts = tuple(h.strip() for h in allowed_hosts.split(",") if h.strip())
    origins = tuple(o.strip() for o in allowed_origins.split(",") if o.strip())
    for o in origins:
        if o != "*" and not o.startswith(("http://", "https://")):
            raise InputError(f"--allowed-origins {o!r}: expected an origin like https://app.example (or *)")
    served = [n.strip() for given in names for n in given.split(",")]
    if any(not n for n in served) or len(set(served)) != len(served):
        raise InputError(f"--served-model-name {','.join(served)!r}: expected distinct, non-empty names")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    try:  # the port is taken now, so that a busy one is named before the model loads
        sock = bind(host, port)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    with tool_registry(tools, kb=kb, mcp=mcp, timeout_s=mcp_timeout) as reg:
        name = served[0] if served else model_spec or "smollm2-135m"
        loaded = {}

        def load() -> Service:
            """The model loads while the HTTP server answers /health with 503 "loading"."""
            import torch

            from hybridlm.engine.prefill import SEGMENT

            where = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
            model = with_chat_template(load_model(model_spec, precision=precision, device=where), chat_template)
            use_tool_call_parser(model, tool_call_parser)
            drop_without_grammar(reg, model)
            loaded["precision"], loaded["device"], loaded["threads"] = model.precision, where, torch.get_num_threads()
            service = Service(model, model_id=tuple(served) or (name,), tools=reg if reg.tools else None,
                              max_batch=max_batch, max_queue=max_queue, prefix_cache_mb=prefix_cache_mb,
                              continuation_mb=continuation_mb, context=context_policy, max_jumps=max_jumps,
                              max_calls=max_calls, repeat_calls=repeat_calls, max_arcs=max_arcs,
                              prefill_chunk=SEGMENT if prefill_chunk is None else prefill_chunk)
            service.engine.warm_up()  # (still "loading": the first prefill's cost is not the first client's)
            return service

        def ready(bound_port: int) -> None:
            offered = ", ".join(t.name for t in reg) or "none"
            threads_used = f"{loaded['threads']} thread{'s' if loaded['threads'] != 1 else ''}"
            click.echo(f"[hybridlm serve: {name} ({loaded['precision']}, {loaded['device']}, {threads_used}) at "
                       f"http://{host}:{bound_port}/v1; "
                       f"server-side tools: {offered}]", err=True)
            if reg.tools and api_key is None and not _loopback(host):
                click.echo(f"warning: server-side tools ({offered}) run for anyone who reaches {host}:{bound_port}: "
                           "no --api-key is set", err=True)

        run_server(load, sock=sock, api_key=api_key, max_body_bytes=int(max_body_mb * 2**20),
                   log_level=log_level, allowed_hosts=hosts, allowed_origins=origins, on_ready=ready)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
