"""The figure of a supervised arc: the plant's trajectory, the safe set, the model's busy
intervals and its jumps, and the commanded versus applied input (the CBF corrections)."""

from __future__ import annotations

from pathlib import Path

from hybridlm.figures import save_figure


def plant_figure(arc, plant, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau, xs, us = plant.trajectory(points_per_segment=40)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=[3, 2])
    for d in arc.decisions:  # the model generating (q_G, with its q_E calls inside)
        top.axvspan(d.tau0, d.tau1, color="tab:orange", alpha=0.15, lw=0)
        bottom.axvspan(d.tau0, d.tau1, color="tab:orange", alpha=0.15, lw=0)
    top.plot(tau, xs[:, 0], color="tab:blue", lw=1.6, label=plant.states[0])
    for edge in plant.bounds().get(plant.states[0], []):  # the band edges: where h = 0 along the first state
        if edge is not None:
            top.axhline(edge, color="tab:red", ls="--", lw=1)
    calls = [c for d in arc.decisions for c in d.calls]
    for c in calls:
        color = "tab:green" if c.tool.startswith("set_") else "tab:gray"
        top.axvline(c.tau1, color=color, lw=0.9, alpha=0.8)
    for c in plant.crossings:
        top.plot([c.tau], [c.state[0]], marker="x" if c.direction == "leave" else "o", color="tab:red", ms=7)
    for ax in (top, bottom):
        ax.axvline(arc.horizon_s, color="black", ls=":", lw=1)
    top.set_ylabel(plant.states[0])
    top.set_title(f"{plant.name}: {arc.safe_fraction:.0%} of {arc.horizon_s:g} s in the safe set, "
                  f"{arc.violations} violation{'' if arc.violations == 1 else 's'}, {len(arc.decisions)} decisions"
                  f"{' (CBF filter on)' if plant.filter is not None else ''}")
    handles = [plt.Line2D([], [], color="tab:blue", label=plant.states[0]),
               plt.Line2D([], [], color="tab:red", ls="--", label="safe set boundary"),
               plt.Rectangle((0, 0), 1, 1, color="tab:orange", alpha=0.3, label="model busy (a decision)"),
               plt.Line2D([], [], color="tab:green", label="jump: set actuator"),
               plt.Line2D([], [], color="tab:gray", label="jump: other tool"),
               plt.Line2D([], [], color="black", ls=":", label="horizon")]
    top.legend(handles=handles, loc="best", fontsize=8)
    if arc.corrections:  # the held command, a step function from the first segment's
        first = plant.segments[0].commanded[0] if plant.segments else plant.u[0]
        times = [float(tau[0])] + [c["plant_time"] for c in arc.corrections] + [float(tau[-1])]
        values = [first] + [c["commanded"][0] for c in arc.corrections]
        bottom.step(times, values + [values[-1]], where="post", color="tab:purple", lw=1.2, label="commanded")
    bottom.plot(tau, us[:, 0], color="black", lw=1, label="applied")
    bottom.set_ylabel(plant.actuators[0].name)
    bottom.set_xlabel("plant time τ (s)")
    bottom.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)

