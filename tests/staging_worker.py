"""One process of tests/staging_multihost_test.py: a ``magic-jax`` command, then what this
process read from Cloud Storage through TensorStore.

Run as ``python staging_worker.py METRICS_JSON CLI_ARGS...``. The command runs as
``magic-jax CLI_ARGS...`` would (``jobs.cli.main``; a multi-host job from the
``MAGIC_JAX_*`` variables); then TensorStore's counters of its ``gcs`` key-value store
(``/tensorstore/kvstore/gcs/bytes_read``, ``read``, ...: what this process fetched from
the bucket, orbax's reads of array chunks and metadata) go to METRICS_JSON.
"""

import json
import sys


def main(metrics_json: str, argv: list[str]) -> int:
    import tensorstore as ts

    from magic_jax.jobs import cli

    code = cli.main(argv)
    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/gcs/")
    counters = {m["name"].rsplit("/", 1)[-1]: m["values"][0].get("value") for m in found}
    with open(metrics_json, "w") as f:
        json.dump(counters, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
