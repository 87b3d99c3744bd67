"""A long trace gives a report whose memory and page are bounded by what the page draws, not by the trace.

The report reads the trace as a stream and keeps a uniform sample of its token steps and table rows
(`hybridlm.report.arc.Thinned`); the counts, phases and rates count every event. Checked against the closed
form of the sample (the smallest power-of-two stride s with ⌈N/s⌉ ≤ cap, the last item added) and by
tracemalloc's peak, which must not grow with the number of events.
"""

import json
import math
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.report import arc as report_arc
from hybridlm.report import render_arc_report, report_html
from hybridlm.report.arc import Thinned, arc_view


def closed_form(n: int, cap: int) -> list[int]:
    """The positions a uniform sample of n items under `cap` keeps: every s-th, s the smallest power of two
    with ⌈n/s⌉ ≤ cap, and the last."""
    s = 1
    while math.ceil(n / s) > cap:
        s *= 2
    kept = list(range(0, n, s))
    return kept if not n or kept[-1] == n - 1 else [*kept, n - 1]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 64))
def test_thinned_is_the_closed_form_sample(n, cap):
    sample = Thinned(cap)
    for i in range(n):
        sample.add(i)
    assert sample.result() == closed_form(n, cap) == sample.indices()
    assert len(sample.items) <= cap
    assert sample.seen == n


