"""The error for what a job names that only the cluster can find unusable: a data file missing on a node, a token
file of another dtype, a dataset without the column, a model entrypoint that does not resolve or returns the wrong
thing, model options the model refuses, a loss_fn that returns no trainable number, training settings under which the
loss stops being finite. The job fails once with the message alone, as a rejected spec is a 422 at
submit: the fault is in the job's input, and a traceback through ringmaster would say nothing more to its author
(the driver's log still has it: `ringmaster logs ID`). An exception the user's own code raises keeps its traceback."""

from __future__ import annotations

import inspect
import os


class JobInputError(ValueError):
    """The message names the JobSpec field at fault (data.path, model_options.pretrained, …) and what is wrong."""

    @property
    def reason(self) -> str:
        """The message, also when a DataLoader worker process raised it: torch re-raises it in the rank with the
        worker's traceback put before the message, whose last line is ``module.JobInputError: <message>``."""
        text = str(self)
        if text.startswith("Caught ") and "\nOriginal Traceback" in text:
            return text.rstrip("\n").rsplit("\n", 1)[-1].partition(": ")[2] or text
        return text


def defined_at(obj: object) -> str:
    """Where the job's code defines a class or function, as FILE:LINE (relative to the job's code directory, the
    working directory Ray unpacked it into), so a contract error points its author at their own line; '' where the
    source cannot be found (a built-in, a C extension)."""
    try:
        path = inspect.getsourcefile(obj)  # type: ignore[arg-type]  # any class or function; TypeError otherwise
        _, line = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    except (TypeError, OSError):
        return ""
    if path is None:
        return ""
    relative = os.path.relpath(path)
    return f"{relative if not relative.startswith('..') else path}:{line}"
