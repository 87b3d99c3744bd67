"""The conversation of a turn-taking run, rendered with the model's own chat template.

The system prompt lists the offered tools and teaches their call format (the codec's part);
one worked example (a user question, a call, its result, an answer) follows as ordinary chat
turns when the calculator is offered, because a small model follows an example better than
a rule. Every piece of text is rendered with the model's chat template: the block that the
jump map injects, enc(y), is the difference between the rendering of the conversation with
and without the tool turns, followed by the opening of the next assistant turn.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridlm.turns.codecs import TAGGED_JSON, CallCodec
from hybridlm.turns.codecs.json_text import as_json

CALCULATOR_RULE = "Use the calculator for every calculation; never compute in your head.\n"
MARKED_LAST = 4  # message boundaries marked at the end of a prompt (besides the system prompt's)
NO_TOOLS = "You are a helpful assistant. Answer in one short sentence."

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


class Protocol:
    """Renders the conversation of a run with the tokenizer's chat template, its calls and results
    in the call format of `codec`."""

    def __init__(self, tokenizer, tools: Iterable = (), *, example: bool = True,
                 codec: CallCodec = TAGGED_JSON) -> None:
        self.tokenizer, self.codec = tokenizer, codec
        self.schemas = [schema_of(t) for t in tools]
        self.example = example and any(s["name"] == "calculator" for s in self.schemas)

    # ------------------------------------------------------------------ the messages
    def tools_prompt(self) -> str:
        """The system prompt's tool part ("" when no tool is offered)."""
        if not self.schemas:
            return ""
        rules = CALCULATOR_RULE if any(s["name"] == "calculator" for s in self.schemas) else ""
        return self.codec.tools_prompt(self.schemas, rules=rules)

    def system_prompt(self) -> str:
        return self.tools_prompt() or NO_TOOLS

    def examples(self) -> list[dict]:
        codec, out = self.codec, []
        for question, expression, result in EXAMPLES:
            call = codec.render_calls("", [("calculator", as_json({"expression": expression}))])
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": call},
                    {"role": "tool", "content": codec.render_result(result)},
                    {"role": "assistant", "content": f"The answer is {result}."}]
        return out

    def messages(self, task: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.system_prompt()}]
        if self.example:
            msgs += self.examples()
        return msgs + [{"role": "user", "content": task}]

    # ------------------------------------------------------------------ their tokens
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

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
            head = tok.encode_chat(messages[:i], add_generation_prompt=False)
            if len(head) < len(ids) and ids[: len(head)] == head:
                marks.append(len(head))
        return ids, marks

    def observation_ids(self, messages: list[dict], observations: str | list[str], *,
                        turn_closed: bool = False) -> list[int]:
        """enc(y): close the assistant turn, a tool turn with each observation y (in the order of the
        calls), open the next assistant turn.

        `messages` ends with the assistant turn that made the call(s); `turn_closed` says the
        model already emitted the end-of-turn token (an unconstrained call cut short, or a turn
        of parallel calls).
        """
        tok = self.tokenizer
        if isinstance(observations, str):
            observations = [observations]
        # Rendered with the special-token strings of the messages and observations marked as text: only the
        # template's own text becomes special tokens (a tool's output cannot close its turn).
        before = tok.render_chat_marked(messages, add_generation_prompt=False)
        tool_turns = [{"role": "tool", "content": self.codec.render_result(y)} for y in observations]
        after = tok.render_chat_marked([*messages, *tool_turns], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render conversations as growing prefixes")
        # `before` ends with the rendered end of the assistant turn, which the model has not
        # generated (generation stops at the call's end): inject it as part of enc(y).
        content = tok.mark_untrusted(messages[-1]["content"])
        call_end = before[before.rindex(content) + len(content):]
        if turn_closed and tok.end_of_turn_id is not None:
            call_end = call_end.removeprefix(tok.token_str(tok.end_of_turn_id))
        return tok.encode_rendered(call_end + after[len(before):])
