"""Data sources through the real job path (REST → queue → Ray job → workers): tiny-gpt trains on a token file read by
DataLoader workers, and a data source the workers cannot read fails the job once with the reason."""

from __future__ import annotations

import math
import re
from pathlib import Path

import datasets
import numpy as np
import pytest

from harness.local_control_plane import wait_for_state
from ringmaster.service.client import RingmasterClient

pytestmark = pytest.mark.integration

STEPS = 4
TEXT = (Path(__file__).resolve().parents[2] / "workers" / "models" / "tiny_gpt.py").read_bytes()


def _spec(name: str, data: dict) -> dict:
    return {
        "name": name,
        "model": "tiny-gpt",
        "model_options": {"n_layers": 1, "dim": 32, "n_heads": 2, "seq_len": 32},
        "data": data,
        "workers": {"min": 2, "max": 2},
        "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 0.01},
        "max_failures": 3,
    }


@pytest.fixture(scope="module")
def submitted(ray_server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("data")
    tokens = folder / "text.bin"
    np.frombuffer(TEXT, dtype=np.uint8).astype(np.uint16).tofile(tokens)
    odd = folder / "odd.bin"
    odd.write_bytes(tokens.read_bytes() + b"\0")  # half a uint16 token id at the end
    hf = folder / "hf"
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(hf))
    client = ray_server.client()
    specs = {
        "tokens": _spec("tokens", {"kind": "tokens", "path": str(tokens), "val_fraction": 0.05, "num_workers": 1}),
        "missing": _spec("missing-tokens", {"kind": "tokens", "path": str(folder / "absent.bin")}),
        "odd-size": _spec("odd-size", {"kind": "tokens", "path": str(odd), "dtype": "uint16"}),
        "no-column": _spec("no-column", {"kind": "hf_dataset", "path": str(hf), "column": "content"}),
    }
    return {name: client.submit(spec)["id"] for name, spec in specs.items()}


def test_tiny_gpt_trains_on_a_token_file_with_dataloader_workers(
    submitted: dict[str, str], client: RingmasterClient
) -> None:
    done = wait_for_state(client, submitted["tokens"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["error"]

    rows = client.metrics(submitted["tokens"])["items"]
    assert [row["step"] for row in rows if row["loss"] is not None] == list(range(1, STEPS + 1))
    assert all(row["world_size"] == 2 for row in rows) and math.isfinite(rows[-1]["val_loss"])


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("missing", r"data\.path: data file '\S+/absent\.bin' does not exist on this node"),
        (
            "odd-size",
            r"data file '\S+/odd\.bin' holds \d+ bytes, not a whole number of uint16 token ids \(2 bytes each\): "
            r"is data\.dtype right\?",
        ),
        ("no-column", r"data\.column 'content' is not a column of '\S+/hf'; its columns are \['text'\]"),
    ],
)
def test_a_data_source_the_workers_cannot_read_fails_the_job_once_with_the_reason_alone(
    name: str, reason: str, submitted: dict[str, str], client: RingmasterClient
) -> None:
    done = wait_for_state(client, submitted[name], {"SUCCEEDED", "FAILED", "CANCELLED"})

    assert done["state"] == "FAILED" and done["attempt"] == 1
    # The reason is the whole error: the spec's input is at fault, and a traceback through ringmaster says no more.
    assert re.fullmatch(reason, done["error"]), done["error"]
