"""The tool-call protocol inside the model's chat template.

The system prompt lists the tools with their JSON schemas and shows the format; one
worked example (a user question, a call, a `<tool_response>`, an answer) follows as
ordinary chat turns, because a small model follows an example better than a rule.
A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the observation
returns as a turn of role `tool` holding `<tool_response>y</tool_response>`.

Every piece of text is rendered with the model's own chat template: the block that the
jump map injects, enc(y), is the difference between the rendering of the conversation
with and without the tool turn, followed by the opening of the next assistant turn.
"""

from __future__ import annotations

import json

from hybridlm.constraints import CLOSE, OPEN
from hybridlm.agent.tools import ToolRegistry

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

SYSTEM = (
    "You are a helpful assistant that can call tools. To call a tool, reply with exactly\n"
    f'{OPEN}{{"name": TOOL_NAME, "arguments": {{...}}}}{CLOSE}\n'
    f"and wait: the result comes back as {RESPONSE_OPEN}...{RESPONSE_CLOSE}. "
    "Then answer the user in one short sentence that states the result.\n"
    "If the result is an error, read it, fix the arguments and call again.\n"
)
CALCULATOR_RULE = "Use the calculator for every calculation; never compute in your head.\n"
TOOLS_HEADER = "Tools (JSON schemas):\n"


def _example(question: str, expression: str, result: str) -> list[tuple[str, str]]:
    call = f'{OPEN}{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}{CLOSE}'
    return [("user", question), ("assistant", call), ("tool", f"{RESPONSE_OPEN}{result}{RESPONSE_CLOSE}"),
            ("assistant", f"The answer is {result}.")]


# The worked example is the calculator's: shown only when the calculator is offered.
EXAMPLE = [
    *_example("A shop has 37 shelves with 21 jars on each shelf. How many jars are there?", "37 * 21", "777"),
    *_example("What is 5230 minus 148?", "5230 - 148", "5082"),
]


def tools_prompt(schemas: list[dict]) -> str:
    """The system prompt's tool part: the call format, the rules, and each tool's JSON schema
    ({"name", "description", "parameters"}) on a line of its own."""
    rule = CALCULATOR_RULE if any(s.get("name") == "calculator" for s in schemas) else ""
    return SYSTEM + rule + TOOLS_HEADER + "\n".join(as_json(s) for s in schemas)


def call_text(name: str, arguments: dict) -> str:
    return f"{OPEN}{as_json({'name': name, 'arguments': arguments})}{CLOSE}"


def as_json(value) -> str:
    """JSON as the call constraint writes it: non-ASCII characters as themselves (a name such as
    天气 shown as \\u5929\\u6c14 is one the constraint would not let the model write), escaped
    only where the text holds a lone surrogate, which UTF-8 cannot carry."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


class Protocol:
    """Renders the conversation of an agent run with the tokenizer's chat template."""

    def __init__(self, tokenizer, tools: ToolRegistry, *, example: bool = True) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.example = example and "calculator" in tools

    def system_prompt(self) -> str:
        if not self.tools.tools:
            return "You are a helpful assistant. Answer in one short sentence."
        return tools_prompt([t.schema() for t in self.tools])

    def messages(self, task: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.system_prompt()}]
        if self.example:
            msgs += [{"role": r, "content": c} for r, c in EXAMPLE]
        return msgs + [{"role": "user", "content": task}]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_markup(self.tokenizer.render_chat(messages, add_generation_prompt=True))

    def prompt_ids_and_marks(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """The prompt, and where each message before the last ends in it: the boundaries of its
        canonical prefill segments, so the shared part of every prompt (system prompt, tools,
        example) is prefilled once and reused exactly (hybridlm.engine.prefill)."""
        tok = self.tokenizer
        ids = self.prompt_ids(messages)
        marks = []
        for i in range(1, len(messages)):
            head = tok.encode_markup(tok.render_chat(messages[:i], add_generation_prompt=False))
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
        before = tok.render_chat(messages, add_generation_prompt=False)
        tool_turns = [{"role": "tool", "content": f"{RESPONSE_OPEN}{y}{RESPONSE_CLOSE}"} for y in observations]
        after = tok.render_chat([*messages, *tool_turns], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render conversations as growing prefixes")
        # `before` ends with the rendered end of the assistant turn, which the model has not
        # generated (generation stops at </tool_call>): inject it as part of enc(y).
        content = messages[-1]["content"]
        call_end = before[before.rindex(content) + len(content):]
        if turn_closed and tok.end_of_turn_id is not None:
            call_end = call_end.removeprefix(tok.token_str(tok.end_of_turn_id))
        return tok.encode_markup(call_end + after[len(before):])
