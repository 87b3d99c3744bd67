"""The sphere model of attention (docs/theory.md §5.3, the survey's (0.42)–(0.45)) and the geometry checks of a model."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import expm

from hybridlm import ModelConfig, load_model
from hybridlm.analysis import (
    consensus_E, geometry_report, on_layernorm_sphere, plot_sphere_trajectory, row_stochastic,
    simulate_sphere, sphere_field, token_norms,
)


def tokens(n, d, seed):
    return np.random.default_rng(seed).standard_normal((n, d))


def symmetric_with_gap(d, seed, eigenvalues):
    """Q diag(λ) Qᵀ with a random orthogonal Q; returns W and the eigenvector of the largest λ."""
    Q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    lam = np.asarray(eigenvalues, dtype=float)
    return Q @ np.diag(lam) @ Q.T, Q[:, np.argmax(lam)]


# ---------------------------------------------------------------------- the field
def test_field_matches_the_equation_token_by_token():
    """ż_i = P_{z_i} Σ_h W_U^h Σ_j a^h_ij z_j, a^h_ij = softmax_j(z_iᵀ W_P^h z_j/√e), j ≤ i."""
    rng = np.random.default_rng(3)
    n, d, e = 5, 4, 2.0
    z = tokens(n, d, 0)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    W_U, W_P = rng.standard_normal((2, d, d)), rng.standard_normal((2, d, d))
    for causal in (True, False):
        expected = np.zeros((n, d))
        for i in range(n):
            keys = range(i + 1) if causal else range(n)
            u = np.zeros(d)
            for h in range(2):
                s = np.array([z[i] @ W_P[h] @ z[j] / math.sqrt(e) for j in keys])
                a = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                u += W_U[h] @ sum(a_ij * z[j] for a_ij, j in zip(a, keys))
            expected[i] = u - z[i] * (z[i] @ u)
        got = sphere_field(z, W_U, W_P, e=e, causal=causal)
        np.testing.assert_allclose(got, expected, atol=1e-12)
        np.testing.assert_allclose((got * z).sum(1), 0, atol=1e-12)  # tangent to the sphere
        # heads add up
        one = sum(sphere_field(z, W_U[h], W_P[h], e=e, causal=causal) for h in range(2))
        np.testing.assert_allclose(got, one, atol=1e-12)


def test_bad_inputs_are_refused():
    z = tokens(3, 3, 0)
    z[1] = 0
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        simulate_sphere(z, np.eye(3), np.eye(3), t_end=1)
    with pytest.raises(ValueError, match="W_P"):
        simulate_sphere(tokens(3, 3, 0), np.eye(3), np.eye(4), t_end=1)


# ---------------------------------------------------------------------- the two known cases
def test_identity_value_map_all_tokens_converge_to_first_initial_position():
    """W_U = I (two heads, any W_P), causal: z_1 stays at z_1(0) and every token goes there."""
    n, d = 6, 4
    z0 = tokens(n, d, 1)
    z1 = z0[0] / np.linalg.norm(z0[0])
    W_P = np.random.default_rng(2).standard_normal((2, d, d))
    traj = simulate_sphere(z0, np.stack([np.eye(d), np.eye(d)]), W_P, t_end=40, n_eval=81)
    E = traj.E
    assert traj.drift < 1e-5
    np.testing.assert_allclose(traj.z[:, 0], np.broadcast_to(z1, (81, d)), atol=1e-12)  # fixed
    assert np.linalg.norm(traj.final - z1, axis=1).max() < 1e-6
    assert E[-1] < 1e-12 and E[0] > 0.3
    assert E[-1] < E[40] < E[20] < E[0]  # decreasing overall


def test_full_attention_identity_value_map_reaches_consensus_elsewhere():
    """Without the causal mask token 1 moves too: consensus, but not at z_1(0)."""
    n, d = 6, 3
    z0 = tokens(n, d, 4)
    traj = simulate_sphere(z0, np.eye(d), np.eye(d), t_end=30, n_eval=31, causal=False)
    assert traj.E[-1] < 1e-10
    assert np.linalg.norm(traj.final[0] - z0[0] / np.linalg.norm(z0[0])) > 1e-2


@pytest.mark.parametrize("flip", [1.0, -1.0])
def test_symmetric_value_map_first_token_converges_to_principal_eigenvector(flip):
    """One head, W_U constant symmetric: z_1(t) = e^{tW_U} z_1(0)/‖·‖ → sign(⟨z_1(0), v⟩) v."""
    d = 4
    W_U, v = symmetric_with_gap(d, 5, [2.0, 0.5, -0.3, -1.0])
    z0 = tokens(5, d, 6)
    z0[0] *= flip
    sign = np.sign(z0[0] @ v)
    W_P = np.random.default_rng(7).standard_normal((d, d))
    traj = simulate_sphere(z0, W_U, W_P, t_end=15, n_eval=31)
    closed = np.stack([expm(t * W_U) @ traj.z[0, 0] for t in traj.t])
    closed /= np.linalg.norm(closed, axis=1, keepdims=True)
    np.testing.assert_allclose(traj.z[:, 0], closed, atol=1e-6)
    assert traj.final[0] @ v * sign > 1 - 1e-9
    assert traj.drift < 1e-5


def test_causal_prefix_does_not_see_later_tokens():
    d = 3
    z0 = tokens(6, d, 8)
    W_U, W_P = np.random.default_rng(9).standard_normal((2, d, d))
    whole = simulate_sphere(z0, W_U, W_P, t_end=5, n_eval=11)
    prefix = simulate_sphere(z0[:3], W_U, W_P, t_end=5, n_eval=11)
    np.testing.assert_allclose(whole.z[:, :3], prefix.z, atol=1e-7)


def test_time_varying_weights_are_callables():
    d = 3
    z0 = tokens(4, d, 10)
    W_P = np.random.default_rng(11).standard_normal((d, d))
    const = simulate_sphere(z0, np.eye(d), W_P, t_end=3, n_eval=5)
    varying = simulate_sphere(z0, lambda t: np.eye(d), lambda t: W_P, t_end=3, n_eval=5)
    np.testing.assert_allclose(const.z, varying.z, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 5), d=st.integers(2, 4), seed=st.integers(0, 2**16), causal=st.booleans())
def test_trajectories_stay_on_the_sphere(n, d, seed, causal):
    rng = np.random.default_rng(seed)
    traj = simulate_sphere(rng.standard_normal((n, d)), rng.standard_normal((2, d, d)),
                           rng.standard_normal((2, d, d)), t_end=3, n_eval=13, causal=causal)
    dev = np.abs(np.linalg.norm(traj.z, axis=-1) - 1).max()
    assert dev <= traj.drift < 1e-5
    assert traj.z.shape == (13, n, d) and traj.t[-1] == 3
    E = traj.E
    assert np.all(E >= 0) and np.all(E <= 2)


# ---------------------------------------------------------------------- consensus error (0.45)
def test_consensus_error_known_values_numpy_and_torch():
    n, d = 4, 4
    assert consensus_E(np.ones((n, d)) * np.arange(1, n + 1)[:, None]) == 0  # aligned, any lengths
    assert math.isclose(consensus_E(np.eye(n)), 1 - 1 / n)  # orthogonal
    anti = np.array([[1.0, 0], [-2, 0], [-1, 0]])
    assert math.isclose(consensus_E(anti), 1 - (1 - 1 - 1) / 3)  # 2(n−1)/n
    z = np.random.default_rng(0).standard_normal((2, 3, 5, 4))  # batched [..., n, d]
    E_np = consensus_E(z)
    E_t = consensus_E(torch.from_numpy(z))
    assert E_np.shape == (2, 3) and isinstance(E_t, torch.Tensor) and E_t.shape == (2, 3)
    np.testing.assert_allclose(E_t.numpy(), E_np, rtol=1e-12)
    direct = 1 - np.mean([[[z[a, b, 0] @ z[a, b, i] / np.linalg.norm(z[a, b, 0]) / np.linalg.norm(z[a, b, i])
                            for i in range(5)] for b in range(3)] for a in range(2)], axis=-1)
    np.testing.assert_allclose(E_np, direct, atol=1e-14)
    assert consensus_E(torch.from_numpy(z).float()).dtype == torch.float32


def test_consensus_error_is_accurate_near_consensus():
    theta = 1e-9
    z = np.array([[1.0, 0.0], [math.cos(theta), math.sin(theta)]])
    assert math.isclose(consensus_E(z), theta**2 / 4, rel_tol=1e-6)  # 1 − cos would give 0


def test_plot_sphere_trajectory(tmp_path):
    z0 = tokens(4, 3, 12)
    traj = simulate_sphere(z0, np.eye(3), np.eye(3), t_end=5, n_eval=21)
    assert plot_sphere_trajectory(traj, tmp_path / "s2.png", dpi=40).stat().st_size > 2_000
    traj4 = simulate_sphere(tokens(4, 4, 13), np.eye(4), np.eye(4), t_end=5, n_eval=21)
    assert plot_sphere_trajectory(traj4, tmp_path / "s3.png", title="d = 4", dpi=40).stat().st_size > 2_000


# ---------------------------------------------------------------------- geometry of a model
@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(vocab_size=100, n_ctx=32, d_model=16, n_layer=2, n_head=2, eos_token_id=None, norm_eps=1e-12)
    return load_model(cfg, seed=3)


def test_geometry_report_on_a_tiny_model(tiny):
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    rows = geometry_report(tiny, ids)
    assert [r.layer for r in rows] == [0, 1]
    for r in rows:
        assert r.ok, r
        assert r.ln1["sum"] < 1e-4 and r.ln1["norm"] < 1e-3 and r.pattern["above_diagonal"] == 0
        assert 0 < r.norm_mean <= r.norm_max and 0 <= r.E <= 2
    _, cache = tiny.run_with_cache(ids, names=lambda n: n.endswith("hook_resid_post"))
    norms = token_norms({l: cache[f"blocks.{l}.hook_resid_post"] for l in range(2)})
    assert norms[1].shape == (2, 11)
    assert math.isclose(float(norms[1].mean()), rows[1].norm_mean, rel_tol=1e-6)
    assert math.isclose(consensus_E(cache["blocks.1.hook_resid_post"].double()).mean().item(), rows[1].E,
                        rel_tol=1e-6)  # fused vs explicit attention: float32 rounding


def test_sphere_check_sees_points_off_the_sphere():
    x = torch.randn(3, 16)
    dev = on_layernorm_sphere(x)
    assert not dev.ok and dev["sum"] > 0.01
    ln = torch.nn.functional.layer_norm(x.double(), (16,), eps=0.0)
    assert on_layernorm_sphere(ln, atol=1e-12).ok


def test_row_stochastic_sees_mass_after_the_query():
    n = 5
    causal = torch.softmax(torch.randn(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf), -1)
    assert row_stochastic(causal).ok
    full = torch.softmax(torch.randn(n, n), -1)
    dev = row_stochastic(full)
    assert not dev.ok and dev["above_diagonal"] > 0 and dev["row_sum"] < 1e-6
    assert row_stochastic(full, causal=False).ok
    assert row_stochastic(torch.softmax(torch.randn(1, n), -1)).ok  # a decode step: one query, every key
    negative = causal.clone()
    negative[2, :3] = torch.tensor([-0.2, 1.2, 0.0])  # still sums to 1
    assert row_stochastic(negative)["negative"] > 0.1
