"""From a real layer's weights to the continuous model on the sphere (the survey's (0.42)–(0.44),
docs/theory.md §5.3).

A layer's attention, read without positions and biases, on tokens z_i = r·u_i of the sphere of
radius r, writes for token i

    A_i(Z)/r = Σ_h W_U^h Σ_j a^h_ij u_j,    a^h_ij = softmax_j(u_iᵀ (r² W_P^h) u_j / √e),

with, in the column convention of `hybridlm.analysis.sphere`, W_U^h = (W_V^h W_O^h)ᵀ (head h's value
map and its rows of W_O, the key/value head it reads under grouping) and W_P^h = W_Q^h W_K^hᵀ, and
1/√e the layer's score scale. The sphere block's attention-only step u ← n(u + A(Z)/r) (0.41) is then
a projected Euler step of size 1 of the flow (0.43) with these weights, and u ← n(u + h·A(Z)/r) a step
of size h: as h → 0, E after t/h such steps tends to the flow's E(t) (a test checks it).

`bridge` loops one layer that way and integrates the flow from the same tokens, and returns E of
both, the survey's (0.45).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hybridlm.analysis.sphere import consensus_E, simulate_sphere
from hybridlm.errors import InputError
from hybridlm.lm.sphere_block import to_sphere


def sphere_weights(attn) -> tuple[np.ndarray, np.ndarray, float]:
    """(W_U [H, d, d], W_P [H, d, d], e) of an attention sublayer, as (0.42)–(0.43) take them."""
    if attn.q_norm is not None or attn.softcap is not None:
        raise InputError("the sphere model has no QK-norm and no capped scores: this layer's attention has them")
    H, H_kv, d_k = attn.n_head, attn.n_kv_head, attn.d_head
    W_Q, W_K, W_V = (w.detach().double() for w in (attn.W_Q, attn.W_K, attn.W_V))  # [d, heads · d_k]
    W_O = attn.W_O.weight.detach().double().T  # [H · d_k, d]: the row map o ↦ o W_O
    W_U, W_P = [], []
    for h in range(H):
        q, kv = slice(h * d_k, (h + 1) * d_k), h // (H // H_kv)
        k = slice(kv * d_k, (kv + 1) * d_k)
        W_P.append(W_Q[:, q] @ W_K[:, k].T)
        W_U.append((W_V[:, k] @ W_O[q]).T)
    return torch.stack(W_U).numpy(), torch.stack(W_P).numpy(), 1.0 / attn.scale**2


def _biases(attn) -> bool:
    return any(b is not None and bool(b.detach().abs().max() > 0) for b in (attn.W_qkv.bias, attn.W_O.bias))


@torch.no_grad()
def looped_layer(attn, u0: torch.Tensor, steps: int, *, step_size: float = 1.0, radius: float) -> list[float]:
    """E (0.45) of u ← n(u + h·A(r·u)/r) over `steps` steps from unit tokens u0 [n, d] (one layer's
    attention, no positions): [steps + 1] values."""
    z = to_sphere(u0[None].to(attn.W_O.weight.dtype), radius)
    pos = torch.arange(z.shape[1])
    E = [float(consensus_E(z[0]))]
    for _ in range(steps):
        z = to_sphere(z + step_size * attn(z, pos, None, None), radius)
        E.append(float(consensus_E(z[0])))
    return E


def bridge(model, layer: int, ids, *, steps: int = 50, radius: float | None = None,
           step_sizes: tuple[float, ...] = (1.0, 0.1)) -> dict:
    """One real layer, looped (attention only, on the sphere) and as the flow (0.43) with its W_U, W_P,
    from the embedded tokens `ids`: E at t = 0, 1, …, steps (t counts layer-steps of size 1) for the flow
    and for each step size h of the loop (t/h steps of size h reach time t)."""
    cfg = model.config
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.n_layer:
        raise InputError(f"layer {layer!r}: expected an integer 0 ≤ layer < {cfg.n_layer}")
    attn = model.blocks[layer].attn
    if _biases(attn):
        raise InputError(f"layer {layer} has biases in its attention; the sphere model (0.42) has none")
    r = math.sqrt(cfg.d_model) if radius is None else float(radius)
    ids = torch.as_tensor(ids).reshape(1, -1)
    u0 = to_sphere(model.W_e[ids[0]].detach().double(), 1.0)
    W_U, W_P, e = sphere_weights(attn)
    flow = simulate_sphere(u0.numpy(), W_U, r * r * W_P, t_end=float(steps), n_eval=steps + 1, e=e, rtol=1e-7,
                           atol=1e-9)
    out = {"layer": layer, "tokens": int(ids.shape[1]), "radius": r, "t": list(range(steps + 1)),
           "E_flow": [float(v) for v in flow.E], "drift": flow.drift}
    for h in step_sizes:
        per_unit = round(1 / h)
        if not math.isclose(per_unit * h, 1.0):
            raise InputError(f"step size {h}: expected 1/h to be a whole number")
        E = looped_layer(attn, u0.float(), steps * per_unit, step_size=h, radius=r)
        out[f"E_loop_h{h:g}"] = E[::per_unit]
    return out


def write_bridge(out: dict, folder) -> tuple:
    """bridge.csv (t, E of the flow, E of each loop) and bridge.png of a `bridge` result; returns their paths."""
    import csv
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridlm.figures import save_figure

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    loops = [k for k in out if k.startswith("E_loop_h")]
    with open(folder / "bridge.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["t", "E_flow", *loops])
        w.writerows([t, *(f"{out[k][i]:.6g}" for k in ("E_flow", *loops))] for i, t in enumerate(out["t"]))
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    ax.plot(out["t"], out["E_flow"], "k-", lw=2, label="flow (0.43), scipy DOP853")
    for k in loops:
        ax.plot(out["t"], out[k], "o--", ms=3, lw=1, label=f"looped layer, u ← n(u + h·A/r), h = {k[8:]}")
    ax.set_xlabel("t (layer-steps of size 1)")
    ax.set_ylabel("E (0.45)")
    ax.set_title(f"{out.get('model', '')} layer {out['layer']}, attention only on the sphere, "
                 f"{out['tokens']} tokens, r = {out['radius']:.1f}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return folder / "bridge.csv", save_figure(fig, folder / "bridge.png")


def main(argv: list[str] | None = None) -> None:
    """`python -m hybridlm.analysis.bridge --model smollm2-135m --layer 0 --out DIR`: one real layer's
    looped E against its flow's, as bridge.csv, bridge.png and bridge.json."""
    import argparse
    import json
    from pathlib import Path

    from hybridlm.weights.loading import load_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--tokens", type=int, default=8, help="random tokens of the vocabulary (seeded)")
    p.add_argument("--steps", type=int, default=3, help="horizon t (the flow is stiff at a real layer's r: keep it short)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    model = load_model(a.model)
    ids = torch.randint(0, model.config.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(a.seed))
    out = {"model": a.model, **bridge(model, a.layer, ids, steps=a.steps, step_sizes=(1.0, 0.1, 0.01))}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bridge.json").write_text(json.dumps(out, indent=1))
    print(*write_bridge(out, a.out))


if __name__ == "__main__":
    main()
