"""A byte-trigram language model: a project of its own, shipped with its job by `ringmaster submit --code`."""
