"""A notebook's figures: each saved as a PNG and shown where a display exists.

Every notebook draws through ``show``: run as a script it writes the figure and prints its
path; in Jupyter (or any IPython kernel) the cell also displays the image, whether or not
pyplot was ever imported (the figures are plain ``matplotlib.figure.Figure`` objects, which
Jupyter would only print as ``<Figure size ...>``).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

from magic_jax.experiments.results import default_results


def figures_dir(results: str | os.PathLike) -> Path:
    """Where a notebook's figures go: ``notebooks/figures`` for the committed results (the
    same files ``ablations figures`` writes), ``<results>/figures`` for any other."""
    results = Path(results).resolve()
    try:
        committed = results == default_results()
    except SystemExit:  # an installed package: no committed results
        committed = False
    return results.parent / "figures" if committed else results / "figures"


def _kernel() -> Any:
    """The running IPython shell when it has a display (a Jupyter kernel), else None."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    shell = get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def show(fig: Any, name: str, results: str | os.PathLike) -> None:
    """Saves ``fig`` as ``<figures_dir(results)>/<name>.png``, prints the path, and displays
    the image in a Jupyter kernel. Nothing is written when the figure has no axes with data
    (no run finished yet)."""
    if not any(ax.has_data() for ax in fig.axes):
        print(f"figure {name}: no runs to draw yet")
        return
    out = figures_dir(results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    # rewrite only a changed image, so a committed figure redrawn the same stays untouched
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)
    print(f"figure: {path}")
    if _kernel() is not None:
        from IPython.display import Image, display

        display(Image(data=data, format="png"))
