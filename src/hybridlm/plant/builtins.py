"""Two plants to put a language model in the loop of.

Tank (level L in cm, inflow valve u ∈ [0, 1], a leak through an orifice at the bottom):

    A dL/dt = q_max u − a √(2 g L)          (Torricelli's law)

A = 50 cm², q_max = 40 cm³/s, a = 0.05 cm², g = 981 cm/s²: from 50 cm the closed tank
drains at ≈ 0.31 cm/s, the open one fills at ≈ 0.49 cm/s, and the level that the valve
holds at 50 cm is u ≈ 0.39. The tank is taken tall enough never to overflow. With u held
constant the level has a closed form (`tank_level`), which the tests integrate against.

Room (temperature T in °C, heater u ∈ [0, 1], the outside drifting):

    dT/dt = (T_out(τ) − T) / τ_room + r u,     T_out(τ) = 5 + 3 sin(2π τ / 600) − 0.01 τ

τ_room = 300 s (the walls' time constant), r = 0.15 °C/s (the heater at full power).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import lambertw

from hybridlm.errors import InputError
from hybridlm.plant.cbf import Barrier
from hybridlm.plant.system import Actuator, Plant, Sensor

TANK = {"area": 50.0, "q_max": 40.0, "orifice": 0.05, "g": 981.0}
ROOM = {"tau": 300.0, "rate": 0.15, "outside": 5.0, "swing": 3.0, "period": 600.0, "drift": 0.01}


def band_barriers(state: str, index: int, low: float, high: float) -> list[Barrier]:
    """low ≤ x_i ≤ high as two barriers h = x_i − low and h = high − x_i (exact gradients)."""
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise InputError(f"band {low}..{high}: expected two finite numbers, low < high")

    def unit(sign):
        def grad(x):
            g = np.zeros_like(x, dtype=float)
            g[index] = sign
            return g

        return grad

    return [Barrier(f"{state} ≥ {low:g}", lambda x: float(x[index] - low), unit(1.0)),
            Barrier(f"{state} ≤ {high:g}", lambda x: float(high - x[index]), unit(-1.0))]


def tank_flow(t: float, x: np.ndarray, u: np.ndarray, p: dict = TANK) -> np.ndarray:
    leak = p["orifice"] * math.sqrt(2 * p["g"] * max(float(x[0]), 0.0))
    return np.array([(p["q_max"] * float(u[0]) - leak) / p["area"]])


def tank_level(t: float, level0: float, valve: float, p: dict = TANK) -> float:
    """L(t) for a constant valve, in closed form.

    With y = √L, q = q_max u and k = a √(2g): 2A y dy/dt = q − k y. Separating and
    integrating with s = q − k y gives s − q ln|s| = s₀ − q ln|s₀| + k² t / (2A), whose
    solution is s = −q W(−sgn(s₀) e^{−C/q} / q) on the principal branch of Lambert's W.
    """
    q, k, A = p["q_max"] * valve, p["orifice"] * math.sqrt(2 * p["g"]), p["area"]
    y0 = math.sqrt(level0)
    if q == 0:  # draining: y falls linearly until the tank is empty
        return max(y0 - k * t / (2 * A), 0.0) ** 2
    s0 = q - k * y0
    if s0 == 0:
        return level0
    C = s0 - q * math.log(abs(s0)) + k * k * t / (2 * A)
    s = -q * lambertw(-math.copysign(1.0, s0) * math.exp(-C / q) / q).real
    return ((q - s) / k) ** 2


def room_flow(t: float, x: np.ndarray, u: np.ndarray, p: dict = ROOM) -> np.ndarray:
    outside = p["outside"] + p["swing"] * math.sin(2 * math.pi * t / p["period"]) - p["drift"] * t
    return np.array([(outside - float(x[0])) / p["tau"] + p["rate"] * float(u[0])])


def tank(*, low: float = 40.0, high: float = 60.0, level: float = 50.0, valve: float = 0.0, **kw) -> Plant:
    return Plant(
        "tank", tank_flow, [level], states=["level_cm"],
        actuators=[Actuator("valve", 0.0, 1.0, description="inflow valve opening, 0 = closed, 1 = fully open")],
        sensors=[Sensor("level_cm", lambda t, x: x[0], "cm", "the water level")],
        barriers=band_barriers("level_cm", 0, low, high), u0=[valve],
        description=f"a water tank that leaks through its bottom; keep the level between {low:g} and {high:g} cm",
        **kw)


def room(*, low: float = 19.0, high: float = 23.0, temperature: float = 21.0, heater: float = 0.0,
         **kw) -> Plant:
    return Plant(
        "room", room_flow, [temperature], states=["temperature_c"],
        actuators=[Actuator("heater", 0.0, 1.0, description="heater power, 0 = off, 1 = full power")],
        sensors=[Sensor("temperature_c", lambda t, x: x[0], "°C", "the room temperature")],
        barriers=band_barriers("temperature_c", 0, low, high), u0=[heater],
        description=f"a room losing heat to a cooling outside; keep it between {low:g} and {high:g} °C",
        **kw)


PLANTS = {"tank": tank, "room": room}


def make_plant(name: str, **kw) -> Plant:
    if name not in PLANTS:
        raise InputError(f"plant {name!r}: built-ins are {', '.join(PLANTS)}")
    return PLANTS[name](**kw)
