"""Learning as optimal control, ResNets as ODEs, memorisation (docs/theory.md §5.1–§5.2, the survey's (0.18)–(0.38)).

* :mod:`~hybridlm.optimal.adjoint` — forward (0.24)/(0.18), adjoint (0.26)–(0.27)/(0.33) and
  weight-gradient (0.31)/(0.34) recursions written out, and gradient descent (0.32);
* :mod:`~hybridlm.optimal.costate` — Pontryagin's costate (0.37), semi-implicit vs explicit Euler;
* :mod:`~hybridlm.optimal.resnet_ode` — ResNets as Euler discretisations (0.19)–(0.21);
* :mod:`~hybridlm.optimal.neural_ode` — a Neural ODE trained with torchdiffeq's adjoint;
* :mod:`~hybridlm.optimal.memorise` — memorisation as simultaneous control;
* :mod:`~hybridlm.optimal.plots`, :mod:`~hybridlm.optimal.runs` — figures and CLI runs.

Submodule names are not shadowed: the functions ``adjoint.adjoint``, ``costate.costate`` and
``memorise.memorise`` are reached through their modules.
"""

from hybridlm.optimal.adjoint import (
    ACTIVATIONS, Activation, Gradients, Network, Trajectory, activation, backprop, forward, gradients,
    loss, random_network, terminal_costate, train,
)
from hybridlm.optimal.costate import RULES, costate_errors
from hybridlm.optimal.memorise import embed, error_vs_depth, memorisation_width, readout
from hybridlm.optimal.resnet_ode import (
    Affine, ContinuousModel, Sinusoid, euler_study, grid, loglog_slope, random_model, reference, resnet_error,
    second_order_resnet,
)

__all__ = [
    "ACTIVATIONS", "Activation", "Affine", "ContinuousModel", "Gradients", "Network", "RULES", "Sinusoid",
    "Trajectory", "activation", "backprop", "costate_errors", "embed", "error_vs_depth", "euler_study",
    "forward", "gradients", "grid", "loglog_slope", "loss", "memorisation_width", "random_model",
    "random_network", "readout", "reference", "resnet_error", "second_order_resnet", "terminal_costate", "train",
]
