"""Controllers: feedback laws that compute the inputs of each token step from the observed state.

At token step t a controller sees y_t = (z_t, x_t, text so far, optionally the final
hidden state h_t⁽ᴸ⁾) and returns a kernel input (v_t, M_t); it may also hold residual
inputs u(ℓ, t) (hooks, attached for the whole run) or a soft prefix P. This is the
survey's test-time alignment: "algorithms that act as external controllers to regulate
the behavior during inference without modifying the underlying weights" ("Safety and
Alignment").

Controllers compose in order of `order` (steering < objectives < safety), each seeing
the logits already shaped by the ones before, so a safety filter always acts last.
"""

from __future__ import annotations

from hybridlm.engine.inputs import (  # noqa: F401 - the protocol of a controller, defined with the engine
    ControlRecord, Controller, Observation, control_step, ordered, the_prefix,
)
from hybridlm.errors import InputError


# ---------------------------------------------------------------------- registry
REGISTRY: dict[str, type[Controller]] = {}


def register(name: str):
    """Class decorator: make a controller constructible by name with `make_controller`."""

    def put(cls: type[Controller]) -> type[Controller]:
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return put


def make_controller(name: str, *args, **kwargs) -> Controller:
    if name not in REGISTRY:
        raise InputError(f"controller {name!r}: expected one of {sorted(REGISTRY)}")
    return REGISTRY[name](*args, **kwargs)
