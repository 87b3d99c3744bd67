"""Plants and the CBF safety filter: integration against closed forms, forward invariance, the supervisor.

References: the tank's closed form (Lambert W), the room's closed form (a linear ODE with an
integrating factor), the projection onto a half-space for the QP, and for the loop a
scripted policy on a clock set by hand (no wall time involved).
"""

import json
import math

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hybridlm.engine.trace import read_trace
from hybridlm.agent.supervisor import Supervisor
from hybridlm.errors import InputError
from hybridlm.plant import CBF, Actuator, Barrier, ManualClock, Plant, Sensor, room, tank, tank_level
from hybridlm.plant.builtins import ROOM, TANK, room_flow
from tests.agent_fakes import ScriptedModel


@pytest.mark.parametrize("level0, valve", [(50.0, 0.0), (50.0, 0.3), (45.0, 0.8), (59.0, 0.39), (10.0, 1.0),
                                           (80.0, 0.5)])
def test_tank_integration_matches_the_closed_form(level0, valve):
    clock = ManualClock()
    plant = tank(level=level0, valve=valve, clock=clock, low=0.5, high=500)
    worst = 0.0
    for t in np.linspace(0.5, 120, 40):
        worst = max(worst, abs(plant.advance(t)[0] - tank_level(t, level0, valve)))
    assert worst < 1e-6


def test_tank_closed_form_solves_torricelli():
    """The closed form itself: its derivative (central differences) is A⁻¹(q u − a√(2gL))."""
    for level0, valve in [(50.0, 0.3), (20.0, 0.9)]:
        for t in (3.0, 40.0):
            d = (tank_level(t + 1e-4, level0, valve) - tank_level(t - 1e-4, level0, valve)) / 2e-4
            L = tank_level(t, level0, valve)
            assert d == pytest.approx((TANK["q_max"] * valve - TANK["orifice"] * math.sqrt(2 * TANK["g"] * L))
                                      / TANK["area"], rel=1e-6)


def room_closed_form(t, T0, u, p=ROOM):
    """T(t) for dT/dt = (a + b sin ωs − d s − T)/τ + r u, with the integrating factor e^{s/τ}."""
    tau, r, a, b, d = p["tau"], p["rate"], p["outside"], p["swing"], p["drift"]
    w = 2 * math.pi / p["period"]
    e = math.exp(t / tau)
    const = (a + r * u * tau) * (e - 1)
    sine = (b / tau) * (e * (math.sin(w * t) / tau - w * math.cos(w * t)) + w) / (1 / tau**2 + w**2)
    ramp = -(d / tau) * (e * (tau * t - tau**2) + tau**2)
    return (T0 + const + sine + ramp) / e


def test_room_integration_matches_the_closed_form():
    clock = ManualClock()
    plant = room(temperature=21.0, heater=0.4, clock=clock, low=-50, high=50)
    worst = max(abs(plant.advance(t)[0] - room_closed_form(t, 21.0, 0.4)) for t in np.linspace(1, 600, 30))
    assert worst < 1e-6
    x = np.array([20.0])
    assert room_flow(0.0, x, np.array([0.0]))[0] == pytest.approx((5.0 - 20.0) / 300)


def test_a_crossing_is_located_and_counted():
    """Closed valve from 45 cm: √L falls linearly, so the level reaches 40 at t* in closed form."""
    clock = ManualClock()
    plant = tank(level=45.0, valve=0.0, clock=clock)
    k = TANK["orifice"] * math.sqrt(2 * TANK["g"])
    t_star = (math.sqrt(45.0) - math.sqrt(40.0)) * 2 * TANK["area"] / k
    assert plant.predict_crossing(100.0) == pytest.approx(t_star, abs=1e-6)
    plant.advance(100.0)
    (crossing,) = plant.crossings
    assert crossing.tau == pytest.approx(t_star, abs=1e-6) and crossing.direction == "leave"
    assert plant.violations(0, 100) == 1
    assert plant.safe_time(0, 100) == pytest.approx(t_star, abs=1e-6)


# ---------------------------------------------------------------------- the CBF filter
commands = st.lists(st.tuples(st.floats(-0.5, 1.5), st.floats(0.05, 15.0)), min_size=20, max_size=20)


@settings(max_examples=50, deadline=None)
@given(level0=st.floats(40.5, 59.5), gamma=st.sampled_from([0.1, 0.5, 2.0]), sequence=commands)
def test_cbf_filter_never_lets_the_barrier_go_negative(level0, gamma, sequence):
    """50 examples × 20 random commands (1,000), each held for a random interval, integrated."""
    clock = ManualClock()
    plant = tank(level=level0, valve=0.0, clock=clock, cbf=True, gamma=gamma)
    for value, hold in sequence:
        plant.command("valve", value)
        row = plant.corrections[-1]
        G, c, _ = plant.filter.constraints(clock.time(), plant.x)
        assert np.all(G @ np.array(row["applied"]) >= c - 1e-9)  # the CBF condition at the command
        clock.advance(hold)
        plant.advance()
    _, xs, _ = plant.trajectory(points_per_segment=60)
    h = np.array([[b.h(x) for b in plant.barriers] for x in xs])
    assert h.min() >= 0.0
    assert plant.crossings == []


