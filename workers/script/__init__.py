"""Script mode: a team's own training script, run unchanged as torchrun runs it (JobSpec.command).

Each worker actor (worker.py) starts the command once as a process of its own (process.py) with the environment
torchrun gives a rank (environment.py), hands its output to the driver line by line, and reads the metrics the script
reports (report.py, `ringmaster.report`) or writes as TensorBoard event files (metric_sources.py). The driver's script
controller (workers/driver/script_controller.py) places, ranks, restarts and stops the group.
"""
