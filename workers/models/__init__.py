"""Models as plug-ins: built-ins and user entrypoints share one contract (see registry.py)."""

from ringmaster.workers.models.registry import EntrypointError, ModelBundle, build_bundle

__all__ = ["EntrypointError", "ModelBundle", "build_bundle"]
