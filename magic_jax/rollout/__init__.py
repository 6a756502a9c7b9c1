"""Rollouts: sampling, the decode engine, the continuous-batching driver, scoring by the
verifiers (shared with evaluation) and rejection sampling."""
