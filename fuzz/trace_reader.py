"""Fuzz the trace reader: every event against the published schema, the timeline of `trace show`,
and the checks `trace replay` makes before it loads a model."""

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.engine.trace import format_timeline, read_trace
    from hybridlm.cli.trace import check_replayable
    from hybridlm.errors import HybridLMError

from common import run, scratch


def test_one_input(data: bytes) -> None:
    path = scratch("trace.jsonl", data)
    try:
        events = read_trace(path)
        format_timeline(events)
        format_timeline(events, tokens=True)
        check_replayable(path)
    except HybridLMError:
        pass


if __name__ == "__main__":
    run(test_one_input)
