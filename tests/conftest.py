"""Test configuration: eight virtual CPU devices for the sharding tests; ``gpu`` tests skip
without a GPU."""

import os

# Must run before jax is imported anywhere: gives the sharding tests a 2x4 mesh on CPU.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _has_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend, or JAX_PLATFORMS leaves it out
        return False


def pytest_collection_modifyitems(config, items):
    import pytest

    marked = [item for item in items if item.get_closest_marker("gpu")]
    if marked and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU device (run with `make gpu-test`)")
        for item in marked:
            item.add_marker(skip)
