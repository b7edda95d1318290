"""``--plot``: the error–rank profiles of every layer with the chosen ranks marked."""

from __future__ import annotations

from pathlib import Path


def plot_profiles(proj, path: str | Path, weighting: str | None = None) -> Path:
    """Draw K-only and V-only profile errors per layer (log scale) and mark each layer's chosen rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stiefkv.calibrate.profile import LayerProfile

    profiles = proj.settings.get("profiles") or []
    if not profiles:
        raise ValueError("this checkpoint holds no error-rank profiles (they are made with --allocation dp)")
    weighting = weighting or proj.settings.get("weighting", "output")
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    cmap = plt.get_cmap("viridis")
    coded = False
    for i, (p, (rk, rv), specs) in enumerate(zip(profiles, proj.ranks, proj.specs)):
        prof = LayerProfile(**p)
        color = cmap(i / max(1, len(profiles) - 1))
        for ax, which, chosen, spec in ((axes[0], "k", rk, specs[0]), (axes[1], "v", rv, specs[1])):
            err = [max(e, 1e-12) for e in prof.relative(which, weighting)]
            ax.plot(prof.ranks, err, color=color, lw=1)
            # the profiles are of bf16 latents: a rank stored as codes is marked apart, at its bf16 error
            quantized = spec is not None and spec.quantized
            coded |= quantized
            ax.plot([chosen], [err[prof.ranks.index(chosen)]], "x" if quantized else "o", color=color, ms=4)
    measure = ("the whole model's next-token KL" if weighting == "kl" else
               f"relative squared layer error ({weighting})")
    for ax, name in zip(axes, ("keys only", "values only")):
        ax.set_yscale("log")
        ax.set_xlabel("rank (bf16 latents)")
        ax.set_title(f"{name}: {measure}")
    axes[0].set_ylabel("error (dots: chosen rank; colour: layer)" if not coded else
                       "error of bf16 latents (dots: chosen rank; crosses: stored as codes; colour: layer)")
    fig.suptitle(f"{proj.method}, {proj.key_mode_summary}, budget {proj.budget:g}")
    fig.tight_layout()
    from stiefkv.projections import write_atomically

    # folders checked writable before the work, made only now; a failed write leaves the file that was there
    kind = Path(path).suffix[1:] or "png"  # the temporary file's name says nothing of the format
    path = write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format=kind), "--plot")
    plt.close(fig)
    return path
