"""A JobSpec data source (data: {kind: tokens | hf_dataset, …}) as the train and validation datasets of a job."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from ringmaster.service.spec import DataSourceSpec, HFDatasetData, TokensData
from ringmaster.workers.data.hf_dataset import hf_dataset_splits
from ringmaster.workers.data.node_cache import node_local_file
from ringmaster.workers.data.tokens import token_file_splits


def data_source_splits(data: DataSourceSpec, vocab_size: int | None = None) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """Train and validation (None: no validation split) windows of (inputs, targets); ``vocab_size`` bounds every
    token id read (a clear error instead of an embedding's index error)."""
    assert data.seq_len is not None  # JobSpec sets it from the model or asks for it
    if isinstance(data, TokensData):
        train_file, _ = node_local_file(data.path)
        val_file = node_local_file(data.val_path, "data.val_path")[0] if data.val_path is not None else None
        return token_file_splits(
            train_file,
            val_file,
            data.dtype,
            data.seq_len,
            data.val_fraction,
            name=data.path,
            val_name=data.val_path,
            vocab_size=vocab_size,
        )
    if isinstance(data, HFDatasetData):
        return hf_dataset_splits(data, vocab_size)
    raise TypeError(f"not a data source: {data!r}")
