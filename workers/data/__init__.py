"""Datasets the built-in models train on, and the resumable per-rank stream of micro-batches."""
