"""Test configuration: eight virtual CPU devices for the sharding tests."""

import os

# Must run before jax is imported anywhere: gives the sharding tests a 2x4 mesh on CPU.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
