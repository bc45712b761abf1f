"""The test suite in two lanes side by side: the tests marked ``alongside`` on SQLite (no Ray, no multi-rank torch,
no PostgreSQL, which a test of the other lane restarts) in one pytest, everything else in another. Most of the
suite waits on Ray and child processes, so the light lane runs in time the main lane leaves idle. Plain ``pytest``
runs the same tests one after another.

    python -m harness.test_lanes [pytest arguments for both lanes]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

LIGHT = "alongside and not postgres"


def main(arguments: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ringmaster-lanes-") as folder:
        light_log = Path(folder) / "light.log"
        with light_log.open("w") as log:
            light = subprocess.Popen([sys.executable, "-m", "pytest", "-m", LIGHT, "-p", "no:cacheprovider", *arguments],
                                     stdout=log, stderr=subprocess.STDOUT)
            try:
                main_lane = subprocess.run([sys.executable, "-m", "pytest", "-m", f"not ({LIGHT})", *arguments]).returncode
            finally:
                light_code = light.wait()
        print(f"\n===== the light lane (-m '{LIGHT}') =====", flush=True)
        print(light_log.read_text(), flush=True)
    print(f"main lane: exit {main_lane}; light lane: exit {light_code}", flush=True)
    return main_lane or light_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
