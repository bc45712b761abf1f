"""The job driver: the entrypoint of each Ray job ringmaster submits (`python -m ringmaster.workers.driver`).

A controller (controller.py) with explicit states (states.py) over a worker group (worker_group.py), its decisions
taken by small policies (policies.py), one poll of the group per iteration (poll.py), a probe of who is still there
(probe.py), and one owner of the attempt's placement-group bundles (bundles.py). The entrypoint (__main__.py) hands
the controller the group, the bundles, the standby pool and a thin facade over the Ray calls and the clock it waits
on (collaborators.py, ray_facade.py); its tests hand it fakes.

It takes the placement group the dispatcher reserved, forms the group, streams what the workers record to the control
plane, and when workers are lost keeps the survivors, re-forms the group at the largest size in [workers.min,
workers.max] whose workers are ready now, and resumes from the newest step in the members' memory, else from the
latest committed checkpoint. Workers still to be started (a replacement node, returning capacity) warm up while the
group trains (standby.py), and the group grows to them at a step boundary once they are warm; only a group that would
be below workers.min waits for cold workers.

A script job (JobSpec.command) has a controller of its own (script_controller.py, its decisions in script_policy.py)
over the same worker group, bundles and scaling policy: each worker runs the team's script once as torchrun would,
and a lost worker restarts every process of the group at the size the scaling policy decides.
"""
