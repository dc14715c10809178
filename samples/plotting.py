"""The samples' one plotting helper: line plots to a PNG with matplotlib, if installed.

from plotting import save_line_plot
save_line_plot("loss.png", [(steps, losses, "-", "loss")], xlabel="step")
"""

from __future__ import annotations

from typing import Any, Sequence


def save_line_plot(
    path: str,
    curves: Sequence[tuple[Any, Any, str, str | None]],
    *,
    xlabel: str,
    ylabel: str | None = None,
    title: str | None = None,
    size: tuple[float, float] = (5, 3),
) -> bool:
    """Plot (x, y, format, label) curves into ``path``; False (and a hint) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install pydiff[plot])")
        return False
    fig, ax = plt.subplots(figsize=size)
    for x, y, fmt, label in curves:
        ax.plot(x, y, fmt, label=label, **({"ms": 3, "alpha": 0.5} if fmt == "." else {}))
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if any(label for *_, label in curves):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print("plot written to", path)
    return True
