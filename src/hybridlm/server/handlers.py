"""The endpoints' work between the wire and the engine: a request becomes sequences, their arcs
become a response or a stream of chunks (OpenAI's chat.completion, chat.completion.chunk,
text_completion objects).

A request with n choices is n sequences, choice i seeded with seed + i, each its own arc.
Its response names the arcs (`hybridlm.arcs`, and the `X-Hybridlm-Arcs` header), so
`GET /v1/arcs/{id}` returns the hybrid arc of every choice.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridlm.constraints import GrammarConstraint, json_schema_constraint, library
from hybridlm.engine.arc import Termination
from hybridlm.engine.clock import default_stops, sequence
from hybridlm.engine.sampling import Kernel
from hybridlm.engine.sequence import ArcState, Limits
from hybridlm.errors import HybridLMError, InputError
from hybridlm.server import chat as C
from hybridlm.server.guard import check_prompt_size
from hybridlm.server.service import Service
from hybridlm.server.wire import (
    STRUCTURED, APIError, ChatBody, CompletionBody, invalid, prompt_list, response_format_schema, stop_list, structured,
)
from hybridlm.turns import (
    TAGGED_JSON, CallCodec, Conversation, Offer, Protocol, View, codec_for, render, tool_call_constraint, turns_of,
)
from hybridlm.turns.system import state_tokens

FINISH: dict[Termination | None, str] = {
    Termination.STOP_TOKEN: "stop", Termination.STOP_SEQUENCE: "stop", Termination.CONSTRAINT: "stop",
    Termination.TOKEN_BUDGET: "length", Termination.JUMP_HORIZON: "length", Termination.JUMP_SET: "tool_calls",
    Termination.CANCELLED: "cancelled", Termination.ERROR: "error",
}


def finish_reason(s: ArcState) -> str:
    """OpenAI's finish reason of an ended choice; a choice cut short by the server says so ("cancelled")."""
    return FINISH.get(s.arc.termination, "cancelled")


@dataclass
class Prepared:
    """A request turned into sequences, with what its response needs."""

    kind: str  # "chat" or "completion"
    id: str
    created: int
    model: str
    sequences: list[ArcState]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token (0: the token's own only); None: off
    stops: tuple[str, ...] = ()
    offer: Offer | None = None  # what a chat request's turns offer
    client_tools: frozenset = frozenset()  # the offered tools whose jump map runs in the client
    codec: CallCodec = TAGGED_JSON  # the call format of the model's turns
    prompt_tokens: list[int] = field(default_factory=list)  # per sequence
    prompt_texts: list[str] = field(default_factory=list)  # completions with echo
    echo: bool = False
    n: int = 1  # choices per prompt
    continued_from: str | None = None
    received: float = field(default_factory=time.perf_counter)


# ---------------------------------------------------------------------- requests → sequences
def check_model(service: Service, model: str) -> None:
    if model not in service.names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in service.names)}",
                       param="model", code="model_not_found")


def _kernel(body, vocab: int) -> Kernel:
    """The request's sampling law: τ (0: greedy), top-p, top-k, min-p, and the penalties and logit
    bias that act on the logits (hybridlm.engine.sampling). llama.cpp's `repeat_penalty` acts on
    its last `repeat_last_n` tokens (64 unless given), vLLM's `repetition_penalty` on the whole context."""
    bias = body.logit_bias or {}
    for key in bias:
        if int(key) >= vocab:
            raise invalid(f"logit_bias key {key}: expected a token id < {vocab} (the vocabulary)", param="logit_bias")
    inputs: dict[str, Any] = dict(frequency_penalty=body.frequency_penalty or 0.0,
                                  presence_penalty=body.presence_penalty or 0.0, logit_bias=bias)
    if body.repetition_penalty is not None:
        inputs |= dict(repeat_penalty=body.repetition_penalty, repeat_last_n=-1)
    elif body.repeat_penalty is not None:
        inputs["repeat_penalty"] = body.repeat_penalty
    if body.repeat_last_n is not None and body.repetition_penalty is None:
        inputs["repeat_last_n"] = body.repeat_last_n
    try:
        if body.temperature == 0:
            return Kernel(greedy=True, **inputs)
        top_p = body.top_p if body.top_p is not None and body.top_p < 1 else None
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else None
        return Kernel(temperature=1.0 if body.temperature is None else body.temperature, top_p=top_p,
                      top_k=top_k, min_p=body.min_p or 0.0, **inputs)
    except InputError as exc:
        raise invalid(str(exc), param="temperature") from None


