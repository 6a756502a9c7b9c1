"""Built-in tasks: small problems with verifiable answers that a tiny model learns on a CPU."""
