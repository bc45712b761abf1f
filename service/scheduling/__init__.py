"""Scheduling across jobs: one pure plan per pass over the cluster, shared by the dispatcher and the simulator."""
