"""Script mode end to end on a real local Ray, through REST: a torchrun-style DDP script written here runs unchanged
on two workers and trains exactly as it does under `torchrun --nproc_per_node 2`; a Hugging Face Trainer script's
curves come from its TensorBoard files alone; bad input fails the job once with the rank, its exit code and its
stderr; a cancel lets the script save on SIGTERM.

One control plane serves the module (tests/conftest.py's ray_server, on the session's shared head), and each test
reads as much as it can from one job: the cluster tests' time is CI's scarcest."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from harness.local_control_plane import wait_for_state
from harness.ports import free_port
from ringmaster.service.client import RingmasterClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
STEPS = 5
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "RINGMASTER_CHECKPOINT_DIR",
    "RINGMASTER_TENSORBOARD_DIR",
    "TENSORBOARD_LOGGING_DIR",
)

# A plain torchrun DDP script: env:// rendezvous, gloo, a tiny linear model, a fixed seed. It knows nothing of
# ringmaster but the optional report() call and the directories it may be given.
DDP_SCRIPT = f"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ringmaster

STEPS = {STEPS}
VARIABLES = {TORCHRUN_VARIABLES!r}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs = torch.randn(STEPS * world * 4, 4, generator=torch.Generator().manual_seed(1))
    targets = inputs.sum(1, keepdim=True)
    tensorboard = None
    if rank == 0 and os.environ.get("RINGMASTER_TENSORBOARD_DIR"):
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(os.environ["RINGMASTER_TENSORBOARD_DIR"])
    losses = []
    for step in range(STEPS):
        rows = slice((step * world + rank) * 4, (step * world + rank + 1) * 4)
        loss = F.mse_loss(model(inputs[rows]), targets[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        losses.append(mean)
        print(f"step {{step}} loss {{mean:.6f}}", flush=True)
        if rank == 0:
            ringmaster.report(step, loss=mean, loss_x2=2 * mean)
            if tensorboard is not None:
                tensorboard.add_scalar("train/learning_rate", 0.05 * (step + 1), step)
    if tensorboard is not None:
        tensorboard.close()
    results = Path(sys.argv[1])
    seen = {{name: os.environ.get(name) for name in VARIABLES}}
    (results / f"env-{{rank}}.json").write_text(json.dumps(seen))
    if rank == 0:
        (results / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _project(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def _script_spec(name: str, command: list[str], workers: int = 2, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "command": command,
        "workers": {"min": workers, "max": workers, "cpus_per_worker": 1},
        **fields,
    }


def _results(root: Path) -> Path:
    root.mkdir(parents=True)
    return root


def _wait_for_file(path: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
    return path.read_text()


def test_a_torchrun_ddp_script_runs_unchanged_and_matches_torchrun(
    client: RingmasterClient, ray_server, tmp_path: Path
) -> None:
    script = _project(tmp_path / "project", {"train.py": DDP_SCRIPT}) / "train.py"
    ours, theirs = _results(tmp_path / "ringmaster"), _results(tmp_path / "torchrun")
    # The script by its path, in the cluster's shared env: the tests below ship code (--code) and check its directory.
    job = client.submit(_script_spec("script-ddp", ["python", str(script), str(ours)], max_failures=0))
    # The same script under torchrun meanwhile, with the same seed.
    torchrun_command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun = subprocess.Popen(
        [*torchrun_command, "--master_port", str(free_port()), str(script), str(theirs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    done = wait_for_state(client, job["id"], TERMINAL, timeout_s=120)
    output = torchrun.communicate(timeout=120)[0].decode()
    assert torchrun.returncode == 0, output
    assert done["state"] == "SUCCEEDED", done["error"]
    assert done["attempt"] == 1

    ours_losses, torchrun_losses = (json.loads((where / "losses.json").read_text()) for where in (ours, theirs))
    assert len(ours_losses) == STEPS
    assert ours_losses == pytest.approx(torchrun_losses, abs=1e-6)

    environments = [json.loads((ours / f"env-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, seen in enumerate(environments):
        assert seen["RANK"] == seen["ROLE_RANK"] == str(rank)
        assert seen["LOCAL_RANK"] == str(rank)  # both workers on the one node: ranked as torchrun ranks a node
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == seen["ROLE_WORLD_SIZE"] == "2"
        assert seen["GROUP_RANK"] == "0" and seen["OMP_NUM_THREADS"] == "1"
        assert seen["TORCHELASTIC_RESTART_COUNT"] == "0" and seen["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert seen["TORCHELASTIC_RUN_ID"] == job["id"]
        assert seen["RINGMASTER_CHECKPOINT_DIR"].endswith(f"/{job['id']}/checkpoints")
        assert Path(seen["RINGMASTER_CHECKPOINT_DIR"]).is_dir()
        assert seen["RINGMASTER_TENSORBOARD_DIR"] == seen["TENSORBOARD_LOGGING_DIR"]
    assert environments[0]["MASTER_ADDR"] == environments[1]["MASTER_ADDR"]
    assert environments[0]["MASTER_PORT"] == environments[1]["MASTER_PORT"]

    logs = client.logs(job["id"])
    for rank in (0, 1):
        assert f"[rank {rank}] step 0 loss {ours_losses[0]:.6f}" in logs, logs[-3000:]
        assert f"[rank {rank}] step {STEPS - 1} loss" in logs

    assert client.job(job["id"])["progress"]["total_steps"] is None, "the script's own loop alone knows its steps"
    transitions = [event["to_state"] for event in client.events(job["id"])["items"] if event["to_state"]]
    assert transitions == ["QUEUED", "ADMITTED", "RUNNING", "SUCCEEDED"]
    rows = {row["step"]: row for row in client.metrics(job["id"])["items"]}
    assert sorted(rows) == list(range(STEPS))
    # loss and a metric of the script's own from ringmaster.report(), the learning rate from its TensorBoard file alone.
    assert [rows[step]["loss"] for step in range(STEPS)] == pytest.approx(ours_losses, abs=1e-9)
    assert [rows[step]["lr"] for step in range(STEPS)] == pytest.approx([0.05 * (s + 1) for s in range(STEPS)])
    assert [rows[step]["user_metrics"]["loss_x2"] for step in range(STEPS)] == pytest.approx(
        [2 * loss for loss in ours_losses]
    )


HF_STEPS = 8
# A Hugging Face Trainer script as a team writes one: a tiny GPT-2 of random weights, random tokens, gloo on CPUs,
# TensorBoard as its only report (transformers 5 writes where TENSORBOARD_LOGGING_DIR says; ringmaster sets it). It
# never imports ringmaster.
HF_TRAINER_SCRIPT = f"""
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

