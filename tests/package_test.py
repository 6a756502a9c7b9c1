"""The package imports fast (no JAX) and resolves its public names lazily."""

import subprocess
import sys

import pytest

import magic_jax


def test_import_does_not_load_heavy_modules():
    code = (
        "import sys, magic_jax, magic_jax.rewards; "
        "heavy = ('jax', 'flax', 'transformers', 'torch', 'optax'); "
        "heavy = [m for m in heavy if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("name", magic_jax.__all__)
def test_public_names_resolve(name):
    assert getattr(magic_jax, name) is not None
    assert name in dir(magic_jax)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        magic_jax.no_such_thing  # noqa: B018


_HIDE_FLAX = """
import importlib.machinery
import sys

import magic_jax


class NoFlax:  # the path finder, blind to flax: flax is not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "flax":
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [NoFlax() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
try:
    import flax
except ModuleNotFoundError as e:
    print("outside:", e)
try:
    import magic_jax.model.qwen2
except ModuleNotFoundError as e:
    print("inside:", e)
print(magic_jax.extras.message("scipy"))
# a magic_jax module asking whether flax exists gets None, not an error
probe = {"__name__": "magic_jax.probe"}
exec("import importlib.util; found = importlib.util.find_spec('flax')", probe)
print("lookup:", probe["found"])
"""


def test_a_missing_optional_dependency_names_its_extra():
    """With flax hidden from the path finder (as a core install lacks it), importing the
    model from magic_jax says which extra to install; an import of flax from elsewhere keeps
    Python's own error. The core wheel is checked for real in tests/wheel_test.py (slow)."""
    out = subprocess.run(
        [sys.executable, "-c", _HIDE_FLAX], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "outside: No module named 'flax'",
        "inside: No module named 'flax': magic_jax.model.qwen2 needs it; install the [model] "
        "extra: pip install 'magic-jax[model]'",
        "None",
        "lookup: None",
    ]


def test_a_missing_cloud_tpu_client_names_the_launch_extra():
    from magic_jax import extras

    said = extras.message("google.cloud.tpu_v2", "magic_jax.jobs.tpu_api")
    assert said is not None and "pip install 'magic-jax[launch]'" in said
    assert "magic-jax[train]" in (extras.message("google.cloud.storage") or "")
