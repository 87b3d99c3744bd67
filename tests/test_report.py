"""The HTML report, opened in a real browser (Debian's chromium, driven by playwright).

Each report is checked in headless Chromium: no console error, no request but the file
itself, one mark per token step and per jump of the trace, hovers that show the token's
text and the values, and a screenshot written as PNG. The data comes from a real agent
run on the default model (with its final-layer states), a real consensus run on a small
GPT-2 and real survey runs; the counts are taken from the trace and the CSV/JSON files
directly.
"""

import csv
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.agent import HybridAgent, Limits
from hybridlm.engine.trace import read_trace
from hybridlm.tools import registry
from hybridlm.cli import cli
from tests.chromium import launched
from hybridlm.report import arc_view, load_states, pca_2d, render_arc_report, write_report

TASK = "What is 123456 * 789?"


# ---------------------------------------------------------------------- data: real runs
@pytest.fixture(scope="module")
def real_arc(smollm2, tmp_path_factory):
    """A real arc of the default model with the calculator, its trace and its final-layer states."""
    path = tmp_path_factory.mktemp("arc") / "arc.jsonl"
    agent = HybridAgent(smollm2, registry(["calculator"]), limits=Limits(max_token_steps=160, max_jumps=3),
                        record_states=True)
    arc = agent.run(TASK, trace=path)
    assert arc.jumps, "the default model made no tool call for the calculator task"
    states, _ = load_states(path.with_suffix(".safetensors"))
    return path, read_trace(path), states


def extend_arc(events: list[dict], states: np.ndarray, *, jumps: int, token_steps: int):
    """A longer arc made of a real arc's own events: its call segment (the call's tokens, the
    external phase, the jump, the observation's prefill) `jumps` times, a piece of its answer
    between calls, and its answer cycled to `token_steps` tokens; each copied event keeps its
    wall-time gap to the event before it, each copied token its recorded state.

    The default model makes one call per task, so a 3-jump arc is built this way."""
    index = {id(e): i for i, e in enumerate(events)}
    row_of, r = {}, 0
    for e in events:
        if e["event"] == "token":
            row_of[id(e)] = r
            r += 1
    first_jump = next(i for i, e in enumerate(events) if e["event"] == "jump")
    call_start = max(i for i, e in enumerate(events[:first_jump]) if e["event"] == "phase" and e["phase"] != "external"
                     and any(x["event"] == "token" for x in events[i:first_jump]))
    call_end = next(i for i in range(first_jump, len(events)) if events[i]["event"] == "phase"
                    and events[i]["phase"] == "decode")
    call = events[call_start:call_end]  # constrained phase … jump … prefill of the observation
    decode = events[call_end]
    answer = [e for e in events[call_end + 1:] if e["event"] == "token"]
    plan = list(events[:call_start])
    for j in range(jumps):
        plan += call
        if j < jumps - 1:
            plan += [decode] + answer[: len(answer) // 2]
    plan.append(decode)
    need = token_steps - sum(e["event"] == "token" for e in plan)
    body = answer[:-1]
    plan += [body[i % len(body)] for i in range(need - 1)] + [answer[-1]]
    out, rows, t, k, wall, prev = [], [], 0, 0, 0.0, None
    for e in plan:
        gap = e["wall_s"] - prev["wall_s"] if prev is not None and index[id(e)] > index[id(prev)] else 0.02
        wall = round(wall + max(gap, 0.0) if prev is not None else e["wall_s"], 6)
        prev = e
        e = dict(e, wall_s=wall)
        if e["event"] == "token":
            t += 1
            rows.append(states[row_of[id(prev)]])
        elif e["event"] == "jump":
            k += 1
        if e["event"] == "start":
            e["limits"] = dict(e["limits"], max_token_steps=token_steps, max_jumps=jumps)
        out.append(dict(e, t=t, k=k))
    external = sum(e["duration_s"] for e in out if e["event"] == "jump")
    end = dict(events[-1], t=t, k=k, wall_s=round(wall + 0.001, 6), token_steps=t, jumps=k,
               wall_external_s=external, wall_generate_s=round(wall + 0.001 - external, 6))
    out.append(end)
    return out, np.stack(rows)


@pytest.fixture(scope="module")
def long_arc(real_arc, tmp_path_factory):
    """The measured case: 160 token steps and 3 jumps, written as a trace with its states beside it."""
    from safetensors.numpy import save_file

    _, events, states = real_arc
    long_events, long_states = extend_arc(events, states, jumps=3, token_steps=160)
    path = tmp_path_factory.mktemp("long") / "arc160.jsonl"
    path.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in long_events), encoding="utf-8")
    save_file({"resid_final": long_states.astype(np.float32)}, str(path.with_suffix(".safetensors")))
    return path, read_trace(path), long_states


