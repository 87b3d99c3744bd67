"""Learning as optimal control (docs/theory.md §5.1–§5.2, the survey's (0.18)–(0.37)): every number is checked against an
independent reference (torch.autograd, scipy's DOP853, torchdiffeq's autograd path)."""

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.errors import InputError
from hybridlm.optimal import adjoint as adj
from hybridlm.optimal import memorise as mem
from hybridlm.optimal import neural_ode as node
from hybridlm.optimal.costate import costate, costate_errors
from hybridlm.optimal.resnet_ode import (
    grid, loglog_slope, random_model, reference, second_order_field, second_order_resnet,
)

F64 = torch.float64
# softplus as log(1 + e^v) (torch's own is linear beyond v = 20, where its slope is not sigmoid(v))
SIGMA = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "softplus": lambda v: torch.log1p(torch.exp(v))}


def autograd_reference(net, x, y):
    """The same network written with plain torch ops; gradients and ∂L/∂z(k) by autograd."""
    W = net.W.clone().requires_grad_()
    w = net.w.clone().requires_grad_() if net.w is not None else None
    b = net.b.clone().requires_grad_() if net.b is not None else None
    zs = [x.clone().requires_grad_()]
    for k in range(W.shape[0]):
        v = zs[-1] @ W[k].T + (b[k] if b is not None else 0)
        zs.append(zs[-1] + w[k] * SIGMA[net.act](v) if w is not None else SIGMA[net.act](v))
        zs[-1].retain_grad()
    out = zs[-1][:, : y.shape[1]]
    (0.5 * ((out - y) ** 2).sum() / y.shape[0]).backward()
    return W.grad, (w.grad if w is not None else None), (b.grad if b is not None else None), [z.grad for z in zs]


def rel(a, b):
    return float((a - b).norm() / b.norm())


@settings(max_examples=12, deadline=None)
@given(depth=st.integers(2, 9), width=st.integers(1, 6), samples=st.integers(1, 5), out=st.integers(1, 6),
       residual=st.booleans(), bias=st.booleans(), act=st.sampled_from(sorted(SIGMA)), seed=st.integers(0, 10**6))
def test_explicit_adjoint_equals_autograd(depth, width, samples, out, residual, bias, act, seed):
    net = adj.random_network(depth, width, residual=residual, seed=seed, scale=1.3, act=act, bias=bias)
    if residual:
        net.w = torch.linspace(0.3, 1.2, depth - 1, dtype=F64)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(samples, width, generator=g, dtype=F64)
    y = torch.randn(samples, min(out, width), generator=g, dtype=F64)
    L, grads, _, lam = adj.backprop(net, x, y)
    gW, gw, gb, dz = autograd_reference(net, x, y)
    assert rel(grads.W, gW) <= 1e-6
    for k in range(depth):  # λ(k) = −∂L/∂z(k) at every layer, (0.26)–(0.27), (0.33)
        assert torch.allclose(lam[k], -dz[k], rtol=1e-9, atol=1e-14)
    if residual:
        assert rel(grads.w, gw) <= 1e-6
    if bias and residual:
        assert rel(grads.b, gb) <= 1e-6


def test_costate_semi_implicit_is_the_adjoint_and_explicit_is_not():
    model = random_model(5, seed=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g, dtype=F64)
    y = torch.randn(6, 5, generator=g, dtype=F64)
    errs = {}
    for depth in (16, 64):
        net = model.resnet(depth)
        traj = adj.forward(net, x)
        lam_end = adj.terminal_costate(traj.Z[-1], y)
        lam = adj.adjoint(net, traj, lam_end)
        e = {rule: max(v) for rule, v in costate_errors(model, traj.Z, lam_end, lam).items()}
        assert e["semi-implicit"] <= 1e-10
        assert e["explicit"] > 1e-4 and e["explicit"] > 1e6 * max(e["semi-implicit"], 1e-16)
        assert e["forward"] > 1e-4
        errs[depth] = e
    # both other rules are consistent first-order discretisations: 4× the depth, ~4× smaller error
    for rule in ("explicit", "forward"):
        assert 2.5 < errs[16][rule] / errs[64][rule] < 6.5


def test_costate_converges_to_the_continuous_costate():
    """λ(0) of the semi-implicit rule at depth ℓ approaches DOP853's solution of (0.36)–(0.37) as O(1/ℓ)."""
    model = random_model(3, seed=1)
    x = torch.tensor([[0.5, -0.3, 0.8]], dtype=F64)
    lam1 = torch.tensor([[1.0, 0.5, -0.2]], dtype=F64)

    def backwards(s, y):  # state (z, λ) in reversed time τ = 1 − t
        z, lam = y[0], y[1]
        J = model.jacobian(1 - s, z)
        return torch.stack([-model.field(1 - s, z), torch.einsum("sij,si->sj", J, lam)])

    z1 = reference(model.field, x, [0.0, 1.0])[-1]
    lam0 = reference(backwards, torch.stack([z1, lam1]), [0.0, 1.0])[-1, 1]
    err = []
    for depth in (32, 128):
        Z = adj.forward(model.resnet(depth), x).Z
        err.append(float((costate(model, Z, lam1, "semi-implicit")[0] - lam0).norm()))
    assert err[1] < err[0] / 3


