"""Fuzz the server's request parsing: any bytes as the body of /v1/chat/completions and
/v1/completions, then the conversation's rendering and the reading of calls from text.

A bug is any exception but the server's own APIError (an OpenAI error body), or an error
message of more than one line.

    python fuzz/server_request.py fuzz_corpus/ -max_total_time=60   (see fuzz/README.md)
"""

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.server import chat
    from hybridlm.server.wire import APIError, parse_chat, parse_completion
    from hybridlm.turns import TAGGED_JSON, Protocol, render
    from hybridlm.turns.codecs.json_text import scan_object

from common import run


def test_one_input(data: bytes) -> None:
    for parse in (parse_chat, parse_completion):
        try:
            body = parse(data)
        except APIError as exc:
            assert "\n" not in exc.message and exc.status == 400, exc.message
            continue
        if parse is parse_chat:
            try:
                chat.pending_tool_results(body.messages)
            except APIError:
                pass
            rendered = chat.template_messages(body.messages, Protocol(None, codec=TAGGED_JSON))
            texts = [m["content"] for m in rendered]
            render(texts, final=False, stops=("\n",), client_tools=frozenset({"get_weather"}))
            for text in texts:
                scan_object(text)
                TAGGED_JSON.scan(text, final=False)


if __name__ == "__main__":
    run(test_one_input)