def test_cbf_corrects_only_when_needed_and_records_it():
    clock = ManualClock()
    plant = tank(level=50.0, clock=clock, cbf=True)
    reply = plant.command("valve", 0.0)  # far from the edges: the command passes unchanged
    assert reply["applied"] == 0.0 and "safety_filter" not in reply
    clock.advance(200.0)
    plant.advance()
    reply = plant.command("valve", 0.0)  # at the lower edge: the filter opens the valve
    assert reply["safety_filter"] == "corrected" and reply["applied"] > 0
    row = plant.corrections[-1]
    assert row["commanded"] == [0.0] and row["corrected"] and row["h"]["level_cm ≥ 40"] >= 0


def test_qp_matches_the_closed_form_projections():
    """One input: the QP equals the interval clip. Two inputs, one constraint: the QP equals the
    projection onto the half-space g·u ≥ c, u + max(0, c − g·u) g / ‖g‖²."""
    clock = ManualClock()
    plant = tank(level=40.3, clock=clock, cbf=True)
    for u in (0.0, 0.2, 0.9):
        a = plant.filter(0.0, plant.x, np.array([u]), method="interval").applied
        b = plant.filter(0.0, plant.x, np.array([u]), method="qp").applied
        assert b == pytest.approx(a, abs=1e-6)

    def point(t, x, u):  # a point in the plane, driven by its velocity
        return np.array(u, dtype=float)

    disk = Barrier("inside the disk", lambda x: 1.0 - float(x @ x), lambda x: -2 * x)
    cbf = CBF(point, [disk], low=[-5, -5], high=[5, 5], gamma=1.0, sample=(0.0, np.array([0.5, 0.2])))
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.uniform(-0.6, 0.6, 2)
        u = rng.uniform(-3, 3, 2)
        g, c = -2 * x, -1.0 * (1.0 - x @ x - cbf.margin)
        expected = u + max(0.0, c - g @ u) * g / (g @ g)
        got = cbf(0.0, x, u)
        assert got.feasible and got.applied == pytest.approx(expected, abs=1e-5)


def test_cbf_refuses_a_plant_that_is_not_input_affine():
    with pytest.raises(InputError, match="affine"):
        Plant("bad", lambda t, x, u: np.array([u[0] ** 2 - x[0]]), [0.5], states=["x"],
              actuators=[Actuator("u", 0, 1)], sensors=[Sensor("x", lambda t, x: x[0])],
              barriers=[Barrier("x ≥ 0", lambda x: float(x[0]))], clock=ManualClock(), cbf=True)


def test_a_user_plant_and_its_tools():
    """A user's own plant: f(x, u), sensors, actuators and safe set; the tools' schemas validate."""
    clock = ManualClock()
    plant = Plant("cart", lambda t, x, u: np.array([x[1], u[0] - 0.1 * x[1]]), [0.0, 0.0],
                  states=["position_m", "speed_m_s"], actuators=[Actuator("force", -1.0, 1.0, "N")],
                  sensors=[Sensor("position_m", lambda t, x: x[0], "m")],
                  barriers=[Barrier("position ≤ 5", lambda x: 5.0 - float(x[0]))], clock=clock)
    tools = {t.name: t for t in plant.tools()}
    assert set(tools) == {"read_sensors", "set_force"}
    for t in tools.values():
        jsonschema.Draft202012Validator.check_schema(t.parameters)
    jsonschema.validate({"value": 0.5}, tools["set_force"].parameters)
    reply = tools["set_force"].fn(value=3.0)
    assert reply["applied"] == 1.0 and reply["saturated"]
    clock.advance(2.0)
    reading = tools["read_sensors"].fn()
    # ẍ = 1 − 0.1 ẋ from rest: x(t) = 10 t − 100 (1 − e^{−t/10})
    assert reading["position_m"] == pytest.approx(10 * 2 - 100 * (1 - math.exp(-0.2)), abs=1e-4)
    assert reading["time_s"] == 2.0 and reading["force"] == 1.0


# ---------------------------------------------------------------------- the supervisory loop
def call(value):
    return f'<tool_call>{{"name": "set_valve", "arguments": {{"value": {value}}}}}</tool_call>'


