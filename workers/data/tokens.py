"""Token files: flat arrays of token ids (the nanoGPT/torchtitan format), memory-mapped and cut into windows.

Sample i of a file of N tokens is the window tokens[i·L : i·L+L+1] as (inputs, targets), for i < (N - 1) // L:
windows share only their boundary token, so every token is a target once and a sample id names fixed tokens.
A dataset pickles as its file's path (a DataLoader worker maps the file itself instead of receiving a copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ringmaster.workers.job_input import JobInputError

TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


def count_tokens(path: Path, dtype: str, name: str) -> int:
    """The file's token count; a size that is not a whole number of ``dtype`` ids is an error naming the file."""
    size = path.stat().st_size
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % itemsize:
        raise JobInputError(
            f"data file {name!r} holds {size} bytes, not a whole number of {dtype} token ids "
            f"({itemsize} bytes each): is data.dtype right?"
        )
    return size // itemsize


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows ``first .. first + count`` of a token file; ``vocab_size`` (when set) bounds every id read."""

    def __init__(
        self,
        path: Path,
        dtype: str,
        seq_len: int,
        *,
        name: str,
        first: int = 0,
        count: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.path, self.dtype, self.seq_len, self.name = path, dtype, seq_len, name
        self.vocab_size = vocab_size
        tokens = count_tokens(path, dtype, name)
        if tokens < seq_len + 1:
            raise JobInputError(
                f"data file {name!r} holds {tokens} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}"
            )
        available = (tokens - 1) // seq_len
        self.first = first
        self.count = available - first if count is None else count
        if self.count < 1 or first + self.count > available:
            raise JobInputError(
                f"data file {name!r} holds {available} windows of seq_len + 1 = {seq_len + 1} "
                f"tokens; windows {first}..{first + self.count} do not fit in it"
            )
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r")
        start = (self.first + index) * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            raise JobInputError(
                f"data file {self.name!r}: window {self.first + index} holds token id {int(window.max())}, "
                f"outside the model's vocab of {self.vocab_size}"
            )
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


def token_file_splits(
    path: Path,
    val_path: Path | None,
    dtype: str,
    seq_len: int,
    val_fraction: float,
    *,
    name: str,
    val_name: str | None = None,
    vocab_size: int | None = None,
) -> tuple[TokenWindows, TokenWindows | None]:
    """Train and validation windows: the validation file's, or the last ``val_fraction`` of the file's windows."""
    if val_path is not None:
        return (
            TokenWindows(path, dtype, seq_len, name=name, vocab_size=vocab_size),
            TokenWindows(val_path, dtype, seq_len, name=val_name or str(val_path), vocab_size=vocab_size),
        )
    windows = len(TokenWindows(path, dtype, seq_len, name=name))
    held_out = int(windows * val_fraction)
    if val_fraction and not 1 <= held_out < windows:
        raise JobInputError(
            f"data.val_fraction {val_fraction} of the {windows} windows in {name!r} holds out "
            f"{held_out}: it must leave at least one window for each of training and validation"
        )
    train = TokenWindows(path, dtype, seq_len, name=name, count=windows - held_out, vocab_size=vocab_size)
    validation = (
        TokenWindows(path, dtype, seq_len, name=name, first=windows - held_out, count=held_out, vocab_size=vocab_size)
        if held_out
        else None
    )
    return train, validation
