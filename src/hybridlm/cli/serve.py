"""`hybridlm serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import click

from hybridlm.cli.options import (
    MODEL, MODEL_HELP, chat_template_option, context_option, drop_without_grammar, mcp_options, precision_option,
    tool_call_parser_option, tool_registry, use_tool_call_parser, with_chat_template,
)


@click.command()
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
@mcp_options
@chat_template_option
@tool_call_parser_option
@precision_option("auto")
@context_option
def serve(model_spec, model_id, host, port, tools, kb, api_key, max_batch, max_queue, prefix_cache_mb,
          continuation_mb, max_body_mb, max_jumps, max_arcs, log_level, mcp, mcp_timeout, chat_template, precision,
          context_policy, tool_call_parser):
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, tools, streaming)."""
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
        model = with_chat_template(load_model(model_spec, precision=precision), chat_template)
        use_tool_call_parser(model, tool_call_parser)
        drop_without_grammar(reg, model)
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