def arc_events(n: int, jumps: int = 3):
    """A generated arc of n token steps with `jumps` calculator jumps spread over it, made lazily: a start, a
    prefill and a decode phase, then tokens (each 14 ms of wall time), each jump an external phase of 0.5 s
    followed by a prefill of 7 tokens (0.1 s) and a decode phase, and an end event."""
    wall = 0.0
    yield {"event": "start", "t": 0, "k": 0, "wall_s": wall, "task": "2 + 2", "model": "generated", "layers": 30}
    yield {"event": "phase", "t": 0, "k": 0, "wall_s": wall, "phase": "prefill", "mode": "q_G", "tokens": 20}
    wall += 0.2
    yield {"event": "phase", "t": 0, "k": 0, "wall_s": wall, "phase": "decode", "mode": "q_G"}
    at = {n * (j + 1) // (jumps + 1) for j in range(jumps)}
    k = 0
    for t in range(1, n + 1):
        wall += 0.014
        yield {"event": "token", "t": t, "k": k, "wall_s": round(wall, 6), "token": t % 500, "text": f"w{t % 97} ",
               "logprob": -0.01 * (t % 7), "kernel_logprob": 0.0, "phase": "decode"}
        if t in at:
            yield {"event": "phase", "t": t, "k": k, "wall_s": round(wall, 6), "phase": "external", "mode": "q_E"}
            wall += 0.5
            k += 1
            yield {"event": "jump", "t": t, "k": k, "wall_s": round(wall, 6), "tool": "calculator",
                   "arguments": {"expression": "2 + 2"}, "observation": "4", "error": None, "duration_s": 0.5}
            yield {"event": "phase", "t": t, "k": k, "wall_s": round(wall, 6), "phase": "prefill", "mode": "q_G",
                   "tokens": 7}
            wall += 0.1
            yield {"event": "phase", "t": t, "k": k, "wall_s": round(wall, 6), "phase": "decode", "mode": "q_G"}
    yield {"event": "end", "t": n, "k": k, "wall_s": round(wall, 6), "stop_reason": "stop_token", "token_steps": n,
           "jumps": k, "answer": "4"}


@pytest.fixture
def small_caps(monkeypatch):
    """Caps small enough that a few thousand events are a 'long' trace (the page's real caps are 20,000)."""
    monkeypatch.setattr(report_arc, "MAX_POINTS", 64)
    monkeypatch.setattr(report_arc, "MAX_ROWS", 8)
    return 64


@pytest.mark.parametrize("n", [10, 64, 65, 1000, 4097])
def test_a_long_arc_draws_a_named_sample_and_counts_every_event(small_caps, n):
    html = render_arc_report(arc_events(n, jumps=3))
    view = json.loads(html.split('id="report-data">', 1)[1].split("</script>", 1)[0])
    kept = closed_form(n, small_caps)
    assert view["tokens"]["t"] == [i + 1 for i in kept]  # token step t is position + 1
    assert view["totals"] == {"token_steps": n, "jumps": 3, "controls": 0, "marks": 0}
    # the phases are exact: their token steps add up to n, and the 3 external phases took 0.5 s each
    assert sum(p["steps"] for p in view["phases"]) == n
    assert [p["wall1"] - p["wall0"] for p in view["phases"] if p["phase"] == "external"] == pytest.approx([0.5] * 3)
    # the rates count every token step: n of them in (n · 14 ms + 0.2 s + 3 · 0.1 s) of q_G
    q_G = n * 0.014 + 0.2 + 3 * 0.1
    assert view["rates"].startswith(f"{n} token steps in {q_G:.2f} s of q_G")
    assert view["wall_curve"][-1][1] == pytest.approx(q_G + 1.5)  # the last point is the end event's wall time
    said = [s for s in view["sampled"] if "token steps" in s]
    if len(kept) < n:
        stride = {2: "2nd", 16: "16th", 128: "128th"}[kept[1] - kept[0]]
        assert said == [f"{n:,} token steps: the page draws every {stride} ({len(kept):,}, the last included); "
                        "the counts, phases and rates count every one"]
    else:
        assert said == []


def _peak(make, *args) -> int:
    """tracemalloc's peak while make(*args) runs (what it returns is dropped inside)."""
    tracemalloc.start()
    try:
        make(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_and_page_do_not_grow_with_the_trace(small_caps):
    """The bound is what the page needs: a trace of `cap` token steps, which the page draws whole. A trace of
    60× or 250× as many holds no more at its peak (the sample is at most cap rows), and far less than its events
    would hold as a list (each event ~400 bytes as a dict)."""
    cap = small_caps
    render_arc_report(arc_events(cap))  # one-time costs (the page's script and style, the package's version)
    peaks = {n: _peak(render_arc_report, arc_events(n)) for n in (cap, 4000, 16000)}
    whole = peaks[cap]
    assert peaks[4000] <= 1.1 * whole + 16 * 1024 and peaks[16000] <= 1.1 * whole + 16 * 1024, peaks
    held = _peak(list, arc_events(16000))
    assert peaks[16000] < held / 5, (peaks, held)
    pages = {n: len(render_arc_report(arc_events(n))) for n in (cap, 16000)}
    assert pages[16000] <= 1.1 * pages[cap], pages


def test_a_trace_file_is_read_as_a_stream(small_caps, tmp_path):
    """The CLI's path (`report_html` on a file): the same bound through the trace reader."""
    peaks = {}
    for size in (500, 2000):
        path = tmp_path / f"arc{size}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in arc_events(size)), encoding="utf-8")
        report_html(path)  # the schema's validator is built once, on first use
        peaks[size] = _peak(report_html, path)
        assert f'"token_steps":{size}' in report_html(path)[1]
    assert peaks[2000] <= 1.1 * peaks[500] + 64 * 1024, peaks


def test_a_list_of_events_is_still_accepted(small_caps):
    events = list(arc_events(100))
    assert arc_view(events) == arc_view(iter(events))


def plant_events(n: int):
    """A plant sampled n times over 10 s of plant time (x = plant time), with two commands (u = 1 from 2 s,
    u = 0 from 6 s), barrier values at the first sample (h = 1, inside the band) and the state leaving the band
    at 3 s and entering it again at 4.5 s."""
    yield {"event": "start", "t": 0, "k": 0, "wall_s": 0.0, "task": "hold", "model": "generated", "horizon_s": 10.0}
    marks = {2.0: {"kind": "command", "commanded": [1.0]}, 3.0: {"kind": "crossing", "direction": "leave"},
             4.5: {"kind": "crossing", "direction": "enter"}, 6.0: {"kind": "command", "commanded": [0.0]}}
    for i in range(n):
        time = 10.0 * i / n
        yield {"event": "plant", "t": 0, "k": 0, "wall_s": time, "plant_t": time, "state": [time],
               **({"h": {"band": 1.0}} if i == 0 else {})}
        for at in [at for at in marks if time <= at < 10.0 * (i + 1) / n]:
            yield {"event": "plant", "t": 0, "k": 0, "wall_s": at, "plant_t": at, "state": [at], **marks[at]}
    yield {"event": "end", "t": 0, "k": 0, "wall_s": 10.0, "stop_reason": "token_budget", "answer": ""}


@pytest.mark.parametrize("n", [40, 5000])
def test_a_long_plant_run_keeps_its_commands_and_crossings(small_caps, n):
    plant = arc_view(plant_events(n))["plant"]["plants"][0]
    assert plant["held"]["time"] == [2.0, 6.0] and plant["held"]["u"] == {"u[0]": [1.0, 0.0]}
    assert plant["safe"]["in_band_s"] == pytest.approx(10.0 - 1.5) and plant["safe"]["left"] == 1
    assert len(plant["time"]) <= small_caps + 1 + 4  # the sample, its last, and the four marks
    assert plant["time"] == sorted(plant["time"]) and plant["time"][0] == 0.0
