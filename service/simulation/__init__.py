"""`ringmaster simulate`: a discrete-event simulation of a cluster that replays a workload trace through the scheduler's
own plan function (service/scheduling/plan.py), free of Ray, torch and the database."""
