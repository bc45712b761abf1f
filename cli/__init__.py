"""The `ringmaster` command line, the composition root: it starts the API's server (`serve`, `demo`) and runs the
workers' export in a process of its own, and nothing in api/, service/ or workers/ imports it.

app.py registers the commands of jobs.py (each through the REST API), planning.py (`plan`), local.py (`serve` and
`demo`, in this process) and admin.py (directly in the database); render.py is how they show things and failures.py
how they end on an expected failure."""
