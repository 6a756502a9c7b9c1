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
