"""Copyable examples; a package so a job spec can name ``examples.user_model:build``."""
