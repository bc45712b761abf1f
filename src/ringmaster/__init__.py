"""ringmaster: elastic distributed training as a service.

The rooms live at the repository's top level (api/, service/, workers/, cli/); the links beside this file give them
their installed names (ringmaster.api, ringmaster.service, ringmaster.workers, ringmaster.cli), which never collide
with a user's own packages, and let editors and type checkers resolve those names from the files themselves.
"""


def report(step: int, **metrics: float) -> None:
    """A training script's metric points at `step`, for its curves (script mode; docs/jobs/script-mode.md). Imported
    at the first call, so that importing any room of ringmaster never imports the workers'."""
    from ringmaster.workers.script.report import report as record

    record(step, **metrics)