@pytest.fixture(scope="module")
def consensus_runs(toy_hub, tmp_path_factory):
    """Two real consensus runs of a 2-layer GPT-2 (full blocks, attention only) in one folder."""
    from hybridlm.analysis.runner import ConsensusConfig, run_consensus

    folder = tmp_path_factory.mktemp("consensus")
    for name, attention_only in (("full", False), ("attention-only", True)):
        cfg = ConsensusConfig(model=str(toy_hub[0]), attention_only=attention_only, prompts=3, prompt_len=8, passes=4)
        run_consensus(cfg, folder / name, progress=False)
    return folder


@pytest.fixture(scope="module")
def survey_runs(tmp_path_factory):
    from hybridlm.optimal.runs import run_adjoint, run_euler

    folder = tmp_path_factory.mktemp("survey")
    run_adjoint(folder / "adjoint", depth=5, width=3, samples=4, steps=5)
    run_euler(folder / "euler", depths=(4, 8, 16), width=3, samples=4)
    return folder


# ---------------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with launched(tmp_path_factory.mktemp("chromium-profile"), viewport={"width": 1100, "height": 900}) as context:
        yield context


class Opened:
    def __init__(self, page, errors, requests, timing):
        self.page, self.errors, self.requests, self.timing = page, errors, requests, timing

    def count(self, selector: str) -> int:
        return self.page.locator(selector).count()

    def tip(self) -> str:
        self.page.wait_for_selector("#tip:not([hidden])", timeout=2000)
        return self.page.inner_text("#tip")

    def point_at(self, selector: str, nth: int = 0) -> None:
        """Move the mouse onto an element's centre (charts listen on an overlay above their points)."""
        target = self.page.locator(selector).nth(nth)
        target.scroll_into_view_if_needed()
        box = target.bounding_box()
        self.page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)

    def shot(self, path: Path) -> Path:
        self.page.screenshot(path=str(path), full_page=True)
        keep = os.environ.get("HYBRIDLM_SCREENSHOTS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(keep) / path.name)
        return path


def open_report(context, path: Path) -> Opened:
    """Open a report; every request is recorded and any but the file itself is refused."""
    page = context.new_page()
    errors, requests = [], []
    page.on("console", lambda m: errors.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    url = path.resolve().as_uri()

    def route(r):
        requests.append(r.request.url)
        r.continue_() if r.request.url == url else r.abort()

    page.route("**/*", route)
    page.goto(url)
    page.wait_for_selector("body[data-rendered]", timeout=10_000)
    timing = page.evaluate("""() => {
        const n = performance.getEntriesByType('navigation')[0];
        const p = performance.getEntriesByName('first-contentful-paint')[0];
        return {load_ms: n.loadEventEnd - n.startTime, paint_ms: p ? p.startTime : null};
    }""")
    return Opened(page, errors, requests, timing)


def assert_clean(opened: Opened, path: Path) -> None:
    assert opened.errors == []
    assert opened.requests == [path.resolve().as_uri()]


def near(text: str, value: float, rel: float = 1e-3) -> bool:
    """Whether a number close to `value` is written in `text` (the page rounds to 4 digits)."""
    import re

    found = [float(m) for m in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]
    return any(math.isclose(x, value, rel_tol=rel, abs_tol=1e-12) for x in found)


def kinds(events, kind):
    return [e for e in events if e["event"] == kind]


# ---------------------------------------------------------------------- the arc in the browser
def test_arc_report_in_chromium(real_arc, browser, tmp_path):
    trace, events, states = real_arc
    out = tmp_path / "arc.html"
    assert write_report(trace, out)[0] == "arc"  # finds the states beside the trace
    opened = open_report(browser, out)
    assert_clean(opened, out)
    tokens, jumps = kinds(events, "token"), kinds(events, "jump")
    assert opened.count("#domain .token-mark") == len(tokens)
    assert opened.count("#domain .jump-mark") == len(jumps)
    assert opened.count("#token-text .tok") == len(tokens)
    assert opened.count("#token-text .jump-chip") == len(jumps)
    assert opened.count("#jumps tbody tr") == len(jumps)
    assert opened.count("#state-norm .pt") == states.shape[0] == len(tokens)
    assert opened.count("#state-pca .pt") == len(tokens)
    for i in (0, len(tokens) // 2, len(tokens) - 1):
        opened.page.hover(f"#token-text .tok[data-i='{i}']")
        tip = opened.tip()
        assert json.dumps(tokens[i]["text"], ensure_ascii=False) in tip
        assert f"({tokens[i]['t']}, {tokens[i]['k']})" in tip
    opened.page.hover(f"#domain .token-mark[data-i='{len(tokens) - 1}']")
    assert json.dumps(tokens[-1]["text"], ensure_ascii=False) in opened.tip()
    opened.page.hover("#domain .jump-mark")
    tip = opened.tip()
    assert jumps[0]["tool"] in tip and jumps[0]["observation"][:20] in tip
    # the rates in the header: the arc's own counts, L = 30 layers for SmolLM2-135M
    header = opened.page.inner_text("dl.facts")
    assert kinds(events, "start")[0]["layers"] == 30
    assert f"{len(tokens)} token steps in" in header and f"{len(jumps)} jumps: " in header and "(L = 30)" in header
    # each token's probability: the model's at τ = 1 (greedy decoding: not the kernel's 1) beside the kernel's
    assert opened.count("#token-logprob .pt") == 2 * len(tokens)
    opened.page.hover("#token-text .tok[data-i='1']")
    tip = opened.tip()
    model_line = next(line for line in tip.splitlines() if line.startswith("p_θ(token), τ = 1 "))
    assert near(model_line, math.exp(tokens[1]["logprob"])) and "kernel p(token) 1" in tip
    assert any(e["logprob"] < -0.01 for e in tokens) and all(e["kernel_logprob"] == 0 for e in tokens)
    low = min(range(len(tokens)), key=lambda i: tokens[i]["logprob"])  # a point away from the kernel's log 1 = 0
    opened.point_at("#token-logprob .pt", low)  # (the model's series is drawn first)
    tip = opened.tip()
    assert "log p_θ(token) at τ = 1" in tip and near(tip, tokens[low]["logprob"])
    # the norm shown for a token step is the norm of its state row
    opened.point_at("#state-norm .pt", 3)
    assert near(opened.tip(), float(np.linalg.norm(states[3].astype(np.float64))))
    png = opened.shot(tmp_path / "arc.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    opened.page.close()


def test_long_arc_size_and_load_time(long_arc, browser, tmp_path, capsys):
    """The measured case: 160 token steps, 3 jumps; the file size is asserted, the time only printed."""
    trace, events, states = long_arc
    assert (len(kinds(events, "token")), len(kinds(events, "jump"))) == (160, 3)
    out = tmp_path / "arc160.html"
    write_report(trace, out)
    size = out.stat().st_size
    assert size < 1_000_000
    loads = []
    for _ in range(3):
        opened = open_report(browser, out)
        assert_clean(opened, out)
        loads.append(opened.timing)
        if len(loads) < 3:
            opened.page.close()
    assert opened.count("#domain .token-mark") == 160
    assert opened.count("#domain .jump-mark") == 3
    assert opened.count("#wall-plot .phase-bar") == len(kinds(events, "phase"))
    png = opened.shot(tmp_path / "arc160.png")
    opened.page.close()
    with capsys.disabled():
        print(f"\n[report] 160 token steps, 3 jumps: {size} bytes ({size / 1024:.1f} KiB); trace "
              f"{trace.stat().st_size} bytes, states {trace.with_suffix('.safetensors').stat().st_size} bytes; "
              "navigation start → load event " + ", ".join(f"{t['load_ms']:.0f} ms" for t in loads)
              + "; first contentful paint " + ", ".join(f"{t['paint_ms'] or float('nan'):.0f} ms" for t in loads)
              + f"; screenshot {png}")


# ---------------------------------------------------------------------- arcs the agent does not write (yet)
def plant_trace() -> list[dict]:
    """A bouncing ball as a plant in the external mode: state (height, velocity) on its own clock,
    a jump (a kick) at two token steps, written as the plant events of a trace."""
    events = [{"event": "start", "t": 0, "k": 0, "wall_s": 0.0, "task": "keep the ball bouncing", "model": "test"},
              {"event": "phase", "t": 0, "k": 0, "wall_s": 0.0, "phase": "decode", "mode": "q_G"}]
    h, v, wall, t, k = 1.0, 0.0, 0.0, 0, 0
    for step in range(60):
        wall = round(wall + 0.05, 6)
        v -= 9.81 * 0.05
        h += v * 0.05
        if h < 0:
            h, v = -h, -0.8 * v
        events.append({"event": "plant", "t": t, "k": k, "wall_s": wall, "plant": "ball", "plant_t": round(step * 0.05, 6),
                       "state": {"height": h, "velocity": v}, "u": 0.0})
        if step % 5 == 4:
            t += 1
            events.append({"event": "token", "t": t, "k": k, "wall_s": wall, "token": 1, "text": "x", "phase": "decode"})
        if step in (20, 40):
            k += 1
            events.append({"event": "jump", "t": t, "k": k, "wall_s": wall, "tool": "kick", "arguments": {"dv": 2},
                           "observation": "kicked", "error": None, "duration_s": 0.01})
            v += 2.0
    events.append({"event": "end", "t": t, "k": k, "wall_s": wall, "answer": "", "stop_reason": "token_budget"})
    return events


def test_plant_trajectory_with_jump_times(browser, tmp_path):
    events = plant_trace()
    out = tmp_path / "plant.html"
    out.write_text(render_arc_report(events), encoding="utf-8")
    opened = open_report(browser, out)
    assert_clean(opened, out)
    plant = kinds(events, "plant")
    assert opened.count("#plant-0 .pt") == 2 * len(plant)  # height and velocity at every plant event
    assert opened.count("#plant-0 .vline") == len(kinds(events, "jump"))
    assert opened.count("#plant-u-0 .pt") == len(plant)
    view = arc_view(events)
    # a jump's plant time is its wall time mapped through the plant events' clocks
    assert [j["time"] for j in view["plant"]["plants"][0]["jumps"]] == pytest.approx([1.0, 2.0])
    opened.point_at("#plant-0 .pt", 10)
    assert near(opened.tip(), plant[10]["state"]["height"])
    opened.shot(tmp_path / "plant.png")
    opened.page.close()


def supervised_tank(tok, trace, *, cbf: bool):
    """A supervised tank run on a plant clock set by hand, the model's decisions scripted and each of its token
    steps taking 0.1 s of plant time (its latency): from 50 cm the valve is opened fully four times, then
    closed, then set to 0.4; 60 s horizon. Without the filter the level leaves the band through 60 cm and comes
    back; with it the fourth command is corrected."""
    from hybridlm.agent.supervisor import Supervisor
    from hybridlm.plant import ManualClock, tank
    from tests.agent_fakes import ScriptedModel

    class Slow(ScriptedModel):
        def G(self, x):
            clock.advance(0.1)
            return super().G(x)

    end = tok.token_str(tok.end_of_turn_id)
    call = '<tool_call>{{"name": "set_valve", "arguments": {{"value": {}}}}}</tool_call>'.format
    script = [piece for v in (1, 1, 1, 1, 0, 0.4, 0.4, 0.4, 0.4) for piece in (call(v), "Done." + end)]
    clock = ManualClock()
    plant = tank(level=50.0, clock=clock, cbf=cbf)
    arc = Supervisor(Slow(tok, script), plant, horizon_s=60.0, period_s=10.0, tool_choice="auto").run(
        "Keep the level between 40 and 60 cm", trace=trace)
    return arc, plant


@pytest.mark.parametrize("cbf", [False, True])
def test_a_plant_run_draws_held_commands_the_band_and_time_in_band(smollm2, browser, tmp_path, cbf):
    """Every command of a supervised run is a step of the held input (zero-order hold from its plant time to the
    next, the last to the horizon); the state is drawn over its safe band with its unit; the header's time in
    band and violations are the supervisor's own (the plant's safe time and crossings)."""
    trace = tmp_path / "tank.jsonl"
    arc, plant = supervised_tank(smollm2.tokenizer, trace, cbf=cbf)
    events = read_trace(trace)
    commands = [e for e in events if e["event"] == "plant" and e.get("kind") == "command"]
    assert len(commands) == len(arc.decisions) >= 4
    view = arc_view(events)
    p = view["plant"]["plants"][0]
    held = p["held"]
    assert held["time"] == pytest.approx([0.0] + [c["plant_time"] for c in commands])
    assert held["u"]["valve"] == pytest.approx([0.0] + [c["commanded"][0] for c in commands])
    assert held["until"] == 60.0
    assert p["bands"] == {"level_cm": [40.0, 60.0]} and p["units"] == {"level_cm": "cm"}
    safe = p["safe"]
    assert safe["in_band_s"] == pytest.approx(arc.safe_time_s, abs=1e-6)
    assert safe["left"] == arc.violations
    assert (arc.violations > 0) != cbf
    leave = [c.tau for c in plant.crossings if c.direction == "leave"]
    enter = [c.tau for c in plant.crossings if c.direction == "enter"]
    assert [x for v in safe["violations"] for x in (v["start"], v["end"])] == pytest.approx(
        [x for pair in zip(leave, enter) for x in pair])

    out = tmp_path / "tank.html"
    write_report(trace, out)
    opened = open_report(browser, out)
    assert_clean(opened, out)
    assert opened.count("#plant-u-0 path.step") == 1
    assert opened.count("#plant-u-0 .pt") == len(held["time"]) + len(p["applied"]["time"])
    # the step path: a vertical segment at each command's time (in the plot's coordinates)
    d = opened.page.get_attribute("#plant-u-0 path.step", "d")
    import re
    verticals = re.findall(r"H([-\d.]+)V", d)
    assert len(verticals) == len(commands)
    for i, c in enumerate(commands):
        opened.point_at("#plant-u-0 .pt", i + 1)
        tip = opened.tip()
        assert near(tip, c["plant_time"], 1e-3) and near(tip, c["commanded"][0])
    assert opened.count("#plant-0 rect.safe-band") == 1
    assert opened.count("#plant-0 rect.span") == len(safe["violations"])
    assert "safe band of level_cm: 40 … 60 cm" in opened.page.inner_text("#plant-0")
    assert "level_cm (cm)" in opened.page.inner_text("#plant-0")
    header = opened.page.inner_text("dl.facts")
    assert f"{100 * arc.safe_fraction:.1f} % of 60 s of plant time" in header
    assert f"violations\n{arc.violations}" in header
    corrected = [c for c in commands if c["corrected"]]
    assert p["applied"]["time"] == pytest.approx([c["plant_time"] for c in corrected])
    assert p["applied"]["u"].get("valve", []) == pytest.approx([c["applied"][0] for c in corrected])
    assert bool(corrected) == cbf
    opened.shot(tmp_path / f"tank-{'cbf' if cbf else 'plain'}.png")
    opened.page.close()


def test_unknown_events_and_fields_are_listed(real_arc, browser, tmp_path):
    _, events, _ = real_arc
    tokens = kinds(events, "token")
    odd = []
    for e in events:
        e = dict(e)
        if e["event"] == "token" and e["t"] == 3:
            e["logprob"], e["entropy"], e["novel_field"] = -0.5, 1.25, "seen"
        odd.append(e)
        if e["event"] == "token" and e["t"] == 5:
            odd.append({"event": "batch", "t": 5, "k": 0, "wall_s": e["wall_s"], "row": 2, "action": "leave"})
            odd.append({"event": "context", "t": 5, "k": 0, "wall_s": e["wall_s"], "dropped": 16})
            odd.append({"event": "mystery", "t": 5, "wall_s": e["wall_s"], "payload": {"x": [1, 2]}})
            odd.append({"event": "mystery"})  # no clocks at all
    out = tmp_path / "odd.html"
    out.write_text(render_arc_report(odd), encoding="utf-8")
    opened = open_report(browser, out)
    assert_clean(opened, out)
    assert opened.count("#domain .token-mark") == len(tokens)
    batch, context = len(kinds(odd, "batch")), len(kinds(odd, "context"))
    assert batch >= 1 and context >= 1  # (the engine writes batch events of its own; the test adds one of each)
    assert opened.count("#domain .batch-mark") == batch and opened.count("#domain .context-mark") == context
    assert opened.count("#engine tbody tr") == batch + context
    unknown = opened.page.inner_text("#unknown")
    assert "mystery" in unknown and "novel_field" in unknown
    opened.page.hover("#token-text .tok[data-i='2']")  # t = 3
    tip = opened.tip()
    assert f"p_θ(token), τ = 1 {math.exp(-0.5):.4g}" in tip and "kernel p(token) 1" in tip
    assert "entropy 1.25 nats" in tip and "novel_field seen" in tip
    assert opened.count("#colour-by option") == 4  # phase, probability, kernel probability, entropy
    opened.page.close()


def test_fields_of_the_wrong_type_draw_without_errors(browser, tmp_path):
    events = [
        {"event": "start", "task": 5, "kernel": None, "limits": "none", "tools": 3, "control": {"x": 1}},
        {"event": "phase", "t": "zero", "k": None, "wall_s": -1, "phase": None, "tokens": "many"},
        {"event": "token", "t": 1, "k": 0, "wall_s": float("inf"), "token": "?", "text": None, "phase": 7},
        {"event": "token", "t": 2, "k": 0, "wall_s": 0.5, "token": 3, "text": ["a"], "p": "high", "entropy": True},
        {"event": "control", "t": None, "controller": None, "removed_mass": "lots"},
        {"event": "jump", "t": None, "k": "one", "wall_s": None, "tool": None, "arguments": None, "observation": None,
         "duration_s": "long", "error": {"code": 1}},
        {"event": "plant", "plant_t": "later", "state": "bad", "u": [None, 2]},
        {"event": "batch"}, {"event": "context", "t": [1]},
        {"event": "end", "answer": {"text": "x"}, "stop_reason": 3},
    ]
    out = tmp_path / "wrong.html"
    out.write_text(render_arc_report(events), encoding="utf-8")
    opened = open_report(browser, out)
    assert_clean(opened, out)
    assert opened.count("#domain .token-mark") == 2 and opened.count("#domain .jump-mark") == 1
    opened.page.close()


event_kinds = st.sampled_from(["start", "phase", "token", "jump", "control", "end", "batch", "context", "plant", "zzz"])
values = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5),
                   st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
fields = st.dictionaries(st.sampled_from(["t", "k", "wall_s", "phase", "text", "token", "tool", "state", "plant_t",
                                          "tokens", "removed_mass", "arguments", "other"]), values, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(event_kinds, fields), max_size=25))
def test_any_events_give_a_page(stream):
    """Whatever the events and fields, the view builds, its JSON is strict, and the page embeds it."""
    events = [{"event": kind, **f} for kind, f in stream]
    view = arc_view(events)
    json.dumps(view, allow_nan=False)
    assert len(view["tokens"]["t"]) == sum(kind == "token" for kind, _ in stream)
    assert len(view["jumps"]) == sum(kind == "jump" for kind, _ in stream)
    html = render_arc_report(events)
    assert html.count("</script>") == 2  # no event text can close the data's script


# ---------------------------------------------------------------------- states
def test_pca_against_covariance_eigenvectors(real_arc):
    _, _, states = real_arc
    X = states.astype(np.float64)
    coords, share = pca_2d(X)
    C = np.cov(X, rowvar=False, bias=True)
    w, V = np.linalg.eigh(C)  # ascending
    ref = (X - X.mean(0)) @ V[:, ::-1][:, :2]
    for i in range(2):
        sign = np.sign(ref[:, i] @ coords[:, i])
        np.testing.assert_allclose(coords[:, i], sign * ref[:, i], rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(share, w[::-1][:2] / w.sum(), rtol=1e-8)


@settings(max_examples=30, deadline=None)
@given(st.integers(3, 12), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_pca_is_blind_to_a_translation(n, d, seed):
    X = np.random.default_rng(seed).normal(size=(n, d))
    a, sa = pca_2d(X)
    b, sb = pca_2d(X + 7.5)
    np.testing.assert_allclose(a, b, atol=1e-8)
    np.testing.assert_allclose(sa, sb, atol=1e-10)


# ---------------------------------------------------------------------- analysis runs in the browser
def test_consensus_report_in_chromium(consensus_runs, browser, tmp_path):
    out = tmp_path / "consensus.html"
    assert write_report(consensus_runs, out)[0] == "consensus"
    opened = open_report(browser, out)
    assert_clean(opened, out)
    cases = sorted(d for d in consensus_runs.iterdir() if d.is_dir())
    rows = {d.name: list(csv.DictReader(open(d / "consensus.csv"))) for d in cases}
    assert opened.count("#consensus-chart .pt") == sum(len(r) for r in rows.values())
    assert opened.count("#consensus-chart .band") == len(cases)
    passes = max(int(r["pass"]) for r in rows["full"])
    assert opened.count("#consensus-chart .vline") == passes - 1  # the end of every pass but the last
    assert opened.count("#consensus tbody tr") == len(cases)
    # a hover names a case and a layer-step; E, pass and layer are that row of the case's CSV
    for nth in (5, len(rows[cases[0].name]) + 7):
        opened.point_at("#consensus-chart .pt", nth)
        tip = opened.tip().splitlines()
        case, k = tip[0].strip(), int(float(tip[1].split()[-1]))
        row = rows[case][k]
        assert near(tip[2], float(row["E_mean"])) and f"pass {row['pass']}, layer {row['layer']}" in tip[-1]
    opened.page.check("#consensus-chart input[type=checkbox]")  # log axis: drawn again, no error
    assert opened.count("#consensus-chart .pt") == sum(1 for r in rows.values() for x in r if float(x["E_mean"]) > 0)
    opened.shot(tmp_path / "consensus.png")
    assert opened.errors == []
    opened.page.close()


def test_survey_report_in_chromium(survey_runs, browser, tmp_path):
    out = tmp_path / "survey.html"
    assert write_report(survey_runs, out)[0] == "survey"
    opened = open_report(browser, out)
    assert_clean(opened, out)
    adjoint = json.loads((survey_runs / "adjoint" / "adjoint.json").read_text())
    euler = json.loads((survey_runs / "euler" / "euler.json").read_text())
    n_grad = sum(len(v) for v in adjoint["gradient_error_per_layer"].values())
    n_costate = sum(len(v) - 1 for v in adjoint["costate_error_per_layer"].values())
    positive = lambda vs: sum(1 for v in vs if v > 0)  # noqa: E731  (a log axis has no place for 0)
    assert opened.count("#adjoint-adjoint-0 .pt") == positive(x for v in adjoint["gradient_error_per_layer"].values() for x in v)
    assert n_grad >= opened.count("#adjoint-adjoint-0 .pt") > 0
    assert opened.count("#adjoint-adjoint-1 .pt") == positive(
        x for v in adjoint["costate_error_per_layer"].values() for x in v[:-1]) <= n_costate
    assert opened.count("#euler-euler-0 .pt") == sum(len(v) for v in euler["errors"].values())
    opened.point_at("#euler-euler-0 .pt", 4)
    tip = opened.tip().splitlines()
    name = next(n for n in euler["errors"] if tip[0].strip().startswith(n))
    depth = int(float(tip[1].split()[-1]))
    assert near(tip[2], euler["errors"][name][euler["depths"].index(depth)])
    opened.shot(tmp_path / "survey.png")
    opened.page.close()


# ---------------------------------------------------------------------- OpenTelemetry
def spans_of(request: dict) -> list[dict]:
    return [s for rs in request["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


def attrs(span: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


def check_spans(spans: list[dict], events: list[dict], epoch_s: float) -> None:
    phases, jumps = kinds(events, "phase"), kinds(events, "jump")
    assert len(spans) == 1 + len(phases) + len(jumps)
    (arc,) = [s for s in spans if s["name"] == "invoke_agent hybridlm"]
    assert not arc.get("parentSpanId")
    a = attrs(arc)
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert int(a["gen_ai.usage.output_tokens"]) == len(kinds(events, "token"))
    assert int(a["gen_ai.usage.input_tokens"]) == sum(p.get("tokens", 0) for p in phases)
    phase_spans = [s for s in spans if s.get("parentSpanId") == arc["spanId"]]
    assert sorted(s["name"] for s in phase_spans) == sorted(p["phase"] for p in phases)
    tools = [s for s in spans if s["name"].startswith("execute_tool ")]
    assert len(tools) == len(jumps)
    external = {s["spanId"] for s in phase_spans if s["name"] == "external"}
    for span, jump in zip(sorted(tools, key=lambda s: int(s["startTimeUnixNano"])), jumps):
        a = attrs(span)
        assert span["name"] == f"execute_tool {jump['tool']}" and span["parentSpanId"] in external
        assert (a["gen_ai.operation.name"], a["gen_ai.tool.name"]) == ("execute_tool", jump["tool"])
        assert json.loads(a["gen_ai.tool.call.arguments"]) == jump["arguments"]
        assert a["gen_ai.tool.call.result"] == jump["observation"]
        end_ns = int(span["endTimeUnixNano"])
        assert abs(end_ns - (epoch_s + jump["wall_s"]) * 1e9) < 2e3
        assert abs(end_ns - int(span["startTimeUnixNano"]) - jump["duration_s"] * 1e9) < 2e3
    for s in spans:
        assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16 and s["traceId"] == arc["traceId"]
        assert int(arc["startTimeUnixNano"]) <= int(s["startTimeUnixNano"]) <= int(s["endTimeUnixNano"]) \
            <= int(arc["endTimeUnixNano"])


def test_otel_file_is_otlp_json_lines(real_arc, tmp_path):
    from hybridlm.report.otel import export_arc

    _, events, _ = real_arc
    target = tmp_path / "spans.jsonl"
    n = export_arc(events, target, epoch_s=1_700_000_000.0)
    lines = target.read_text().splitlines()
    spans = [s for line in lines for s in spans_of(json.loads(line))]
    assert len(spans) == n
    check_spans(spans, events, 1_700_000_000.0)
    # a failed tool: its span carries error.type and an error status (OTLP STATUS_CODE_ERROR = 2)
    failed = [dict(e, error="timeout", observation="error: timed out") if e["event"] == "jump" else e for e in events]
    export_arc(failed, target, epoch_s=1_700_000_000.0)
    spans = spans_of(json.loads(target.read_text().splitlines()[-1]))
    check_spans(spans, failed, 1_700_000_000.0)
    for span in (s for s in spans if s["name"].startswith("execute_tool ")):
        assert attrs(span)["error.type"] == "timeout"
        assert span["status"]["code"] == 2 and span["status"]["message"] == "timeout"


def test_otel_posts_otlp_http_to_a_collector(real_arc):
    """A small collector on loopback decodes the POST with the OTLP protobuf definitions."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    )

    from hybridlm.report.otel import export_arc

    received = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers.get("Content-Type"), body))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _, events, _ = real_arc
        n = export_arc(events, f"http://127.0.0.1:{server.server_port}", epoch_s=1_700_000_000.0, timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
    ((path, content_type, body),) = received
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                d = MessageToDict(s)
                for key in ("traceId", "spanId", "parentSpanId"):  # bytes fields: protobuf's JSON gives base64
                    if key in d:
                        d[key] = getattr(s, {"traceId": "trace_id", "spanId": "span_id",
                                             "parentSpanId": "parent_span_id"}[key]).hex()
                spans.append(d)
    assert len(spans) == n
    check_spans(spans, events, 1_700_000_000.0)


def test_otel_to_a_closed_port_is_one_error(real_arc):
    from hybridlm.errors import InputError
    from hybridlm.report.otel import export_arc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, events, _ = real_arc
    with pytest.raises(InputError, match="could not be exported"):
        export_arc(events, f"http://127.0.0.1:{port}/v1/traces", timeout_s=1)


# ---------------------------------------------------------------------- the command
def test_cli_report(real_arc, consensus_runs, tmp_path):
    trace, events, _ = real_arc
    runner = CliRunner()
    out = tmp_path / "r.html"
    spans = tmp_path / "spans.jsonl"
    result = runner.invoke(cli, ["report", str(trace), "-o", str(out), "--otel", str(spans)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("<!DOCTYPE html>") and "arc report" in result.output
    assert len(spans_of(json.loads(spans.read_text().splitlines()[0]))) == 1 + len(kinds(events, "phase")) + len(
        kinds(events, "jump"))
    result = runner.invoke(cli, ["report", str(consensus_runs)])
    assert result.exit_code == 0 and (consensus_runs / "report.html").is_file()
    for args, message in (
        (["report", str(tmp_path / "nothing")], "no such file or folder"),
        (["report", str(tmp_path)], "expected an agent trace"),
        (["report", str(consensus_runs), "--otel", str(spans)], "--otel exports an agent arc"),
        (["report", str(trace), "--states", str(tmp_path / "none.safetensors")], "no such file"),
    ):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "start", "t": 0, "k": 0, "wall_s": 0.0, "task": "x"}\nnot json\n')
    result = runner.invoke(cli, ["report", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:2" in result.output


def test_reading_an_arc_imports_no_pytorch(real_arc, consensus_runs, tmp_path):
    """The report, `trace show` and --help load no model, so they do not pay PyTorch's import (~220 MB
    resident): each runs in a fresh interpreter that then lists what it imported."""
    trace, _, _ = real_arc
    for args in (["report", str(trace), "-o", str(tmp_path / "r.html")], ["report", str(consensus_runs)],
                 ["trace", "show", str(trace)], ["--help"]):
        code = ("import sys\nfrom hybridlm.cli import main\nsys.argv = ['hybridlm', *%r]\ntry:\n    main()\n"
                "except SystemExit as e:\n"
                "    assert not e.code, e.code\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
                % (args,))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        assert done.stdout.strip().splitlines()[-1] == "[]", (args, done.stdout[-500:])
