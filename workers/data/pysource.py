"""The built-in corpus: the Python standard library's own source, as bytes (vocab 256).

Present on every worker without a download, deterministic for a given interpreter, and split into
train/validation by file so no validation text leaks into training.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ringmaster.service.catalogue import CORPUS_SEQ_LEN
from ringmaster.workers.job_input import JobInputError

DEFAULT_MAX_CORPUS_BYTES = 4 * 1024 * 1024
VALIDATION_PERCENT = 5
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_source_files() -> list[str]:
    """Relative paths of the stdlib's .py files outside test and third-party folders, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_DIRS]
        relative_folder = os.path.relpath(folder, root)
        found.extend(os.path.normpath(os.path.join(relative_folder, name)) for name in files if name.endswith(".py"))
    return sorted(Path(path).as_posix() for path in found)


def is_validation_file(relative_path: str) -> bool:
    """A stable hash of the path (not Python's salted hash()) decides, so every process agrees."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < VALIDATION_PERCENT


@lru_cache(maxsize=4)
def stdlib_corpus(max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 token tensors; cached because every step's samples slice them.

    Training takes whole files in sorted order until ``max_corpus_bytes``; validation likewise up
    to its 5% share, so both splits are non-empty even under a small cap.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    validation_cap = max(1, max_corpus_bytes * VALIDATION_PERCENT // (100 - VALIDATION_PERCENT))
    train_files: list[bytes] = []
    validation_files: list[bytes] = []
    train_bytes = validation_bytes = 0
    for relative_path in stdlib_source_files():
        if train_bytes >= max_corpus_bytes and validation_bytes >= validation_cap:
            break
        if is_validation_file(relative_path):
            if validation_bytes < validation_cap:
                validation_files.append((root / relative_path).read_bytes())
                validation_bytes += len(validation_files[-1])
        elif train_bytes < max_corpus_bytes:
            train_files.append((root / relative_path).read_bytes())
            train_bytes += len(train_files[-1])
    train, validation = (
        torch.frombuffer(bytearray(b"\n".join(files)), dtype=torch.uint8) for files in (train_files, validation_files)
    )
    return train, validation


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is (tokens[i·L : i·L+L], tokens[i·L+1 : i·L+L+1]): windows of L+1 bytes that share
    only their boundary byte, so every byte is a target once and a sample id names fixed text."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if len(tokens) < seq_len + 1:
            raise JobInputError(
                f"corpus of {len(tokens)} bytes is shorter than one window of seq_len + 1 = {seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


def pysource_splits(
    seq_len: int = CORPUS_SEQ_LEN, max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES
) -> tuple[ByteWindows, ByteWindows]:
    """Train and validation window datasets over the stdlib corpus."""
    train, validation = stdlib_corpus(max_corpus_bytes)
    return ByteWindows(train, seq_len), ByteWindows(validation, seq_len)
