"""The conversation of a turn-taking run, rendered with the model's own chat template.

Where the template takes tools and the call format is its own (`CallCodec.templated`: Qwen's
Hermes, Llama 3's JSON, Mistral's), everything about tools is the template's: the tools reach
it through its `tools` variable, an assistant turn's calls as structured `tool_calls`, each
result as a tool turn that the template wraps (once). Otherwise (a template without tools, or
none of the formats a template names: the project's default format, docs/agent.md) the system
prompt lists the tools and teaches the codec's format, and the codec writes calls and results.

One worked example (a user question, a call, its result, an answer) follows as ordinary chat
turns when the calculator is offered, because a small model follows an example better than
a rule. The block that the jump map injects, enc(y), is the difference between the rendering
of the conversation with and without the tool turns, followed by the opening of the next
assistant turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridlm.turns.codecs import TAGGED_JSON, CallCodec
from hybridlm.turns.codecs.json_text import as_json

CALCULATOR_RULE = "Use the calculator for every calculation; never compute in your head.\n"
MARKED_LAST = 4  # message boundaries marked at the end of a prompt (besides the system prompt's)
NO_TOOLS = "You are a helpful assistant. Answer in one short sentence."
PROBE = "hybridlm_probe_tool"  # a tool name no template writes unless it lists the tools it is given

# The worked example is the calculator's: shown only when the calculator is offered.
EXAMPLES = [
    ("A shop has 37 shelves with 21 jars on each shelf. How many jars are there?", "37 * 21", "777"),
    ("What is 5230 minus 148?", "5230 - 148", "5082"),
]


def schema_of(tool) -> dict:
    """{"name", "description", "parameters"} of a tool: a `Tool`, or a dict of these (and of the server that
    runs it, which the model is not shown)."""
    if isinstance(tool, dict):
        return {k: v for k, v in tool.items() if k != "server"}
    return tool.schema()


def function(schema: dict) -> dict:
    """A tool as chat templates read their `tools` (OpenAI's function form)."""
    return {"type": "function", "function": schema}


def takes_tools(tokenizer) -> bool:
    """The chat template lists the tools it is given (a probe tool's name appears in its rendering)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = [function({"name": PROBE, "description": "", "parameters": {"type": "object", "properties": {}}})]
    try:
        return PROBE in tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=probe)
    except Exception:  # noqa: BLE001 - a template that fails given tools does not take them
        return False


class Protocol:
    """Renders the conversation of a run with the tokenizer's chat template, its calls and results
    in the call format of `codec`."""

    def __init__(self, tokenizer, tools: Iterable = (), *, example: bool = True,
                 codec: CallCodec = TAGGED_JSON, system: str = "") -> None:
        self.tokenizer, self.codec, self.system = tokenizer, codec, system
        self.schemas = [schema_of(t) for t in tools]
        self.example = example and any(s["name"] == "calculator" for s in self.schemas)
        #: the template renders the tools, calls and results (else the codec's system prompt and wrapping)
        self.templated = codec.templated and takes_tools(tokenizer)

    # ------------------------------------------------------------------ the messages
    def tools_prompt(self) -> str:
        """The system prompt's tool part ("" when no tool is offered, or when the template lists them)."""
        if not self.schemas or self.templated:
            return ""
        return self.codec.tools_prompt(self.schemas, rules=self.rules())

    def rules(self) -> str:
        return CALCULATOR_RULE if any(s["name"] == "calculator" for s in self.schemas) else ""

    def system_prompt(self) -> str:
        """The system message's text (the caller's `system` first); "" for none where the template lists the
        tools and no rule is added: the template's own default then, the one the model was trained on (and
        what a client that sends no system message gets from llama.cpp's or vLLM's server)."""
        if self.templated and self.schemas:
            rules = self.rules()
            return (self.system or NO_TOOLS) + "\n" + rules if rules else self.system
        return "\n".join(t for t in (self.system, self.tools_prompt()) if t) or NO_TOOLS

    def assistant(self, text: str, calls: Sequence[tuple[str, str]], ids: Sequence[str] = ()) -> dict:
        """An assistant turn with its calls ((name, arguments' JSON text) each), as the template takes it."""
        if not self.templated or not calls:
            return {"role": "assistant", "content": self.codec.render_calls(text, calls)}
        ids = list(ids) or [self.codec.call_id(i) for i in range(len(calls))]
        return {"role": "assistant", "content": text, "tool_calls": [
            {"id": self.codec.template_id(i), "type": "function", "function": {"name": n, "arguments": _object(a)}}
            for (n, a), i in zip(calls, ids)]}

    def tool(self, result: str, *, name: str = "", call_id: str = "") -> dict:
        """A tool turn carrying one result: wrapped by the template (or by the codec, where the template
        does not know the format)."""
        if not self.templated:
            return {"role": "tool", "content": self.codec.render_result(result)}
        return {"role": "tool", "content": result, "name": name, "tool_call_id": self.codec.template_id(call_id)}

    def examples(self) -> list[dict]:
        out = []
        for question, expression, result in EXAMPLES:
            call = [("calculator", as_json({"expression": expression}))]
            ident = self.codec.call_id(0, "example")
            out += [{"role": "user", "content": question}, self.assistant("", call, [ident]),
                    self.tool(result, name="calculator", call_id=ident),
                    {"role": "assistant", "content": f"The answer is {result}."}]
        return out

    def messages(self, task: str) -> list[dict]:
        system = self.system_prompt()
        msgs = [{"role": "system", "content": system}] if system else []
        if self.example:
            msgs += self.examples()
        return msgs + [{"role": "user", "content": task}]

    # ------------------------------------------------------------------ their tokens
    def tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (None where the system prompt lists them)."""
        return [function(s) for s in self.schemas] if self.templated and self.schemas else None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools=self.tools(), add_generation_prompt=True)

    def prompt_ids_and_marks(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """The prompt, and where each message before the last ends in it: the boundaries of its
        canonical prefill segments, so the shared part of every prompt (system prompt, tools,
        example) is prefilled once and reused exactly (hybridlm.engine.prefill)."""
        tok = self.tokenizer
        ids = self.prompt_ids(messages)
        marks = []
        # The first message (the system prompt with the tools) and the last few: what other prompts share
        # (other conversations, this one's next request). A mark after every message would render every
        # prefix (quadratic in the conversation) and prefill in segments of a message each (slow).
        n = len(messages)
        for i in sorted({1, *range(max(1, n - MARKED_LAST), n)} & set(range(1, n))):
            try:
                head = tok.encode_chat(messages[:i], tools=self.tools(), add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - a template may refuse a conversation cut there (no user turn yet)
                continue
            if len(head) < len(ids) and ids[: len(head)] == head:
                marks.append(len(head))
        return ids, marks

    def observation_ids(self, messages: list[dict], observations: str | list[str], *,
                        turn_closed: bool = False, names: Sequence[str] = (), ids: Sequence[str] = ()) -> list[int]:
        """enc(y): close the assistant turn, a tool turn with each observation y (in the order of the
        calls, `names` and `ids` theirs), open the next assistant turn.

        `messages` ends with the assistant turn that made the call(s), as the model wrote it;
        `turn_closed` says the model already emitted the end-of-turn token (an unconstrained call
        cut short, or a turn of parallel calls).
        """
        tok = self.tokenizer
        if isinstance(observations, str):
            observations = [observations]
        # Rendered with the special-token strings of the messages and observations marked as text: only the
        # template's own text becomes special tokens (a tool's output cannot close its turn).
        tools = self.tools()
        before = tok.render_chat_marked(messages, tools=tools, add_generation_prompt=False)
        after = tok.render_chat_marked([*messages, *self.tool_turns(observations, names, ids)], tools=tools,
                                       add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render conversations as growing prefixes")
        # `before` ends with the rendered end of the assistant turn, which the model has not
        # generated (generation stops at the call's end): inject it as part of enc(y).
        content = tok.mark_untrusted(messages[-1]["content"])
        call_end = before[before.rindex(content) + len(content):]
        if turn_closed:
            for stop in sorted(tok.end_of_turn_ids, key=lambda i: i != tok.end_of_turn_id):
                piece = tok.token_str(stop)
                if piece and call_end.startswith(piece):
                    call_end = call_end.removeprefix(piece)
                    break
        return tok.encode_rendered(call_end + after[len(before):])

    def rendered_turn_ids(self, messages: list[dict], turn: dict, observations: Sequence[str] = (),
                          names: Sequence[str] = (), ids: Sequence[str] = ()) -> list[int] | None:
        """The assistant turn `turn` (its calls structured) and a tool turn per observation, then the
        opening of the next assistant turn, as the template renders them after the generation prompt
        that opened the turn; None where the rendering of `messages` with that prompt is not a prefix."""
        tok, tools = self.tokenizer, self.tools()
        opened = tok.render_chat_marked(messages, tools=tools, add_generation_prompt=True)
        after = tok.render_chat_marked([*messages, turn, *self.tool_turns(observations, names, ids)], tools=tools,
                                       add_generation_prompt=True)
        if not after.startswith(opened):
            return None
        return tok.encode_rendered(after[len(opened):])

    def rewrite(self, messages: list[dict], turn: dict, held: Sequence[int], observations: Sequence[str] = (),
                names: Sequence[str] = (), ids: Sequence[str] = ()) -> tuple[int, list[int]] | None:
        """ρ of the jump map (docs/theory.md §4): how many of the tokens `held` that the model wrote in its
        turn agree with the template's rendering of `turn` (`rendered_turn_ids`), and the rendering's tokens
        after them; None where the template does not render the conversation as growing prefixes."""
        rendered = self.rendered_turn_ids(messages, turn, observations, names, ids)
        if rendered is None:
            return None
        same = 0
        while same < min(len(held), len(rendered)) and held[same] == rendered[same]:
            same += 1
        return same, rendered[same:]

    def tool_turns(self, observations: Sequence[str], names: Sequence[str] = (), ids: Sequence[str] = ()) -> list[dict]:
        """The tool turns of a jump's observations, in the order of its calls."""
        names = list(names) + [""] * (len(observations) - len(names))
        ids = list(ids) + [self.codec.call_id(i) for i in range(len(ids), len(observations))]
        return [self.tool(y, name=n, call_id=i) for y, n, i in zip(observations, names, ids)]


def _object(arguments: str):
    """A call's arguments as templates render them (an object, which their `tojson` writes)."""
    import json

    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError, TypeError):
        return arguments
    return value if isinstance(value, dict) else arguments
