"""The job driver is on the path from submit to the first step: what it imports delays every worker."""

from __future__ import annotations

import subprocess
import sys


def test_the_job_driver_starts_without_importing_torch() -> None:
    # torch costs the driver 2-3 s on a small machine before it can even start the worker actors.
    code = (
        "import sys, ringmaster.workers.driver; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
