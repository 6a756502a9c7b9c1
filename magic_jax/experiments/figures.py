"""A notebook's figures: each saved as a PNG and shown where a display exists.

Every notebook draws through ``show``: it writes the figure and prints its path. In Jupyter
(or any IPython kernel) the cell also displays the image, whether or not pyplot was ever
imported (the figures are plain ``matplotlib.figure.Figure`` objects, which Jupyter would
only print as ``<Figure size ...>``). Run as a script where matplotlib has a window backend
(a display, and ``MPLBACKEND`` not ``Agg``), each figure opens in a window as it is drawn,
and the script waits at its end until the windows are closed.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from magic_jax.experiments.results import default_results

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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


def windows() -> bool:
    """Whether pyplot opens windows here: its backend (matplotlib's own choice, Agg where there
    is no display, unless ``MPLBACKEND`` names one) is an interactive one."""
    import matplotlib
    from matplotlib.backends import BackendFilter, backend_registry

    backend = matplotlib.get_backend().lower()
    return backend in backend_registry.list_builtin(BackendFilter.INTERACTIVE)


_WAITING: list[bool] = []  # set once the script's end waits for the windows


def _open_window(fig: Any, name: str) -> None:
    """Hands ``fig`` (drawn without pyplot) to pyplot under ``name``, which opens its window,
    and has the script's end wait until every window is closed (``plt.show``)."""
    import atexit

    import matplotlib.pyplot as plt

    plt.close(name)  # a figure drawn again under its name replaces the old window
    # pyplot makes a figure by calling FigureClass; this one returns the figure already drawn,
    # so pyplot's backend gives it a manager (its window) instead of making an empty one
    drawn = cast("type[Figure]", lambda **_: fig)
    plt.figure(num=name, FigureClass=drawn)
    plt.show(block=False)
    plt.pause(0.001)  # lets the window draw while the notebook goes on
    if not _WAITING:
        _WAITING.append(True)
        atexit.register(plt.show)


def show(fig: Any, name: str, results: str | os.PathLike) -> None:
    """Saves ``fig`` as ``<figures_dir(results)>/<name>.png``, prints the path, and shows the
    figure: as an image in a Jupyter kernel, in a window when a script runs where pyplot has
    a window backend. Nothing is written when the figure has no axes with data (no run
    finished yet)."""
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
    elif windows():
        _open_window(fig, name)
