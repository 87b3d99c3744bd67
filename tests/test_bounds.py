"""The cheap bounds of a request body and the process that reads a big body first
(hybridlm.server.bounds). References: the server's own in-process reading of the same bytes
(`parse_chat`, which a small body gets) for the refusal, and a recursive count of JSON values
written from the definition for `count_values`."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from hybridlm.server.bounds import MAX_VALUES, SCREEN_BYTES, Screen, count_values, verdict
from hybridlm.server.wire import APIError, parse_chat, refusal


def values_of(node) -> int:
    """JSON values by definition: the value itself, plus each key and each member's values."""
    if isinstance(node, dict):
        return 1 + len(node) + sum(values_of(v) for v in node.values())
    if isinstance(node, list):
        return 1 + sum(values_of(v) for v in node)
    return 1


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                        max_size=4), max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(json_values, st.integers(min_value=1, max_value=60))
def test_count_values_counts_to_the_limit(data, limit):
    assert count_values(data, 10**9) == values_of(data)
    assert count_values(data, limit) == min(values_of(data), limit)


def ask(**more) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **more}


def call(i: int, arguments: str = "{}") -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}


HOSTILE = {
    "85,000 tool calls": ask(messages=[{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": None, "tool_calls": [call(i) for i in range(85_000)]}]),
    "2,100 calls in 100-call messages": ask(messages=[
        {"role": "assistant", "content": None, "tool_calls": [call(100 * k + i, json.dumps({"note": "x" * 80}))
                                                  for i in range(100)]} for k in range(21)]),
    "256,870 logit_bias entries": ask(logit_bias={str(i): 1 for i in range(256_870)}),
    "a tool schema of 150,000 values": ask(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {f"p{i}": {} for i in range(75_000)}}}}]),
}


def refused_here(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat(raw)
    return info.value


@pytest.fixture(scope="module")
def screen():
    s = Screen()
    yield s
    s.close()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_big_body_is_refused_by_the_screen_as_the_server_refuses_it(screen, name):
    raw = json.dumps(HOSTILE[name]).encode()
    assert len(raw) >= SCREEN_BYTES
    said = screen.check(raw)
    assert not said.get("ok"), said
    ours, reference = refusal(said), refused_here(raw)
    assert (ours.status, ours.message, ours.param) == (reference.status, reference.message, reference.param)


def test_the_value_bound_names_its_limit(screen):
    said = screen.check(json.dumps(HOSTILE["a tool schema of 150,000 values"]).encode())
    assert f"{MAX_VALUES:,} JSON values" in said["bound"]


@pytest.mark.parametrize("raw", [
    b"{" + b" " * SCREEN_BYTES + b'"model": ',  # cut short
    b'{"model": "m", "messages": [' + b'"x", ' * 60_000 + b"]",  # unclosed
    b"[" * 100_000 + b"]" * 100_000,  # nested past the reader's depth
])
def test_a_big_body_that_is_not_a_request_is_refused_in_the_server_s_words(screen, raw):
    ours, reference = refusal(screen.check(raw)), refused_here(raw)
    assert (ours.status, ours.message) == (reference.status, reference.message)


def test_a_big_body_within_bounds_passes_and_a_dead_child_is_replaced(screen):
    raw = json.dumps(ask(messages=[{"role": "user", "content": "word " * SCREEN_BYTES}])).encode()
    assert screen.check(raw) == {"ok": True} == verdict(raw)
    assert screen.child is not None
    screen.child.kill()
    screen.child.wait()
    assert screen.check(raw) == {"ok": True}
