"""A rank's trainer and its components: see trainer.py for the shape."""

from ringmaster.workers.trainer.context import NullSink, ProgressSink, TrainContext, TrainResult
from ringmaster.workers.trainer.trainer import Trainer, run_training

__all__ = ["NullSink", "ProgressSink", "TrainContext", "TrainResult", "Trainer", "run_training"]
