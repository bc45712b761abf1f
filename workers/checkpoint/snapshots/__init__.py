"""In-memory snapshots (placeholder docstring, replaced when the module is split)."""
