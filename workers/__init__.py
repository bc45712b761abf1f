"""Data plane: the job driver, worker actors, strategies, models and data that run on Ray."""
