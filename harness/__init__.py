"""Shared helpers for tests and benchmarks: simulated multi-node Ray clusters, a real control plane on a local Ray
head, in-process process groups, a stand-in cluster for the dispatcher, and a free local port.

Not part of the installed product (pyproject.toml lists only the ringmaster.* packages): tests import it through
pytest's ``pythonpath = ["."]``, benchmarks by putting the repository root on sys.path.
"""
