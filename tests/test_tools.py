"""Tools: the safe arithmetic evaluator, the schema decorator, the built-ins, the CLI around them."""

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, strategies as st

from hybridlm.agent.evaluation import correct, last_number, problems
from hybridlm.tools import evaluate_arithmetic, lookup_tool, registry, tool
from hybridlm.errors import InputError


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.sampled_from(["+", "-", "*"]))
def test_calculator_matches_python_arithmetic(a, b, op):
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert evaluate_arithmetic(f"{a} {op} ({b})") == expected


def test_calculator_closed_forms():
    assert evaluate_arithmetic("123456 * 789") == 97406784
    assert evaluate_arithmetic("(2 + 3) * 4 ** 2 / 8") == 10
    assert evaluate_arithmetic("7 // 2 + 7 % 2") == 4
    assert evaluate_arithmetic("sqrt(144) + abs(-3)") == 15
    assert evaluate_arithmetic("1,000 × 3") == 3000


@pytest.mark.parametrize("bad", ["__import__('os').system('true')", "open('/etc/passwd')", "x + 1",
                                 "(1).__class__", "[1, 2]", "lambda: 1", "2 ** 100000", "", "1 +"])
def test_calculator_refuses_everything_but_arithmetic(bad):
    with pytest.raises(ValueError):
        evaluate_arithmetic(bad)


def test_decorator_builds_json_schema():
    @tool(timeout_s=2)
    def area(width: float, height: float, label: str = "") -> str:
        """Area of a rectangle.

        More words."""
        return str(width * height)

    assert area.name == "area" and area.description == "Area of a rectangle." and area.timeout_s == 2
    assert area.parameters == {
        "type": "object",
        "properties": {"width": {"type": "number"}, "height": {"type": "number"}, "label": {"type": "string"}},
        "required": ["width", "height"],
        "additionalProperties": False,
    }
    def takes_list(xs: list) -> str:
        return ""

    with pytest.raises(InputError, match="parameter 'xs' has type <class 'list'>"):
        tool(takes_list)


def test_lookup_over_local_kb(tmp_path):
    kb = tmp_path / "kb.json"
    kb.write_text(json.dumps({"Boiling point of water": "100 °C", "pi": 3.14159}))
    reg = registry(["lookup"], kb=kb)
    assert reg.call("lookup", {"key": "Boiling point of water"}).text == "100 °C"
    miss = reg.call("lookup", {"key": "gold"})  # the schema's enum names the keys
    assert miss.error == "invalid_arguments" and "'gold' is not one of" in miss.text
    with pytest.raises(InputError, match="knowledge base"):
        registry(["lookup"])
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(InputError, match="cannot read it as JSON"):
        lookup_tool(tmp_path / "bad.json")


def test_clock_and_unknown_builtin():
    reg = registry(["clock"])
    assert reg.call("clock", {}).text[:2] == "20"
    with pytest.raises(InputError, match="unknown tool"):
        registry(["shell"])


def test_evaluation_set_is_deterministic_and_checked():
    ps = problems(50)
    assert len(ps) == 50 and ps == problems(50)
    for p in ps:
        assert evaluate_arithmetic(p.expression) == p.answer
    assert last_number("The answer is 1,234.") == 1234 and correct("so 42.", 42) and not correct("none", 1)


def test_agent_cli_json_and_trace_show(tmp_path):
    from hybridlm.cli import cli

    path = tmp_path / "arc.jsonl"
    r = CliRunner().invoke(cli, ["agent", "What is 123456 * 789?", "--json", "--trace", str(path)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert "97406784" in out["answer"]
    assert out["jumps"][0]["tool"] == "calculator" and out["jumps"][0]["observation"] == "97406784"
    assert out["token_steps"] > 0 and out["trace"] == str(path)
    shown = CliRunner().invoke(cli, ["trace", "show", str(path)])
    assert shown.exit_code == 0 and "JUMP 1: calculator" in shown.output
    bad = CliRunner().invoke(cli, ["agent", "  "])
    assert bad.exit_code == 2 and "empty task" in bad.output
    bad = CliRunner().invoke(cli, ["agent", "x", "--tools", "shell"])
    assert bad.exit_code == 2 and "unknown tool 'shell'" in bad.output


def test_a_remote_ref_in_a_tool_schema_is_never_fetched():
    """jsonschema would download the URL a tool's $ref names; the registry's check must not."""
    import http.server
    import threading

    from hybridlm.tools import Tool, ToolRegistry

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = b'{"type": "integer"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/s.json"
        reg = ToolRegistry()
        reg.register(Tool("far", "d", {"type": "object", "properties": {"n": {"$ref": url}}}, lambda n: "ran"))
        reg.register(Tool("near", "d", {"$defs": {"N": {"type": "integer"}}, "type": "object",
                                        "properties": {"n": {"$ref": "#/$defs/N"}}}, lambda n: f"got {n}"))
        far = reg.call("far", {"n": 3})
        assert far.error == "invalid_arguments" and "Unresolvable" in far.text and hits == []
        assert reg.call("near", {"n": 3}).text == "got 3"  # local references still resolve
        assert reg.call("near", {"n": "x"}).error == "invalid_arguments"
    finally:
        httpd.shutdown()
