"""Per-position acceptance chart (bf16 drafter vs quantized drafter) for the model card."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CHART_NAME = "acceptance.png"


def write_acceptance_chart(
    path: Path,
    baseline: Sequence[float] | None,
    quantized: Sequence[float] | None,
    *,
    baseline_tau: float | None = None,
    quantized_tau: float | None = None,
    title: str | None = None,
) -> Path:
    """Draw the fraction of steps in which draft position k was accepted, one line per drafter.

    Uses matplotlib's Agg backend (no display needed) and strips the PNG's software metadata so
    that the same report gives the same bytes.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    for values, label, tau, style in (
        (baseline, "bf16", baseline_tau, {"color": "#4C72B0", "marker": "o"}),
        (quantized, "quantized", quantized_tau, {"color": "#DD8452", "marker": "s"}),
    ):
        if not values:
            continue
        xs = list(range(1, len(values) + 1))
        name = label if tau is None else f"{label} (tau {tau:.2f})"
        ax.plot(
            xs,
            [float(v) for v in values],
            label=name,
            linewidth=1.8,
            markersize=4,
            color=style["color"],
            marker=style["marker"],
        )
    longest = max(len(baseline or []), len(quantized or []), 1)
    ax.set_xlim(0.5, longest + 0.5)
    ax.set_ylim(0.0, 1.02)
    ax.set_xticks(list(range(1, longest + 1)))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("fraction of steps accepting position k")
    return _save(fig, ax, path, title, legend="upper right")


MIX_CHART_NAME = "mix_tradeoff.png"


def write_tradeoff_chart(
    path: Path,
    uniform: Sequence[tuple[str, float, float]],
    mix: tuple[float, float | None, float | None],
    *,
    title: str | None = None,
) -> Path:
    """Bytes vs tau ratio: uniform settings (label, bytes, tau ratio measured on the dev prompts) and the
    mix (bytes, tau ratio predicted by the tau map, tau ratio measured on the held-out prompts)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    pts = sorted(uniform, key=lambda u: u[1])
    ax.plot([u[1] / 1e6 for u in pts], [u[2] for u in pts], color="#4C72B0", marker="o", linewidth=1.5,
            label="uniform GPTQ (dev prompts)")  # fmt: skip
    for label, b, r in pts:
        ax.annotate(label, (b / 1e6, r), textcoords="offset points", xytext=(4, -10), fontsize=8)
    mb, predicted, measured = mix
    if predicted is not None:
        ax.plot([mb / 1e6], [predicted], marker="D", color="#DD8452", linestyle="", label="mix, predicted")
    if measured is not None:
        ax.plot([mb / 1e6], [measured], marker="*", markersize=11, color="#C44E52", linestyle="",
                label="mix, held-out prompts")  # fmt: skip
    ax.set_xlabel("quantized Linear bytes (MB)")
    ax.set_ylabel("tau / tau bf16")
    return _save(fig, ax, path, title, legend="lower right")


def _save(fig, ax, path: Path, title: str | None, legend: str) -> Path:
    """Grid, legend and title, then a PNG without the software metadata (byte-stable across runs)."""
    ax.grid(True, alpha=0.3)
    ax.legend(loc=legend, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png", metadata={"Software": None})
    return path
