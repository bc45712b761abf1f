"""ringmaster: elastic distributed training as a service.

The rooms live at the repository's top level (api/, service/, workers/, cli/); the links beside this file give them
their installed names (ringmaster.api, ringmaster.service, ringmaster.workers, ringmaster.cli), which never collide
with a user's own packages, and let editors and type checkers resolve those names from the files themselves.
"""
