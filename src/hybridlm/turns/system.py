"""A conversation whose assistant turns may call tools, as a hybrid system of the engine (docs/theory.md §4).

    modes      q_G (generate: prefill, decode, constrained phases) and q_E (external: a tool runs)
    flow set   C = {q_G, the answer not finished}
    flow map   f: one token step, w_{t+1} ~ p_θ(· | s_t) (masked by the turn's constraint),
               x_{t+1} = F(x_t, w_{t+1})  (the engine's, shared by every system)
    jump set   D = {q_G, the turn has just completed its calls}
    jump map   g: run the calls for wall time (q_E), then s⁺ = Π_T(Φ(ρ(s), enc(y))), the
               observations entering the state through a prefill phase; k ← k + 1; ρ rewrites
               the turn as the chat template writes its calls (identity for the project's format)

The turn is the discrete part of the state: each assistant turn has one constraint
(`Conversation.turn`), free text or calls of the offered tools in the call format's grammar
(hybridlm.turns.constraint), opened lazily in "auto". C and D meet where a call has just
completed; the engine's priority rule (jumps first, by default) takes the jump there.

Where g runs is a collaborator, passed in (as is `outcome`, what a caller makes of a finished
arc): `run` runs a call here (a tool registry, or the
recorded observations of a replay), and `elsewhere` names the tools whose jump map runs
outside the engine (a client's): an arc that reaches D at a call of one of them ends there,
with termination cause `jump_set`, and `elsewhere.continuation` keeps its state for the
sequence that brings the results. The engine's horizons bound the arc: a token budget, a
jump horizon for the jumps that run here, and at most `max_jumps_per_step` jumps at one
token step (no Zeno loop of calls); when no jump is allowed the turn may open no call.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol as Interface

import torch

from hybridlm.constraints import GrammarConstraint, json_schema_constraint
from hybridlm.engine.arc import Termination
from hybridlm.engine.sequence import ArcState
from hybridlm.engine.system import HybridSystem
from hybridlm.tools import Observation
from hybridlm.turns.constraint import FreeTurn, tool_call_constraint
from hybridlm.turns.codecs.json_text import as_json
from hybridlm.turns.protocol import Protocol, schema_of


@dataclass(frozen=True)
class Offer:
    """What the turns of a conversation offer the model, and how."""

    tools: tuple[dict, ...] = ()  # {"name", "description", "parameters"} of each tool, and "server" where known
    choice: str = "auto"  # the first turn's tool choice: auto | required | none | an offered tool's name
    parallel: bool = False  # several calls in a turn (each a jump, their observations in order)
    constrain: bool = True  # each turn masked by the format's grammar (False: the free baseline)
    calls: bool = True  # the conversation speaks the call format (False: a plain chat, nothing about calls)
    answer_schema: dict | bool | None = None  # the JSON Schema of an answer, when no call may be made
    answer_grammar: str | None = None  # else a compiled llguidance grammar of the answer (a regex, a grammar)
    stops: tuple[str, ...] = ()  # stop strings of the answer
    repeats: bool = False  # a call identical to an earlier one of its turn may be made (else the turn ends)
    defaults: bool = False  # an optional argument may be its declared default, whatever its type (admit_defaults)


class Elsewhere(Interface):
    """The jump map of some tools runs outside the engine (a client runs them)."""

    names: frozenset[str]

    def continuation(self, s, state) -> tuple[str, Any]:
        """What to keep of an arc that ended in D at one of their calls: (key, entry)."""
        ...


Run = Callable[[int, str, Any], Observation]  # (jump index k, tool, arguments) → y, in a worker thread


class Conversation(HybridSystem):
    """H = (C, f, D, g) of a conversation with tools, its turns in the call format of `protocol.codec`."""

    def __init__(self, tokenizer, protocol: Protocol, offer: Offer, *, vocab_size: int | None,
                 run: Run | None = None, elsewhere: Elsewhere | None = None,
                 outcome: Callable[[Any], Any] | None = None, kind: str = "agent", notes: dict | None = None) -> None:
        self.tokenizer, self.protocol, self.codec, self.offer = tokenizer, protocol, protocol.codec, offer
        self.vocab_size, self.run, self.elsewhere, self.outcome = vocab_size, run, elsewhere, outcome
        self.kind, self.notes = kind, dict(notes or {})
        self.servers = {t["name"]: t.get("server") for t in offer.tools}
        self.schemas = [schema_of(t) for t in offer.tools]

    # ------------------------------------------------------------------ the turn
    def turn(self, s, *, first: bool):
        """The constraint of the turn that starts now (the first turn follows the tool choice; a turn
        after a jump is "auto"); None when nothing is constrained."""
        o, lim = self.offer, s.limits
        left = lim.max_jumps_per_step  # the call horizon of one turn (its calls are jumps at one token step)
        if self.run is not None or not self.elsewhere:  # the jumps that run here count against the jump horizon
            left = min(lim.max_jumps - s.k, left)
        if not o.constrain:
            opened = first and o.choice == "required"
            return FreeTurn(self.tokenizer, codec=self.codec, text=self.codec.opening if opened else "")
        budget = max(1, lim.max_token_steps - s.t)
        choice = o.choice if first else "auto"
        if not o.calls or o.choice == "none" or (left is not None and left <= 0):
            choice = "none"
        if choice == "none" and o.answer_schema is not None:
            return json_schema_constraint(self.tokenizer, o.answer_schema, budget=budget, vocab_size=self.vocab_size)
        if choice == "none" and o.answer_grammar is not None:
            return GrammarConstraint(self.tokenizer, o.answer_grammar, kind="grammar", source="request", budget=budget,
                                     vocab_size=self.vocab_size)
        if not o.calls:
            return None
        parallel = o.parallel and (left is None or left > 1)
        return tool_call_constraint(self.tokenizer, self.schemas, choice, parallel=parallel,
                                    max_calls=left if parallel else None, budget=budget, vocab_size=self.vocab_size,
                                    codec=self.codec, repeats=o.repeats, defaults=o.defaults)

    # ------------------------------------------------------------------ C and f
    def controlled(self, s) -> bool:
        return not getattr(s.constraint, "in_call", False)  # inside a call the constraint is the input

    def phase_of(self, s) -> str:
        c = s.constraint
        if c is None or isinstance(c, FreeTurn):
            return "decode"
        return "constrained" if getattr(c, "in_call", True) else "decode"

    def flow_mask(self, s) -> torch.Tensor | None:
        """The free baseline, when no jump is allowed: remove the tokens that would complete a call's opening."""
        if not isinstance(s.constraint, FreeTurn) or s.constraint.in_call or self._may_jump(s):
            return None
        tok, opening = self.tokenizer, self.codec.opening
        table, turn_text = tok.table, tok.decode(s.turn)
        banned = table.containing(opening)
        for n in range(1, len(opening)):
            if turn_text.endswith(opening[:n]):
                banned = banned + table.starting_with(opening[n:])
        whole = tok.encode_markup(opening)  # the opening as one added token (its text may read "" in the table)
        if len(whole) == 1:
            banned = banned + whole
        if not turn_text.strip():  # nor a call without the tags, where the format reads one (hybridlm.turns.codecs)
            banned = banned + [i for start in self.codec.bare_openings for i in table.starting_with(start)]
        if not banned:
            return None
        allowed = torch.ones(table.size, dtype=torch.bool)
        allowed[torch.tensor(banned)] = False
        return allowed

    def flowed(self, s, token: int) -> None:
        """A stop token outside the jump set finishes the answer; so does a constraint that ended without
        a call (cut short by its budget: the cause is the budget's), and a stop string in the free text."""
        in_D = self.jump_set(s)
        c = s.constraint
        closed = c is not None and not isinstance(c, FreeTurn) and c.finished and not in_D
        if closed and getattr(c, "forced", False):  # (the witness may end with the stop token)
            s.finished = Termination.TOKEN_BUDGET
        elif token in s.stop_ids and not in_D:
            s.finished = Termination.STOP_TOKEN
        elif closed:
            s.finished = Termination.CONSTRAINT
        elif self.offer.stops and not in_D:
            free = self.codec.free_text(self.tokenizer.decode([i for i in s.turn if i not in s.stop_ids]))
            if any(stop in free for stop in self.offer.stops):
                s.finished = Termination.STOP_SEQUENCE

    def _may_jump(self, s) -> bool:
        return self.offer.choice != "none" and s.jumps_allowed

    # ------------------------------------------------------------------ D and g
    def jump_set(self, s) -> bool:
        """The turn's constraint is finished and holds calls (the free baseline: a call, parsed or not),
        which the model wrote itself: a call the token budget closed is not a jump (nothing is left
        to answer with, and its values may be cut short)."""
        c = s.constraint
        return c is not None and c.finished and getattr(c, "made_call", False) and not getattr(c, "forced", False)

    def jumps_elsewhere(self, s) -> bool:
        names = self.elsewhere.names if self.elsewhere else ()
        return bool(names) and any(call.name in names for call in s.constraint.calls())

    def jump(self, s: ArcState) -> Callable[[], list[tuple[str, Any, Observation]]]:
        c = s.constraint
        s.call = c
        if isinstance(c, FreeTurn):
            parsed, error = c.parsed()
            calls: list[tuple[str, Any, Observation | None]] = [(p.name, p.arguments, None) for p in parsed]
            if error is not None:  # the first bad call, after the good ones, reports what is wrong
                bad = Observation(f"error: malformed tool call ({error})", "malformed_call")
                calls.append(("?", self.codec.raw_call(c.text), bad))
        else:
            calls = [(p.name, p.arguments, None) for p in c.calls()]
        ks = [s.k + i for i in range(len(calls))]
        run = self.run or _nowhere

        def work() -> list[tuple[str, Any, Observation]]:
            """The calls of the turn, run side by side in wall time; their observations in order."""
            def one(i: int) -> Observation:
                name, arguments, given = calls[i]
                return given or run(ks[i], name, arguments)

            if len(calls) == 1:
                return [(calls[0][0], calls[0][1], one(0))]
            with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
                return [(c[0], c[1], obs) for c, obs in zip(calls, pool.map(one, range(len(calls))))]

        return work

    def landed(self, s, results) -> list[int]:
        for name, arguments, obs in results:
            s.count_jump()
            s.emit("jump", id=f"call-{s.name}-{s.k}", tool=name, arguments=arguments, observation=obs.text,
                   error=obs.error, duration_s=obs.duration_s, server=self.servers.get(name))
        closed = bool(s.turn) and s.turn[-1] in s.stop_ids  # the model closed its turn itself
        observations, names = [obs.text for _, _, obs in results], [name for name, _, _ in results]
        made = s.call.calls()
        ids = [made[i].id if i < len(made) and made[i].id else self.codec.call_id(i, f"{s.k}-") for i in range(len(results))]
        turn = None
        if all(name != "?" for name in names):  # (a call that did not parse stays as written)
            calls = [(name, as_json(arguments)) for name, arguments, _ in results]
            turn = self.protocol.assistant(self.codec.free_text(s.call.text).strip(), calls, ids)
        cut = None if turn is None else rewrite_state(self.protocol, s.x, s.turn, s.messages, turn, observations,
                                                      names, ids)
        if cut is not None:  # g rewrites the turn as the template writes it, then enc(y) follows
            kept, enc = cut[1], cut[2]
            s.messages.append(turn)
            s.emit("rewrite", kept=kept, tokens=len(enc))
        else:
            s.messages.append({"role": "assistant", "content": s.call.text})  # (as written: the state holds it)
            enc = self.protocol.observation_ids(s.messages, observations, turn_closed=closed, names=names, ids=ids)
        s.messages += self.protocol.tool_turns(observations, names, ids)
        s.constraint = self.turn(s, first=False)
        return enc

    # ------------------------------------------------------------------ the end
    def answer(self, s) -> str:
        """The free text of the last turn, without a call the token budget cut or closed."""
        text = self.tokenizer.decode([i for i in s.turn if i not in s.stop_ids])
        if getattr(s.constraint, "forced", False):
            return self.codec.free_text(text).strip()
        return self.codec.without_open_call(text).strip()

    def summary(self, s) -> dict:
        return {"answer": self.answer(s)} if s.task is not None else {}  # an agent's arc answers its task

    def ended(self, s) -> None:
        s.result = self.outcome(s) if self.outcome is not None else s.arc

    def describe(self, s) -> dict:
        o = self.offer
        out: dict = {"system": self.kind}
        if s.task is not None:
            out["task"] = s.task
        out |= {"tool_choice": o.choice, "constrain": o.constrain, "parallel_tool_calls": o.parallel,
                "tools": [dict(t) for t in o.tools]}
        if o.defaults:
            out["admit_defaults"] = True
        if o.stops:
            out["stop"] = list(o.stops)
        if o.answer_schema is not None:
            out["response_schema"] = o.answer_schema
        return {**out, **self.notes}