def output_grammar(tok, body) -> tuple[str, dict | bool | None, str | None]:
    """The output constraint of llama.cpp's and vLLM's structured-output fields: (the field, a JSON
    Schema or None, a compiled llguidance grammar or None). GBNF (llama.cpp's grammars, vLLM's
    EBNF) is read through llguidance's converter; what it cannot read is refused with the reason."""
    asked = structured(body)
    if asked is None:
        return "", None, None
    kind, value = asked
    param = next(k for k in STRUCTURED if getattr(body, k) is not None)
    try:
        if kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            library.json_grammar(schema)  # checked now: a bad schema is the request's error
            return param, schema, None
        if kind == "regex":
            grammar = library.regex_grammar(value)
        elif kind == "choice":
            if not all(isinstance(c, str) and c for c in value):
                raise invalid(f"{param}: expected non-empty strings", param=param)
            grammar = library.lark_grammar("start: " + " | ".join(json.dumps(c) for c in value))
        else:
            grammar = library.lark_grammar(_lark(value, param))
        library.matcher(library.library_tokenizer(tok), grammar, "the grammar")  # compiled now: its error is the field's
        return param, None, grammar
    except ValueError as exc:
        raise invalid(f"{param}: not JSON ({exc})", param=param) from None
    except InputError as exc:
        hint = " (a grammar is read as llguidance's Lark format, or as GBNF converted to it)" if kind == "grammar" else ""
        raise invalid(f"{param}: {exc}{hint}", param=param) from None


