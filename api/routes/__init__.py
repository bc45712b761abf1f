"""HTTP routes, one module per audience: users (jobs), the job driver (internal), probes (health)."""
