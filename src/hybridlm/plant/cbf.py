"""A control-barrier-function safety filter on actuator commands (survey, "Safety and Alignment").

A barrier h(x) defines the safe set 𝒮 = {x : h(x) ≥ 0}. For an input-affine plant
ẋ = f(t, x, u) = a(t, x) + B(t, x) u, 𝒮 is forward invariant under every input with

    ∂h/∂x · f(t, x, u) ≥ −α(h(x)),        α(h) = γ h  (a class-K function),

since then h(x(t)) ≥ h(x(0)) e^{−γt} ≥ 0. The filter replaces the commanded input u_cmd by
the closest input that satisfies this for every barrier and the actuator bounds:

    u = argmin ‖u − u_cmd‖²   s.t.   (∂h_i/∂x B) u ≥ −γ h_i − ∂h_i/∂x a   (each i),   low ≤ u ≤ high.

For one input each constraint is a half-line, so the feasible set is an interval and the
projection is a clip (closed form); for several inputs it is a small QP solved with scipy's
SLSQP. The filter is a state feedback: the plant integrates ẋ = f(t, x, u(t, x)) with the
filter evaluated at every right-hand-side evaluation, not only when a command arrives,
because a command held constant over an interval would not keep the condition true along it.
The condition is imposed on h − ε (ε = 1e-6 in h's units by default): the filter then holds
h ≥ ε in exact arithmetic, a margin a thousand times the integrator's tolerance, so the
integrated and interpolated h never goes negative either. a and B are read from f itself
(a = f(t, x, 0), column j of B = f(t, x, e_j) − a), so f must be affine in u, which `CBF`
checks at construction on a sample state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridlm.errors import InputError


@dataclass
class Barrier:
    """h(x) ≥ 0 on the safe set; `grad` is ∂h/∂x (central differences when not given)."""

    name: str
    h: Callable[[np.ndarray], float]
    grad: Callable[[np.ndarray], np.ndarray] | None = None

    def gradient(self, x: np.ndarray) -> np.ndarray:
        if self.grad is not None:
            return np.asarray(self.grad(x), dtype=float)
        g = np.empty_like(x, dtype=float)
        for i in range(x.size):
            step = 1e-6 * max(1.0, abs(x[i]))
            e = np.zeros_like(x, dtype=float)
            e[i] = step
            g[i] = (self.h(x + e) - self.h(x - e)) / (2 * step)
        return g


@dataclass
class Filtered:
    """One application of the filter."""

    commanded: np.ndarray
    applied: np.ndarray
    h: dict[str, float]
    feasible: bool

    @property
    def corrected(self) -> bool:
        return not np.allclose(self.commanded, self.applied, rtol=0, atol=1e-9)

    def row(self) -> dict:
        return {"commanded": self.commanded.tolist(), "applied": self.applied.tolist(),
                "h": {k: round(v, 9) for k, v in self.h.items()}, "corrected": self.corrected,
                "feasible": self.feasible}


class CBF:
    """The safety filter of `barriers` for ẋ = f(t, x, u), inputs bounded by [low, high]; α(h) = γ (h − ε)."""

    def __init__(self, f: Callable, barriers: Sequence[Barrier], low: Sequence[float] | np.ndarray,
                 high: Sequence[float] | np.ndarray, *,
                 gamma: float = 0.5, margin: float = 1e-6, sample: tuple[float, np.ndarray] | None = None) -> None:
        if not barriers:
            raise InputError("a CBF filter needs at least one barrier h(x)")
        if not (np.isfinite(gamma) and gamma > 0):
            raise InputError(f"CBF decay rate γ = {gamma!r}: expected a finite number > 0")
        self.f, self.barriers, self.gamma, self.margin = f, list(barriers), float(gamma), float(margin)
        self.low, self.high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
        if sample is not None:
            self._check_affine(*sample)

    def _check_affine(self, t: float, x: np.ndarray) -> None:
        a, B = self.affine(t, x)
        u = (self.low + self.high) / 2 + 0.25 * (self.high - self.low)
        if not np.allclose(np.asarray(self.f(t, x, u), dtype=float), a + B @ u, rtol=1e-6, atol=1e-9):
            raise InputError("the CBF filter needs a plant that is affine in its input u: f(t, x, u) = a + B u")

    def affine(self, t: float, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m = self.low.size
        a = np.asarray(self.f(t, x, np.zeros(m)), dtype=float)
        B = np.stack([np.asarray(self.f(t, x, np.eye(m)[j]), dtype=float) - a for j in range(m)], axis=1)
        return a, B

    def constraints(self, t: float, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """(G, c, h): the CBF conditions as G u ≥ c, one row per barrier, and each h_i(x)."""
        a, B = self.affine(t, x)
        G, c, h = [], [], {}
        for barrier in self.barriers:
            value = float(barrier.h(x))
            grad = barrier.gradient(x)
            G.append(grad @ B)
            c.append(-self.gamma * (value - self.margin) - grad @ a)
            h[barrier.name] = value
        return np.array(G), np.array(c), h

    def __call__(self, t: float, x: np.ndarray, commanded: np.ndarray, *, method: str = "auto") -> Filtered:
        commanded = np.clip(np.asarray(commanded, dtype=float), self.low, self.high)
        G, c, h = self.constraints(t, x)
        if method == "auto":
            method = "interval" if self.low.size == 1 else "qp"
        u, feasible = (self._interval if method == "interval" else self._qp)(G, c, commanded)
        return Filtered(commanded, u, h, feasible)

    def _interval(self, G: np.ndarray, c: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, bool]:
        """One input: each row g u ≥ c bounds u from one side; clip u to the interval."""
        lo, hi = float(self.low[0]), float(self.high[0])
        feasible = True
        for g, ci in zip(G[:, 0], c):
            if g > 1e-12:
                lo = max(lo, ci / g)
            elif g < -1e-12:
                hi = min(hi, ci / g)
            elif ci > 0:
                feasible = False  # the input cannot move h here
        if lo > hi:  # the barriers ask for more than the actuator has: the bound of the nearer need
            return np.array([min(max(lo, float(self.low[0])), float(self.high[0]))]), False
        return np.array([min(max(float(u[0]), lo), hi)]), feasible

    def _qp(self, G: np.ndarray, c: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, bool]:
        from scipy.optimize import minimize

        result = minimize(lambda v: float((v - u) @ (v - u)), u, jac=lambda v: 2 * (v - u), method="SLSQP",
                          bounds=list(zip(self.low, self.high)),
                          constraints=[{"type": "ineq", "fun": lambda v: G @ v - c, "jac": lambda v: G}],
                          options={"ftol": 1e-12, "maxiter": 200})
        v = np.clip(result.x, self.low, self.high)
        return v, bool(result.success and np.all(G @ v - c >= -1e-7))
