"""One run of a script's command: its lines kept for the driver, a command that cannot start, a stop that lets a
SIGTERM handler finish and kills a process that ignores SIGTERM after the grace."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ringmaster.workers.script.process import NOT_FOUND_EXIT_CODE, ScriptProcess


def _run(code: str, cwd: Path) -> ScriptProcess:
    process = ScriptProcess([sys.executable, "-u", "-c", code], dict(os.environ), str(cwd))
    process.start()
    return process


def _wait_for_exit(process: ScriptProcess, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while process.exit is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_output_lines_and_the_exit_are_kept(tmp_path: Path) -> None:
    process = _run("import sys; print('one'); print('two', file=sys.stderr); sys.exit(3)", tmp_path)
    _wait_for_exit(process)
    lines, dropped = process.drain()
    assert sorted(lines) == [("stderr", "two"), ("stdout", "one")] and dropped == 0
    assert process.exit is not None and process.exit.code == 3 and not process.exit.stopped
    assert process.exit.describe() == "exited with code 3" and process.stderr_tail == ["two"]
    assert process.drain() == ([], 0)


def test_a_command_that_does_not_exist_could_not_start(tmp_path: Path) -> None:
    process = ScriptProcess(["no-such-command-here"], dict(os.environ), str(tmp_path))
    process.start()
    assert process.exit is not None and process.exit.code == NOT_FOUND_EXIT_CODE
    assert process.exit.describe() == "could not start 'no-such-command-here': No such file or directory"


def test_a_stop_lets_a_sigterm_handler_save_and_kills_one_that_ignores_it(tmp_path: Path) -> None:
    saves = _run(
        "import signal, sys, time, pathlib\n"
        "def save(*_):\n    pathlib.Path('saved').write_text('yes'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\nprint('ready')\ntime.sleep(60)",
        tmp_path,
    )
    ignores = _run(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready')\ntime.sleep(60)", tmp_path
    )
    for process in (saves, ignores):
        while not process.drain()[0]:
            time.sleep(0.02)  # its handler is installed once it printed
    saved = saves.stop(grace_s=5)
    assert saved is not None and saved.code == 0 and saved.stopped and (tmp_path / "saved").read_text() == "yes"
    began = time.monotonic()
    killed = ignores.stop(grace_s=0.5)
    assert killed is not None and killed.describe() == "was killed by SIGKILL" and time.monotonic() - began < 5