@pytest.mark.parametrize("cbf", [False, True])
def test_supervisor_decides_on_the_period_and_on_a_predicted_crossing(smollm2, tmp_path, cbf):
    """Closed valve from 50 cm: the level would reach 40 at t* ≈ 33.7 s. Without the filter the
    supervisor wakes the model at t* (a crossing) after the periodic decisions at 0, 10, 20, 30;
    with it the level never reaches 40, so only the periodic decisions happen."""
    tok = smollm2.tokenizer
    end = tok.token_str(tok.end_of_turn_id)  # each decision's answer ends its turn
    script = [piece for v in (0, 0, 0, 0, 1) for piece in (call(v), "Done." + end)]
    model = ScriptedModel(tok, script)
    clock = ManualClock()
    plant = tank(level=50.0, clock=clock, cbf=cbf)
    supervisor = Supervisor(model, plant, horizon_s=40.0, period_s=10.0, tool_choice="auto")
    trace = tmp_path / "arc.jsonl"
    arc = supervisor.run("Keep the level between 40 and 60 cm", trace=trace, figure=tmp_path / "arc.png")

    k = TANK["orifice"] * math.sqrt(2 * TANK["g"])
    t_star = (math.sqrt(50.0) - math.sqrt(40.0)) * 2 * TANK["area"] / k
    if cbf:
        assert [d.reason for d in arc.decisions] == ["start", "period", "period", "period"]
        assert arc.violations == 0 and arc.safe_time_s == pytest.approx(40.0)
    else:
        assert [d.reason for d in arc.decisions] == ["start", "period", "period", "period", "crossing"]
        assert arc.decisions[-1].tau0 == pytest.approx(t_star, abs=1e-6)
        assert "leaving its safe set" in arc.decisions[-1].task
    assert [d.tau0 for d in arc.decisions[:4]] == [0.0, 10.0, 20.0, 30.0]
    assert all(j["tool"] == "set_valve" and j["error"] is None for d in arc.decisions for j in d.jumps)

    events = read_trace(trace)
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    ts = [e["t"] for e in events]
    assert ts == sorted(ts) and events[-1]["t"] == sum(d.token_steps for d in arc.decisions)
    jumps = [e for e in events if e["event"] == "jump"]
    assert len(jumps) == len(arc.decisions) and {j["server"] for j in jumps} == {"plant:tank"}
    commands = [e for e in events if e["event"] == "plant" and e["kind"] == "command"]
    assert [c["plant_time"] for c in commands] == pytest.approx([d.tau0 for d in arc.decisions])
    assert all({"commanded", "applied", "h", "state", "wall_s", "k"} <= set(c) for c in commands)
    stages = [e["stage"] for e in events if e["event"] == "decision"]
    assert stages == ["start", "end"] * len(arc.decisions)
    assert (tmp_path / "arc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".arc.jsonl.decision-*"))  # merged and removed


@pytest.mark.parametrize("args, message", [
    (["--cbf"], "need a plant"),
    (["--plant", "pump"], "built-ins are tank, room"),
    (["--plant", "tank", "--band", "60,40"], "LOW < HIGH"),
    (["--plant", "tank", "--plant-speed", "0"], "--plant-speed 0.0"),
])
def test_cli_plant_options_are_checked_first(args, message):
    from click.testing import CliRunner

    from hybridlm.cli import cli

    result = CliRunner().invoke(cli, ["agent", *args, "Keep the level between 40 and 60 cm"])
    assert result.exit_code == 2 and message in result.output


def test_cli_agent_in_the_loop_of_the_tank(smollm2, tmp_path):
    """End to end on the default model: a decision's jump reaches the plant (through the filter),
    the arc holds the plant's events and the figure is written."""
    from click.testing import CliRunner

    from hybridlm.cli import cli

    trace, figure = tmp_path / "tank.jsonl", tmp_path / "tank.png"
    result = CliRunner().invoke(cli, ["agent", "--plant", "tank", "--cbf", "--plant-speed", "20", "--horizon", "20",
                                      "--trace", str(trace), "--figure", str(figure),
                                      "Keep the level between 40 and 60 cm for the next 20 s"])
    assert result.exit_code == 0, result.output
    events = read_trace(trace)
    assert events[0]["event"] == "start" and events[0]["plant"]["cbf"] == {"gamma": 0.5}
    jumps = [e for e in events if e["event"] == "jump"]
    assert jumps and {j["server"] for j in jumps} == {"plant:tank"}
    plant_events = [e for e in events if e["event"] == "plant"]
    assert {"start", "end"} <= {e["kind"] for e in plant_events}
    assert all("plant_time" in e and "state" in e for e in plant_events)
    for j in jumps:
        if j["tool"] == "set_valve" and j["error"] is None:
            reply = json.loads(j["observation"])
            assert 0.0 <= reply["applied"] <= 1.0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "in the safe set" in result.output
