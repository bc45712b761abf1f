"""A Hugging Face ``datasets`` directory (save_to_disk) as token windows.

One column's rows are packed, in row order, into one stream of tokens: a column of token-id lists as its ids, a
column of strings as UTF-8 bytes (vocab 256) with a newline between rows, as the built-in pysource corpus joins its
files; null rows are skipped. The stream is written once per node into the data cache as a token file
(workers/data/node_cache.py) and then read exactly like one (workers/data/tokens.py), so the windows, the sample
ids and the exactly-once order work the same. ``datasets`` is optional: ``pip install 'ringmaster[hf]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ringmaster.service.spec import HFDatasetData
from ringmaster.workers.data.node_cache import cache_key, made_once
from ringmaster.workers.data.tokens import TokenWindows, token_file_splits
from ringmaster.workers.job_input import JobInputError

DEFAULT_SPLIT = "train"


def hf_dataset_splits(data: HFDatasetData, vocab_size: int | None) -> tuple[TokenWindows, TokenWindows | None]:
    """Train and validation windows of the column: the val_split's, or the last val_fraction of the train split's."""
    assert data.seq_len is not None  # JobSpec sets it
    loaded = _load(data.path)
    train = _split(loaded, data, (data.split or DEFAULT_SPLIT) if _is_dict(loaded) else None)
    train_file, dtype = _packed(train, data)
    name = _describe(data, data.split)
    if data.val_split is None:
        return token_file_splits(
            train_file, None, dtype, data.seq_len, data.val_fraction, name=name, vocab_size=vocab_size
        )
    validation_file, _ = _packed(_split(loaded, data, data.val_split), data)
    return token_file_splits(
        train_file,
        validation_file,
        dtype,
        data.seq_len,
        0.0,
        name=name,
        val_name=_describe(data, data.val_split),
        vocab_size=vocab_size,
    )


def _load(path: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise JobInputError(
            "data kind 'hf_dataset' needs the datasets package on the workers: pip install 'ringmaster[hf]'"
        ) from None
    if "://" not in path and not Path(path).is_dir():
        raise JobInputError(f"data.path {path!r} is not a directory on this node (a datasets save_to_disk directory)")
    try:
        return datasets.load_from_disk(path)
    except FileNotFoundError as error:
        raise JobInputError(f"data.path {path!r} is not a datasets save_to_disk directory: {error}") from None


def _is_dict(loaded: Any) -> bool:
    return hasattr(loaded, "keys")  # a DatasetDict; a Dataset has no splits


def _split(loaded: Any, data: HFDatasetData, split: str | None) -> Any:
    if split is None:
        if data.split is not None or data.val_split is not None:
            raise JobInputError(
                f"data.path {data.path!r} holds a single Dataset, not a DatasetDict: leave data.split and "
                f"data.val_split unset (data.val_fraction holds out a validation set)"
            )
        dataset = loaded
    elif split not in loaded:
        raise JobInputError(f"data.path {data.path!r} has no split {split!r}; its splits are {sorted(loaded.keys())}")
    else:
        dataset = loaded[split]
    if data.column not in dataset.column_names:
        raise JobInputError(
            f"data.column {data.column!r} is not a column of {data.path!r}"
            f"{f' split {split!r}' if split else ''}; its columns are {dataset.column_names}"
        )
    return dataset


def _describe(data: HFDatasetData, split: str | None) -> str:
    return f"{data.path} column {data.column!r}" + (f" split {split!r}" if split else "")


def _packed(dataset: Any, data: HFDatasetData) -> tuple[Path, str]:
    """The column packed into a token file in the node's cache (uint8 bytes for strings, uint32 ids for lists)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")[data.column]  # a pyarrow ChunkedArray, in row order
    value_type = column.type
    if pa.types.is_string(value_type) or pa.types.is_large_string(value_type):
        dtype = "uint8"
    elif (pa.types.is_list(value_type) or pa.types.is_large_list(value_type)) and pa.types.is_integer(
        value_type.value_type
    ):
        dtype = "uint32"
    else:
        raise JobInputError(
            f"data.column {data.column!r} of {data.path!r} holds {value_type}; it must hold strings or "
            f"lists of integer token ids"
        )
    # What the rows were read from: the dataset's fingerprint and its arrow files as they are now.
    files = [(entry["filename"], *_stat(entry["filename"])) for entry in dataset.cache_files]
    name = f"{cache_key(os.path.abspath(data.path), data.column, dataset._fingerprint, files)}-packed.{dtype}"

    def write(out: BinaryIO) -> None:
        first = True
        for chunk in column.chunks:
            chunk = chunk.drop_null()
            if len(chunk) == 0:
                continue
            if dtype == "uint8":
                joined = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, len(chunk)], pa.int32()), chunk), "\n")
                out.write((b"" if first else b"\n") + joined[0].as_buffer().to_pybytes())
            else:
                ids = pc.list_flatten(chunk).to_numpy(zero_copy_only=False)
                if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.uint32).max):
                    raise JobInputError(
                        f"data.column {data.column!r} of {data.path!r} holds token id "
                        f"{ids.min() if ids.min() < 0 else ids.max()}, outside 0..{np.iinfo(np.uint32).max}"
                    )
                ids.astype(np.uint32).tofile(out)
            first = False

    path, _ = made_once(name, write)
    return path, dtype


def _stat(filename: str) -> tuple[int, int]:
    status = os.stat(filename)
    return status.st_size, status.st_mtime_ns