STEPS = {HF_STEPS}


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {{"input_ids": self.ids[index], "labels": self.ids[index]}}


def main():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    arguments = TrainingArguments(
        output_dir=os.environ.get("RINGMASTER_CHECKPOINT_DIR", "trainer_output"),
        ddp_backend="gloo",
        use_cpu=True,
        report_to=["tensorboard"],
        logging_steps=1,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=RandomTokens())
    trainer.train()
    seen = {{
        "rank": int(os.environ["RANK"]),
        "world_size": torch.distributed.get_world_size(),
        "steps": trainer.state.global_step,
        "tensorboard": os.environ["TENSORBOARD_LOGGING_DIR"],
    }}
    print("trained: " + json.dumps(seen))


if __name__ == "__main__":
    main()
"""


def test_a_hugging_face_trainer_scripts_curves_come_from_its_tensorboard_files_alone(
    client: RingmasterClient, ray_server, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project = _project(tmp_path / "project", {"train.py": HF_TRAINER_SCRIPT})
    job = client.submit(_script_spec("script-hf-trainer", ["python", "train.py"], max_failures=0), code=project)
    done = wait_for_state(client, job["id"], TERMINAL, timeout_s=180)
    logs = client.logs(job["id"])
    assert done["state"] == "SUCCEEDED", (done["error"], logs[-3000:])

    trained = {}
    for line in logs.splitlines():
        if "] trained: " in line:
            seen = json.loads(line.split("] trained: ", 1)[1])
            assert f"[rank {seen['rank']}] trained: " in line, line
            trained[seen["rank"]] = seen
    assert sorted(trained) == [0, 1], logs[-3000:]
    assert all(seen["world_size"] == 2 and seen["steps"] == HF_STEPS for seen in trained.values()), trained

    # The Trainer's own event files (rank 0 writes them), read back by TensorBoard's reader: the oracle.
    tensorboard = Path(trained[0]["tensorboard"])
    assert tensorboard.parts[-3:] == ("tensorboard", "attempt-1", "script") and job["id"] in tensorboard.parts
    written = EventAccumulator(str(tensorboard), size_guidance={"scalars": 0})
    written.Reload()
    losses = {event.step: event.value for event in written.Scalars("train/loss")}
    rates = {event.step: event.value for event in written.Scalars("train/learning_rate")}
    norms = {event.step: event.value for event in written.Scalars("train/grad_norm")}
    assert sorted(losses) == list(range(1, HF_STEPS + 1)), "logging_steps=1: a loss at every optimizer step"

    rows = {row["step"]: row for row in client.metrics(job["id"])["items"]}
    assert sorted(rows) == sorted(losses)
    assert [rows[step]["loss"] for step in sorted(losses)] == pytest.approx(
        [losses[step] for step in sorted(losses)], abs=1e-6
    )
    assert [rows[step]["lr"] for step in sorted(rates)] == pytest.approx([rates[step] for step in sorted(rates)])
    assert [rows[step]["grad_norm"] for step in sorted(norms)] == pytest.approx([norms[step] for step in sorted(norms)])
    assert all(row["user_metrics"] is None for row in rows.values()), "nothing came from ringmaster.report"


NONZERO_ON_RANK_1 = """
import os
import sys
import time

