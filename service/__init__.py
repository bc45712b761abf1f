"""Control plane: settings, database, queue, dispatcher, planner and CLI (never imports torch)."""