def test_resnet_weights_follow_the_surveys_indexing():
    model = random_model(3, seed=2, kind="sinusoid")
    net = model.resnet(5)
    for k in range(1, 5):  # W(k) = W_c((k − 1)/(ℓ − 1)), w(k) = 1/(ℓ − 1) (0.20)
        assert torch.equal(net.W[k - 1], model.W((k - 1) / 4))
    assert torch.allclose(net.w, torch.full((4,), 0.25, dtype=F64))
    assert torch.allclose(model.resnet(5, step="survey").w, torch.full((4,), 0.2, dtype=F64))
    assert list(grid(5)) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_euler_slopes():
    model = random_model(4, seed=0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    depths = [8, 16, 32, 64]
    ref = reference(model.field, x, [0.0, 1.0])[-1]
    euler = [float((adj.forward(model.resnet(d), x).Z[-1] - ref).norm(dim=-1).max()) for d in depths]
    assert -1.2 <= loglog_slope(depths, euler) <= -0.8
    p0 = torch.zeros_like(x)
    ref2 = reference(second_order_field(model), torch.stack([x, p0]), [0.0, 1.0])[-1, 0]
    slopes = {s: loglog_slope(depths, [float((second_order_resnet(model, x, p0, d, s)[-1] - ref2).norm(dim=-1).max())
                                       for d in depths]) for s in ("euler", "semi-implicit", "verlet")}
    assert -1.2 <= slopes["euler"] <= -0.8 and -1.2 <= slopes["semi-implicit"] <= -0.8
    assert slopes["verlet"] < -1.7


@pytest.mark.parametrize("residual", [False, True])
def test_training_with_explicit_gradients_decreases_the_loss(residual):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 4, generator=g, dtype=F64)
    teacher = adj.random_network(4, 4, residual=residual, seed=11, scale=1.5)
    y = adj.forward(teacher, x).Z[-1]
    net = adj.random_network(4, 4, residual=residual, seed=12, scale=1.5)
    history = adj.train(net, x, y, steps=150, lr=0.5)
    assert history[-1] < 0.2 * history[0]
    assert all(b <= a + 1e-12 for a, b in zip(history[:20], history[1:21]))  # small steps: monotone at first


def test_memorisation_error_falls_with_depth():
    assert mem.memorisation_width(2, 1) == 5 and mem.memorisation_width(3, 4) == 9
    x, y = mem.sample_task(10, seed=0)
    rows = mem.error_vs_depth(x, y, [2, 4, 8], steps=100, lr=0.05)
    e = [r["max_error"] for r in rows]
    assert rows[0]["width"] == 5
    assert e[0] > e[1] > e[2] and e[2] < 0.25 * e[0]
    z = mem.embed(x, 5)
    assert torch.equal(z[:, :2], x) and not z[:, 2:].any()


def test_neural_ode_adjoint_gradient_and_training():
    x, y = node.spiral_task(24)
    assert node.adjoint_vs_autograd(node.Field(seed=3), x, y, tol=1e-8) < 1e-6
    h = node.train(x, y, steps=8, lr=0.05)["history"]
    assert h[-1] < 0.5 * h[0]


def test_bad_inputs_raise_input_error():
    net = adj.random_network(3, 4, residual=True)
    with pytest.raises(InputError, match="width mismatch"):
        adj.forward(net, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(InputError, match="non-finite"):
        adj.forward(net, torch.full((2, 4), math.nan, dtype=F64))
    with pytest.raises(InputError, match="ℓ ≥ 2"):
        adj.random_network(1, 4, residual=False)
    with pytest.raises(InputError, match="η = inf"):
        adj.train(net, torch.zeros(2, 4, dtype=F64), torch.zeros(2, 4, dtype=F64), steps=1, lr=math.inf)


def test_cli_survey_euler(tmp_path):
    from hybridlm.cli import cli

    res = CliRunner().invoke(cli, ["survey", "euler", "--depths", "8,16,32", "--samples", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "slope" in res.output
    summary = json.loads((tmp_path / "euler.json").read_text())
    assert -1.2 <= summary["slopes"]["resnet (0.20), w(k)=1/(ℓ−1)"] <= -0.8
    assert (tmp_path / "euler.png").stat().st_size > 1000


def test_cli_survey_bad_depth(tmp_path):
    from hybridlm.cli import cli

    res = CliRunner().invoke(cli, ["survey", "adjoint", "--depth", "1", "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "--depth = 1" in res.output and "ℓ ≥ 2" in res.output
    res = CliRunner().invoke(cli, ["survey", "memorise", "--depths", "4,x", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "'4,x'" in res.output