def _lark(text: str, param: str) -> str:
    """A grammar as Lark: GBNF (rules written `name ::= ...`) converted by llguidance."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if "::=" not in text:
        return text
    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain Exception (an unknown rule) beside its own
        raise invalid(f"{param}: this GBNF grammar could not be converted ({str(exc)[:160]}); send it in "
                      "llguidance's Lark format instead (as `hybridlm generate --grammar` reads)", param=param) from None


def _seeds(body) -> list[int]:
    base = body.seed if body.seed is not None else secrets.randbits(63)
    return [(base + i) % 2**64 for i in range(body.n)]


def _budget(service: Service, n_prompt: int, asked: int | None, param: str, prompt: str = "messages") -> int:
    T = service.model.config.n_ctx
    if n_prompt >= T:
        raise invalid(f"This model's maximum context length is {T} tokens. However, your {prompt} resulted in "
                      f"{n_prompt} tokens.", param=prompt, code="context_length_exceeded")
    if asked is None:
        return T - n_prompt
    if n_prompt + asked > T:
        raise invalid(f"This model's maximum context length is {T} tokens. However, you requested "
                      f"{n_prompt + asked} tokens ({n_prompt} in the {prompt}, {asked} in the completion). "
                      f"Please reduce the length of the {prompt} or completion.", param=param,
                      code="context_length_exceeded")
    return asked


def prepare_chat(service: Service, body: ChatBody) -> Prepared:
    check_model(service, body.model)
    model, tok = service.model, service.tokenizer
    if not getattr(tok, "chat_template", None):
        raise invalid(f"the model {service.model_id} has no chat template; use /v1/completions", param="messages")
    client: list[dict[str, Any]] = [
        {"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters}
        for t in body.tools or []]
    # The server's own tools are offered beside the client's (a name the client gives is the client's
    # tool), unless the request asks for a structured reply: response_format and callable tools exclude
    # each other. The server runs its own; a call of a client's tool is returned (docs/server.md).
    wants_format = (body.response_format is not None and body.response_format.type != "text") \
        or structured(body) is not None
    own = {t["name"] for t in client}
    server = [] if service.tools is None or (wants_format and body.tool_choice is None) \
        else [t.offered() for t in service.tools if t.name not in own]
    offered = client + server
    asked_choice = body.tool_choice
    if asked_choice is None:
        choice = "auto" if offered else "none"
    else:
        choice = asked_choice if isinstance(asked_choice, str) else asked_choice.function.name
    names = [t["name"] for t in offered]
    if choice == "required" and not offered:
        raise invalid("tool_choice 'required' needs tools (the request's, or the server's --tools)", param="tool_choice")
    if choice not in ("auto", "required", "none") and choice not in names:
        raise invalid(f"tool_choice names {choice!r}, which is not among the tools {names[:8]}", param="tool_choice")
    if not offered:
        choice = "none"
    schema = response_format_schema(body.response_format)
    field, asked_schema, grammar = output_grammar(tok, body)
    if (asked_schema is not None or grammar is not None) and schema is not None:
        raise invalid(f"{field} and response_format each constrain the reply; give one", param=field)
    if asked_schema is not None:
        schema = asked_schema
    if grammar is not None and offered and choice != "none":
        raise invalid(f"{field} with tools that may be called is not supported; give one or the other "
                      "(or tool_choice 'none')", param=field)
    if schema is not None and offered and choice != "none":
        raise invalid("response_format with tools that may be called is not supported; give one or the other "
                      "(or tool_choice 'none')", param="response_format")
    if schema is not None:
        try:
            json_schema_constraint(tok, schema)
        except InputError as exc:
            raise invalid(f"response_format: {exc}", param="response_format") from None
    # one call per turn where both kinds are offered: a turn either runs here or ends the arc
    parallel = (body.parallel_tool_calls if body.parallel_tool_calls is not None else True) and not (client and server)
    stops = stop_list(body.stop)
    codec = codec_for(model)
    if offered:
        try:  # every schema compiles before anything joins the engine
            tool_call_constraint(tok, offered, choice, parallel=parallel, codec=codec)
        except InputError as exc:
            raise invalid(f"tools: {exc}", param="tools") from None

    messages = body.messages
    check_prompt_size(tok, model.config.n_ctx, (C.text_of(m.content) for m in messages))
    protocol = Protocol(tok, offered, example=False, codec=codec)
    pending = C.pending_tool_results(messages)
    entry, resume = None, []
    if pending is not None and client:
        i, results = pending
        head = C.template_messages(messages[: i + 1], protocol)
        entry = service.continuations.get(C.conversation_key(head))
        if entry is not None:
            calls = messages[i].tool_calls or []
            observations, names, ids = [results[c.id] for c in calls], [c.function.name for c in calls], [c.id for c in calls]
            if entry.kept is None:
                resume = protocol.observation_ids(entry.messages, observations, turn_closed=entry.turn_closed,
                                                  names=names, ids=ids)
            else:  # the rest of the turn as the template writes it, then the results (ρ, docs/theory.md §4)
                held = state_tokens(entry.state)[-entry.kept:] if entry.kept else []
                cut = protocol.rewrite(entry.messages[:-1], entry.messages[-1], held, observations, names, ids)
                if cut is not None and cut[0] == entry.kept:
                    resume = cut[1]
                else:  # (a template that writes the turn otherwise once results follow it: prefilled afresh)
                    entry = None
        if entry is not None:
            tmpl = entry.messages + protocol.tool_turns(observations, names, ids)
    if entry is None:
        tmpl = C.template_messages(messages, protocol)
        try:
            prompt, marks = protocol.prompt_ids_and_marks(tmpl)
        except HybridLMError as exc:
            raise invalid(str(exc), param="messages") from None
    else:
        prompt, marks = state_tokens(entry.state) + resume, []
    asked = body.max_completion_tokens or body.max_tokens or (body.n_predict if (body.n_predict or 0) > 0 else None)
    budget = _budget(service, len(prompt), asked, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    kernel = _kernel(body, service.model.config.vocab_size)
    # the call horizon of a turn bounds its calls, whoever runs them; the jump horizon, the server's jumps
    lim = Limits(max_token_steps=budget, max_jumps=service.max_jumps if server else 0,
                 max_jumps_per_step=max(1, service.max_calls) if parallel else 1)
    client_tools = frozenset(t["name"] for t in client)
    offer = Offer(tools=tuple({**t, "server": "client"} if t["name"] in client_tools else t for t in offered),
                  choice=choice, parallel=parallel, calls=bool(offered), answer_schema=schema, answer_grammar=grammar,
                  stops=stops, repeats=service.repeat_calls)
    sent = tmpl if entry is None else C.template_messages(messages, protocol)  # (the key of what comes back)
    elsewhere = C.ClientTools(client_tools, tok, protocol, stops, service.repeat_calls, sent, len(tmpl)) \
        if client_tools else None
    run = None
    if server:
        tools = service.tools

        def run(k, name, arguments):
            return tools.call(name, arguments)

    notes = {"prompt_tokens": len(prompt), **({"continues": entry.arc} if entry is not None else {})}
    ident = f"chatcmpl-{secrets.token_hex(12)}"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    seqs: list[ArcState] = []
    for i, seed in enumerate(_seeds(body)):
        system = Conversation(tok, protocol, offer, vocab_size=model.config.vocab_size, run=run, elsewhere=elsewhere,
                              kind="chat", notes=notes)
        s = ArcState(system, list(prompt), kernel=kernel, seed=seed, limits=lim, stop_ids=frozenset(tok.stop_ids()),
                     messages=list(tmpl), marks=tuple(marks), name=f"{ident}-{i}",
                     continues=entry.state if entry is not None else None, resume=list(resume), logprobs=logprobs)
        try:
            s.constraint = system.turn(s, first=True)
        except InputError as exc:
            raise invalid(str(exc), param="tools") from None
        seqs.append(s)
    return Prepared("chat", ident, int(time.time()), body.model, seqs, stream=body.stream,
                    include_usage=bool(body.stream_options and body.stream_options.include_usage), logprobs=logprobs,
                    stops=stops, offer=offer, client_tools=client_tools, codec=codec,
                    prompt_tokens=[len(prompt)] * len(seqs), n=body.n, continued_from=entry.arc if entry is not None else None)


def prepare_completion(service: Service, body: CompletionBody) -> Prepared:
    check_model(service, body.model)
    model, tok = service.model, service.tokenizer
    stops = stop_list(body.stop)
    kernel = _kernel(body, service.model.config.vocab_size)
    ident = f"cmpl-{secrets.token_hex(12)}"
    V = model.config.vocab_size
    seqs: list[ArcState] = []
    lengths, texts = [], []
    stop_ids = default_stops(model)
    field, schema, grammar = output_grammar(tok, body)
    asked_format = response_format_schema(body.response_format)
    if asked_format is not None:
        if field:
            raise invalid(f"{field} and response_format each constrain the reply; give one", param=field)
        field, schema = "response_format", asked_format
    if schema is not None:
        try:
            grammar = library.json_grammar(schema)
        except (InputError, ValueError) as exc:
            raise invalid(f"{field}: {exc}", param=field) from None
    # max_tokens (default 16) and llama.cpp's aliases of it, n_predict (−1: up to the context) and max_completion_tokens
    given = {name: value for name, value in (
        ("max_tokens", body.max_tokens if "max_tokens" in body.model_fields_set else None),
        ("max_completion_tokens", body.max_completion_tokens), ("n_predict", body.n_predict)) if value is not None}
    if len(set(given.values())) > 1:
        names = list(given)
        raise invalid(f"{' and '.join(names)} differ; give one (llama.cpp's aliases of max_tokens)", param=names[-1])
    asked = next(iter(given.values()), body.max_tokens)
    asked = None if asked is not None and asked < 0 else asked
    for p, prompt in enumerate(prompt_list(body.prompt)):
        if isinstance(prompt, str):
            ids = tok.encode_markup(prompt)
            text = prompt
        else:
            bad = [i for i in prompt if not 0 <= i < V]
            if bad:
                raise invalid(f"prompt[{p}] holds token id {bad[0]}, outside the vocabulary [0, {V})", param="prompt")
            ids, text = list(prompt), tok.decode(prompt)
        if not ids:
            raise invalid(f"prompt[{p}] encodes to no tokens", param="prompt")
        budget = _budget(service, len(ids), asked, "max_tokens", prompt="prompt")
        for seed in _seeds(body):
            constraint = None if grammar is None or budget < 1 else \
                GrammarConstraint(tok, grammar, kind=field, source=schema if schema is not None else getattr(body, field),
                                  budget=budget, vocab_size=V)
            s = sequence(model, ids, kernel=kernel, max_new_tokens=budget, seed=seed, stop_ids=stop_ids, stop=stops,
                         name=f"{ident}-{len(seqs)}", constraint=constraint)
            s.logprobs = body.logprobs
            seqs.append(s)
            lengths.append(len(ids))
            texts.append(text)
    return Prepared("completion", ident, int(time.time()), body.model, seqs, stream=body.stream,
                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                    logprobs=body.logprobs, stops=stops, prompt_tokens=lengths, prompt_texts=texts, echo=body.echo,
                    n=body.n)


# ---------------------------------------------------------------------- embeddings, tokens
def embeddings(service: Service, body) -> dict:
    """OpenAI's embeddings: for each input, its hidden states at layer ℓ pooled over positions
    (the mean, or the last position's), unit length unless `normalize` is false.

    ℓ is counted as the model's forward does: 0 is H⁽⁰⁾ (the embedding), ℓ < L the residual
    stream after ℓ blocks, and ℓ = L (the default) LN_f(H⁽ᴸ⁾), the state the readout reads
    (what llama.cpp's embeddings of a generative model are)."""
    check_model(service, body.model)
    model, tok = service.model, service.tokenizer
    L, V = model.config.n_layer, model.config.vocab_size
    layer = L if body.layer is None else body.layer
    if not 0 <= layer <= L:
        raise invalid(f"layer {layer}: expected 0 ≤ layer ≤ {L} (the model's blocks)", param="layer")
    d = model.config.d_model
    if body.dimensions is not None and body.dimensions != d:
        raise invalid(f"dimensions {body.dimensions}: this model's embeddings have {d} (no shortening)",
                      param="dimensions")
    inputs = prompt_list(body.input)
    if not inputs:
        raise invalid("input is empty", param="input")
    data, used = [], 0
    for i, item in enumerate(inputs):
        ids = tok.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise invalid(f"input[{i}] encodes to no tokens", param="input")
        if any(not 0 <= t < V for t in ids):
            raise invalid(f"input[{i}] holds a token id outside the vocabulary [0, {V})", param="input")
        if len(ids) > model.config.n_ctx:
            raise invalid(f"input[{i}] is {len(ids)} tokens; the context holds {model.config.n_ctx}", param="input",
                          code="context_length_exceeded")
        used += len(ids)
        with torch.no_grad():
            h = model(torch.tensor([ids]), layers=layer, logits=False)[0]
            if layer == L:
                h = model.ln_final(h)
        v = (h.mean(0) if body.pooling == "mean" else h[-1]).float()
        if body.normalize:
            v = v / v.norm().clamp_min(1e-12)
        vec: Any = v.tolist()
        if body.encoding_format == "base64":
            vec = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    return {"object": "list", "data": data, "model": body.model, "usage": {"prompt_tokens": used, "total_tokens": used},
            "hybridlm": {"layer": layer, "pooling": body.pooling, "normalized": body.normalize}}


def tokenize(service: Service, body) -> dict:
    """llama.cpp's /tokenize: {"tokens": [ids]}, or [{"id", "piece"}] with with_pieces (a piece that is
    not whole UTF-8 is its list of bytes, as llama.cpp gives it)."""
    tok = service.tokenizer
    ids = tok.encode_markup(body.content) if body.parse_special else tok.encode(body.content)
    if body.add_special:
        ids = tok.with_special(ids)
    if not body.with_pieces:
        return {"tokens": ids}
    lib = library.library_tokenizer(tok)
    pieces = []
    for i in ids:
        raw = bytes(lib.decode_bytes([i]))
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": i, "piece": piece})
    return {"tokens": pieces}


def detokenize(service: Service, body) -> dict:
    V = service.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < V]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary [0, {V})", param="tokens")
    return {"content": service.tokenizer.decode(body.tokens)}


# ---------------------------------------------------------------------- arcs → what the client sees
class Outbox:
    """An observer that hands a sequence's events to the request's event loop: (index, event), and
    (index, None) at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, *, every: bool) -> None:
        self.loop, self.queue, self.index, self.every = loop, queue, index, every

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the request's loop has closed: nobody is listening
            pass

    def on_event(self, s, event) -> None:
        if self.every and event.kind in ("token", "phase"):
            self._put((self.index, event))

    def on_end(self, s) -> None:
        self._put((self.index, None))


class ChoiceState:
    """One choice as the client has seen it so far (for streaming deltas)."""

    def __init__(self, prep: Prepared, s: ArcState, service: Service) -> None:
        self.prep, self.s, self.service = prep, s, service
        self.turns: list[list[int]] = [[]]
        self.content_sent = 0
        self.calls_sent: dict[int, int] = {}  # call index -> argument characters sent
        self.pending_logprobs: list[dict] = []
        self.first_token: float | None = None

    def on_event(self, event) -> None:
        if event.kind == "phase" and event.get("phase") == "external":
            self.turns.append([])
        elif event.kind == "token":
            if self.first_token is None:
                self.first_token = time.perf_counter()
            if event.get("stop"):
                return
            self.turns[-1].append(event["token"])
            if self.prep.logprobs is not None:
                self.pending_logprobs.append(event)

    def texts(self) -> list[str]:
        tok = self.service.tokenizer
        return [tok.decode(ids) for ids in self.turns]

    def take_logprobs(self, lib) -> dict | None:
        """The log-probabilities of the tokens not yet sent, as a chunk's `logprobs`."""
        if not self.pending_logprobs:
            return None
        entries = [_token_logprob(self.service.tokenizer, lib, e) for e in self.pending_logprobs]
        self.pending_logprobs = []
        return {"content": entries, "refusal": None}


def _view(prep: Prepared, turns: list[str], final: bool, s=None) -> View:
    offer = prep.offer
    possible = offer is not None and offer.calls and offer.choice != "none"
    cut = s is None or s.arc.termination not in (Termination.STOP_TOKEN, Termination.STOP_SEQUENCE)
    return render(turns, final=final, stops=prep.stops, client_tools=prep.client_tools, calls_possible=possible,
                  cut=cut, codec=prep.codec, repeats=offer is None or offer.repeats)


def _token_logprob(tok, lib, event) -> dict:
    def entry(token: int, lp: float) -> dict:
        return {"token": tok.token_str(token), "logprob": lp, "bytes": list(lib.decode_bytes([token]))}

    out = entry(event["token"], event.get("model_logprob", event.get("logprob", 0.0)))
    out["top_logprobs"] = [entry(t, lp) for t, lp in event.get("top_logprobs", [])]
    return out


def _error_of(s: ArcState) -> APIError:
    end = next((e for e in reversed(s.arc.events) if e.kind == "end"), None)
    message = end.get("error") if end is not None else None
    return APIError(500, f"the sequence {s.name} failed: {message or s.error}", type="server_error",
                    code="generation_failed")


def _usage(prep: Prepared) -> dict:
    """Each prompt counted once (not once per choice), every choice's generated tokens."""
    completion = sum(s.t for s in prep.sequences)
    prompt = sum(prep.prompt_tokens[:: max(1, prep.n)])
    cached = max((getattr(s, "cached_tokens", 0) for s in prep.sequences), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _extension(prep: Prepared) -> dict:
    out = {"arcs": [s.name for s in prep.sequences], "seeds": [s.seed for s in prep.sequences],
           "termination": [s.arc.termination.value if s.arc.termination else None for s in prep.sequences]}
    jumps = [[{"tool": e["tool"], "arguments": e["arguments"], "observation": e["observation"], "error": e["error"],
               "t": e.t, "k": e.k, "duration_s": e["duration_s"]} for e in s.arc.of("jump")] for s in prep.sequences]
    if any(jumps):
        out["jumps"] = jumps
    if prep.continued_from:
        out["continued_from"] = prep.continued_from
    return out


def chat_response(prep: Prepared, service: Service) -> dict:
    tok = service.tokenizer
    lib = library.library_tokenizer(tok) if prep.logprobs is not None else None
    choices = []
    for i, s in enumerate(prep.sequences):
        if s.arc.termination is Termination.ERROR:
            raise _error_of(s)
        view = _view(prep, turns_of(s, tok), final=True, s=s)
        calls = [{"id": C.call_id(s, c.index), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in view.calls]
        message: dict[str, Any] = {"role": "assistant", "content": view.content if view.content or not calls else None,
                   "refusal": None}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if lib is not None:
            logprobs = {"content": [_token_logprob(tok, lib, e) for e in s.arc.of("token") if not e.get("stop")],
                        "refusal": None}
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason(s)})
    return {"id": prep.id, "object": "chat.completion", "created": prep.created, "model": prep.model,
            "choices": choices, "usage": _usage(prep), "system_fingerprint": _fingerprint(service),
            "hybridlm": _extension(prep)}


def completion_response(prep: Prepared, service: Service) -> dict:
    tok = service.tokenizer
    choices = []
    for i, s in enumerate(prep.sequences):
        if s.arc.termination is Termination.ERROR:
            raise _error_of(s)
        tokens = [e for e in s.arc.of("token") if not e.get("stop")]
        text = render([tok.decode([e["token"] for e in tokens])], final=True, stops=prep.stops,
                        calls_possible=False).content
        prefix = prep.prompt_texts[i] if prep.echo else ""
        logprobs = _completion_logprobs(tok, tokens, len(prefix)) if prep.logprobs is not None else None
        choices.append({"index": i, "text": prefix + text, "logprobs": logprobs,
                        "finish_reason": finish_reason(s)})
    return {"id": prep.id, "object": "text_completion", "created": prep.created, "model": prep.model,
            "choices": choices, "usage": _usage(prep), "system_fingerprint": _fingerprint(service),
            "hybridlm": _extension(prep)}


def _completion_logprobs(tok, events, offset: int) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        text = tok.token_str(e["token"])
        out["tokens"].append(text)
        out["token_logprobs"].append(e.get("model_logprob", e.get("logprob", 0.0)))
        out["top_logprobs"].append({tok.token_str(t): lp for t, lp in e.get("top_logprobs", [])})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _fingerprint(service: Service) -> str:
    return f"hybridlm-{service.model_id}"


# ---------------------------------------------------------------------- running a request
def attach(prep: Prepared, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    for i, s in enumerate(prep.sequences):
        s.observers.append(Outbox(loop, queue, i, every=prep.stream))
    return queue


async def wait_all(prep: Prepared, queue: asyncio.Queue, service: Service, is_disconnected) -> bool:
    """Wait until every sequence has ended; False (its rows freed) when the client went away."""
    left = len(prep.sequences)
    while left:
        try:
            _, event = await asyncio.wait_for(queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await is_disconnected():
                service.cancel(prep.sequences)
                return False
            continue
        if event is None:
            left -= 1
    return True


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(prep: Prepared, queue: asyncio.Queue, service: Service, ttft):
    """The server-sent events of a streamed request, chat or completion alike: each choice's opening
    chunk, then, as its sequence's events arrive, the chunks of what the client has not seen
    yet (the kind's `Chunks`), its error or its finish reason; usage last when asked; then [DONE]."""
    chunks = (ChatChunks if prep.kind == "chat" else CompletionChunks)(prep, service)
    states = [ChoiceState(prep, s, service) for s in prep.sequences]
    try:
        for i in range(len(states)):
            for text in chunks.opening(i):
                yield text
        left = len(states)
        while left:
            i, event = await queue.get()
            st = states[i]
            final = event is None
            if final:
                left -= 1
                if st.s.arc.termination is Termination.ERROR:
                    yield sse(_error_of(st.s).body())
                    continue
                if st.s.arc.termination is Termination.CANCELLED:  # by the server (a client gone hears nothing)
                    yield sse({"error": {"message": f"the choice {i} was cancelled by the server (shutting down) "
                                                    "before it finished", "type": "server_error", "param": None,
                                         "code": "cancelled"}})
                    continue
            else:
                had = st.first_token
                st.on_event(event)
                if had is None and st.first_token is not None and ttft is not None:
                    ttft(st.first_token - prep.received)
                if event.kind != "token":
                    continue
            for text in chunks.update(i, st, final):
                yield text
        if prep.include_usage:
            yield sse({**chunks.base, "choices": [], "usage": _usage(prep)})
        yield sse("[DONE]")
    finally:
        service.cancel(prep.sequences)  # a client gone mid-stream frees its rows at once


class ChatChunks:
    """chat.completion.chunk events: the role, content deltas, each call's id and name once and
    its argument deltas, the finish reason."""

    def __init__(self, prep: Prepared, service: Service) -> None:
        self.prep = prep
        self.lib = library.library_tokenizer(service.tokenizer) if prep.logprobs is not None else None
        self.base = {"id": prep.id, "object": "chat.completion.chunk", "created": prep.created, "model": prep.model,
                     "system_fingerprint": _fingerprint(service)}

    def chunk(self, i: int, delta: dict, finish=None, logprobs=None) -> str:
        return sse({**self.base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}]})

    def opening(self, i: int):
        yield self.chunk(i, {"role": "assistant", "content": "", "refusal": None})

    def update(self, i: int, st: ChoiceState, final: bool):
        """A content delta carries the log-probabilities of the tokens that wrote it (as OpenAI's
        chunks do); each call's id and name once, then its argument deltas. Tokens that are no
        content (a call's markup and arguments, a stop sequence's text) have their
        log-probabilities in a chunk of their own, so the chunks hold them all."""
        view = _view(self.prep, st.texts(), final=final, s=st.s if final else None)
        if len(view.content) > st.content_sent:
            delta = view.content[st.content_sent:]
            st.content_sent = len(view.content)
            yield self.chunk(i, {"content": delta}, logprobs=st.take_logprobs(self.lib))
        for c in view.calls:
            sent = st.calls_sent.get(c.index)
            parts = []
            if sent is None:
                parts.append({"index": c.index, "id": C.call_id(st.s, c.index), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
                st.calls_sent[c.index] = len(c.arguments)
            elif len(c.arguments) > sent:
                parts.append({"index": c.index, "function": {"arguments": c.arguments[sent:]}})
                st.calls_sent[c.index] = len(c.arguments)
            if parts:
                yield self.chunk(i, {"tool_calls": parts})
        if st.pending_logprobs and (final or view.calls):
            yield self.chunk(i, {}, logprobs=st.take_logprobs(self.lib))
        if final:
            yield self.chunk(i, {}, finish=finish_reason(st.s))


class CompletionChunks:
    """text_completion events: the prompt first when echoed, then text deltas with their
    log-probabilities, the finish reason with the last."""

    def __init__(self, prep: Prepared, service: Service) -> None:
        self.prep, self.tokenizer = prep, service.tokenizer
        self.base = {"id": prep.id, "object": "text_completion", "created": prep.created, "model": prep.model,
                     "system_fingerprint": _fingerprint(service)}
        self.offsets = [len(prep.prompt_texts[i]) if prep.echo else 0 for i in range(len(prep.sequences))]

    def chunk(self, i: int, text: str, logprobs=None, finish=None) -> str:
        return sse({**self.base, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish}]})

    def opening(self, i: int):
        if self.prep.echo:
            yield self.chunk(i, self.prep.prompt_texts[i])

    def update(self, i: int, st: ChoiceState, final: bool):
        view = render(st.texts(), final=final, stops=self.prep.stops, calls_possible=False)
        delta = view.content[st.content_sent:]
        st.content_sent = max(st.content_sent, len(view.content))
        logprobs = None
        if st.pending_logprobs:
            logprobs = _completion_logprobs(self.tokenizer, st.pending_logprobs, self.offsets[i])
            self.offsets[i] += sum(len(t) for t in logprobs["tokens"])
            st.pending_logprobs = []
        if delta or logprobs or final:
            yield self.chunk(i, delta, logprobs, finish_reason(st.s) if final else None)


def first_token_delay(prep: Prepared, s: ArcState) -> float | None:
    """Seconds from the request's arrival to the sequence's first token (non-streamed requests)."""
    first = next((e for e in s.arc.events if e.kind == "token"), None)
    if first is None or not s.started:
        return None
    return s.started - prep.received + first.wall_s


def dtype_name(model) -> str:
    """The precision the model runs at (int4, int8, bfloat16, float32), else its embedding's dtype."""
    precision = getattr(model, "precision", None)
    if isinstance(precision, str):
        return precision
    W = getattr(model, "W_e", None)
    return str(W.dtype).removeprefix("torch.") if isinstance(W, torch.Tensor) else "?"