if os.environ["RANK"] == "1":
    print("rank 1 cannot find its data", file=sys.stderr)
    sys.exit(3)
time.sleep(120)  # rank 0 waits for its peer until the driver stops it
"""

SYNTAX_ERROR = """
def broken(:
    pass
"""


def test_bad_input_fails_once_with_the_rank_its_exit_code_and_its_stderr(
    client: RingmasterClient, ray_server, tmp_path: Path
) -> None:
    project = _project(tmp_path / "project", {"nonzero.py": NONZERO_ON_RANK_1, "broken.py": SYNTAX_ERROR})
    jobs = {
        "missing": client.submit(
            _script_spec("script-missing", ["no-such-command", "--flag"], workers=1), code=project
        ),
        "nonzero": client.submit(
            _script_spec("script-nonzero", ["python", "nonzero.py"], stop_grace_s=5), code=project
        ),
        "syntax": client.submit(_script_spec("script-syntax", ["python", "broken.py"], workers=1), code=project),
    }
    done = {kind: wait_for_state(client, job["id"], TERMINAL, timeout_s=120) for kind, job in jobs.items()}
    for kind, job in done.items():
        assert job["state"] == "FAILED", (kind, job["error"])
        assert job["attempt"] == 1 and job["failures"] == 0, f"{kind}: retried, though every attempt would fail alike"
        assert (
            "ringmaster/" not in job["error"]
            and "Traceback (most recent call last)" not in job["error"].split("stderr:")[0]
        ), job["error"]
    assert done["missing"]["error"].startswith("rank 0 could not start 'no-such-command': No such file or directory")
    assert done["nonzero"]["error"].startswith("rank 1 exited with code 3 (node ")
    assert done["nonzero"]["error"].endswith("the last lines of its stderr:\nrank 1 cannot find its data")
    assert done["syntax"]["error"].startswith("rank 0 exited with code 1 (node ")
    assert "SyntaxError: invalid syntax" in done["syntax"]["error"] and "def broken(:" in done["syntax"]["error"]


SAVES_ON_SIGTERM = """
import os
import signal
import sys
import time
from pathlib import Path

import ringmaster

checkpoints = Path(os.environ["RINGMASTER_CHECKPOINT_DIR"])
step = 0


def save_and_exit(signum, frame):
    saved = f"{os.getcwd()}\\nsaved at step {step} on signal {signum}"
    (checkpoints / f"rank-{os.environ['RANK']}.txt").write_text(saved)
    sys.exit(0)


signal.signal(signal.SIGTERM, save_and_exit)
while True:
    step += 1
    ringmaster.report(step, loss=1.0 / step)
    time.sleep(0.1)
"""


def test_cancel_sends_sigterm_and_the_scripts_save_is_kept(
    client: RingmasterClient, ray_server, tmp_path: Path
) -> None:
    project = _project(tmp_path / "project", {"loop.py": SAVES_ON_SIGTERM})
    job = client.submit(_script_spec("script-cancel", ["python", "loop.py"], stop_grace_s=10), code=project)
    wait_for_state(client, job["id"], {"RUNNING"}, timeout_s=120)
    deadline = time.monotonic() + 60
    while not client.metrics(job["id"])["items"]:
        assert time.monotonic() < deadline, "the script reported no step"
        ended = client.job(job["id"])
        assert ended["state"] == "RUNNING", ended["error"]
        time.sleep(0.2)
    assert client.cancel(job["id"])["state"] == "CANCELLED"
    running = next(event["data"] for event in client.events(job["id"])["items"] if event["to_state"] == "RUNNING")
    assert running["world_size"] == 2
    checkpoints = Path(running["checkpoint_dir"])
    assert checkpoints.parts[-2:] == (job["id"], "checkpoints")
    for rank in (0, 1):
        cwd, saved = _wait_for_file(checkpoints / f"rank-{rank}.txt", timeout_s=30).splitlines()
        assert saved.startswith("saved at step ") and saved.endswith("on signal 15"), saved
        assert Path(cwd).name.startswith("_ray_pkg_"), "the script runs in the job's code directory (--code)"