def rewrite_state(protocol: Protocol, x, held, messages: list[dict], turn: dict, observations=(), names=(),
                  ids=()) -> tuple[int, int, list[int]] | None:
    """ρ on a state whose string ends with the tokens `held` of a turn that called: cut where they first
    differ from the template's rendering of `turn` (its calls structured: what a client that sends the
    conversation back gets from a server, and the format the model was trained on). Returns how many of
    `held` it keeps, the state's length after the cut, and the rendering's tokens after them (the rest of
    the turn, a tool turn per observation, the next turn's opening). None, the state untouched, where the
    turn stays as written: the project's own format, a template that does not render the conversation as
    growing prefixes, a state that cannot be cut or does not end with `held`."""
    if not protocol.templated or not hasattr(x, "crop"):
        return None
    string, held = state_tokens(x), list(held)
    if len(string) < len(held) or string[len(string) - len(held):] != held:
        return None
    rewrite = protocol.rewrite(messages, turn, held, observations, names, ids)
    if rewrite is None:
        return None
    same, rest = rewrite
    kept = len(string) - len(held) + same
    x.crop(kept)
    return same, kept, rest


def state_tokens(x) -> list[int]:
    """The token string s a state holds (a batch of one)."""
    tokens = x.tokens
    return tokens[0].tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def _nowhere(k: int, name: str, arguments) -> Observation:
    return Observation(f"error: the tool {name!r} does not run here", "unknown_tool")
