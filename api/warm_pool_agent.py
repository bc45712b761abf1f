"""The Ray agent `ringmaster serve` starts (service/ray_agent.py), with the workers' warm pool: part of the
composition root, the one place the control plane is handed the workers' code."""

from __future__ import annotations

from ringmaster.service.ray_agent import WarmPool, main


def _warm_pool(per_node: int) -> WarmPool:
    from ringmaster.workers.warm_pool import WarmPoolKeeper  # imports ray, not torch

    return WarmPoolKeeper(per_node)


if __name__ == "__main__":
    main(_warm_pool)
