"""The one error a simulation's input can cause: the command line prints it as one line."""

from __future__ import annotations


class SimulationInputError(ValueError):
    """A trace, setting or cluster the simulator cannot use, said in one line that names the culprit."""
