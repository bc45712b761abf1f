"""Parallelism: the techniques, one small module each, and `parallelize`, which composes them in one fixed order from
the mesh's dimensions and the strategy's catalogue entry (service/catalogue.py)."""

from ringmaster.workers.strategies.parallel_model import OptimizerConfig, ParallelModel, ParallelSetup
from ringmaster.workers.strategies.parallelize import parallelize

__all__ = ["OptimizerConfig", "ParallelModel", "ParallelSetup", "parallelize"]
