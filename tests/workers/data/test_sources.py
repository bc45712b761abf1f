"""Data sources that are not a toy: token files (local, or fetched once per node from a remote URI) and Hugging Face
datasets directories, cut into exact windows with a validation split, read by DataLoader workers without changing
the exactly-once, resumable sample order; bad input is a 422 at submit or a clear error on the workers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import fsspec
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch.utils.data import DataLoader

from harness.process_group import run_on_ranks
from ringmaster.api.app import create_app
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec, TokensData
from ringmaster.workers.data.hf_dataset import hf_dataset_splits
from ringmaster.workers.data.node_cache import CACHE_ENV, node_local_file
from ringmaster.workers.data.sources import data_source_splits
from ringmaster.workers.data.stream import DataPosition, GlobalBatchStream
from ringmaster.workers.data.tokens import TokenWindows
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models import EntrypointError, build_bundle
from tests.cluster.test_checkpoint_storage import BUCKET, s3_endpoint  # noqa: F401 (a fixture: a moto S3 server)
from tests.support.api_tokens import authorize, table_rows
from tests.support.data_source_ranks import STOP_AFTER, fetch_on_rank, train_on_ranks

# Learnable, deterministic text: ringmaster's own model source, as byte tokens.
TEXT = (Path(__file__).resolve().parents[3] / "workers" / "models" / "tiny_gpt.py").read_bytes()


@pytest.fixture(autouse=True)
def node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private data cache per test (ranks spawned by the test inherit it)."""
    directory = tmp_path / "node-cache"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    return directory


def _token_file(path: Path, tokens: np.ndarray, dtype: str = "uint16") -> Path:
    tokens.astype(dtype).tofile(path)
    return path


def _tokens_spec(path: Path | str, **data: Any) -> TokensData:
    return TokensData.model_validate({"kind": "tokens", "path": str(path), **data})


# --- token files ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_hold_exactly_the_files_tokens(tmp_path: Path, dtype: str) -> None:
    high = 65_535 if dtype == "uint16" else 4_000_000_000
    tokens = (np.arange(1001, dtype=np.int64) * 7_919) % high
    path = _token_file(tmp_path / "train.bin", tokens, dtype)

    train, validation = data_source_splits(_tokens_spec(path, dtype=dtype, seq_len=8))

    assert validation is None and len(train) == (1001 - 1) // 8 == 125
    for index in (0, 1, 61, 124):
        inputs, targets = train[index]
        assert inputs.dtype == targets.dtype == torch.long
        assert inputs.tolist() == tokens[index * 8 : index * 8 + 8].tolist()
        assert targets.tolist() == tokens[index * 8 + 1 : index * 8 + 9].tolist()
    assert train[124][1][-1].item() == tokens[1000]


def test_token_file_size_that_does_not_match_the_dtype_names_the_file_its_size_and_the_dtype(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(1001))

    with pytest.raises(ValueError) as raised:
        data_source_splits(_tokens_spec(path, dtype="uint16", seq_len=8))

    assert str(path) in str(raised.value) and "1001 bytes" in str(raised.value) and "uint16" in str(raised.value)


def test_missing_token_file_names_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "train.bin"
    spec = JobSpec(name="missing", model="tiny-gpt", data={"kind": "tokens", "path": str(missing)})

    with pytest.raises(JobInputError, match=f"data file '{missing}' does not exist on this node"):
        build_bundle(spec)


def test_validation_split_is_the_last_windows_or_a_file_of_its_own(tmp_path: Path) -> None:
    tokens = np.arange(401) % 256
    path = _token_file(tmp_path / "train.bin", tokens)

    train, validation = data_source_splits(_tokens_spec(path, seq_len=4, val_fraction=0.1))

    assert (len(train), len(validation)) == (90, 10)
    assert (
        validation[0][0].tolist() == tokens[360:364].tolist() and validation[9][1].tolist() == tokens[397:401].tolist()
    )
    assert train[89][1].tolist() == tokens[357:361].tolist()  # the last training window ends where validation starts

    val_tokens = (np.arange(41) * 3) % 256
    val_path = _token_file(tmp_path / "val.bin", val_tokens)
    train, validation = data_source_splits(_tokens_spec(path, seq_len=4, val_path=str(val_path)))
    assert (len(train), len(validation)) == (100, 10)
    assert validation[2][0].tolist() == val_tokens[8:12].tolist()

    with pytest.raises(ValueError, match="holds out 0"):
        data_source_splits(_tokens_spec(path, seq_len=4, val_fraction=0.005))


def test_token_id_outside_the_models_vocab_fails_naming_the_file_and_window(tmp_path: Path) -> None:
    tokens = np.arange(200) % 256
    tokens[150] = 300
    path = _token_file(tmp_path / "train.bin", tokens)
    bundle = build_bundle(
        JobSpec(
            name="vocab", model="tiny-gpt", model_options={"seq_len": 16}, data={"kind": "tokens", "path": str(path)}
        )
    )

    assert bundle.train_dataset[8][1][-1].item() == 144  # the window before reads fine
    with pytest.raises(JobInputError, match=f"'{path}': window 9 holds token id 300, outside the model's vocab of 256"):
        bundle.train_dataset[9]
    # Read by a DataLoader worker process (data.num_workers), it reaches the rank with that process's traceback before
    # it; the job's error is the reason alone.
    with pytest.raises(JobInputError) as raised:
        list(DataLoader(bundle.train_dataset, batch_size=4, num_workers=1))
    assert "Original Traceback" in str(raised.value)
    assert raised.value.reason == f"data file '{path}': window 9 holds token id 300, outside the model's vocab of 256"


def build_user_model(width: int = 8) -> tuple:
    """A user entrypoint without datasets of its own: with a data source, it trains on that."""
    return torch.nn.Embedding(256, width), None, lambda model, batch: model(batch[0]).mean()


def test_a_user_model_on_a_token_file_gets_its_windows(tmp_path: Path) -> None:
    path = _token_file(tmp_path / "train.bin", np.arange(1000) % 256)
    spec = JobSpec(
        name="user",
        model=f"{__name__}:build_user_model",
        data={"kind": "tokens", "path": str(path), "seq_len": 16, "val_fraction": 0.1},
    )

    bundle = build_bundle(spec)

    assert isinstance(bundle.train_dataset, TokenWindows) and (len(bundle.train_dataset), len(bundle.val_dataset)) == (
        56,
        6,
    )
    assert bundle.train_dataset.seq_len == 16 and bundle.train_dataset.vocab_size is None
    assert bundle.loss_fn(bundle.model, bundle.train_dataset[0]).ndim == 0


def build_llama_alone(context: int = 64) -> torch.nn.Module:
    """A user entrypoint as a Hugging Face user writes it: the model from its config, nothing else."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=200,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=context,
        )
    )


def build_embedding_alone() -> torch.nn.Module:
    return torch.nn.Embedding(256, 8)


def test_a_user_model_returned_alone_trains_on_the_data_sources_windows_with_the_next_token_loss(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "hf"
    datasets.Dataset.from_dict({"ids": [list(range(0, 150)), list(range(150, 190))]}).save_to_disk(str(directory))
    spec = JobSpec(
        name="alone",
        model=f"{__name__}:build_llama_alone",
        data={"kind": "hf_dataset", "path": str(directory), "column": "ids", "seq_len": 8, "val_fraction": 0.2},
    )

    bundle = build_bundle(spec)

    assert (len(bundle.train_dataset), len(bundle.val_dataset)) == (19, 4)
    assert bundle.train_dataset.vocab_size == 200, "token ids are bounded by the model's own vocab"
    inputs, targets = (torch.stack(pair) for pair in zip(*(bundle.train_dataset[i] for i in range(3))))
    by_hand = torch.nn.functional.cross_entropy(
        bundle.model(input_ids=inputs).logits.reshape(-1, 200), targets.reshape(-1)
    )
    assert torch.equal(bundle.loss_fn(bundle.model, (inputs, targets)), by_hand)
    assert bundle.tensor_parallel is not None and bundle.pipeline_stage is not None, "the transformers hooks as for hf:"


@pytest.mark.parametrize(
    ("entrypoint", "fields", "message"),
    [
        (
            "build_embedding_alone",
            {},
            "model entrypoint '{module}:build_embedding_alone' (defined at {here}:{line}) returned a Embedding alone, "
            "and with data 'user' it must also return its datasets and loss",
        ),
        (
            "build_embedding_alone",
            {"data": "synthetic"},
            "with data 'synthetic' it must also return its datasets and loss",
        ),
        (
            "build_llama_alone",
            {"data": {"kind": "tokens", "path": "{path}", "seq_len": 100}},
            "data.seq_len (100) exceeds the context length of model '{module}:build_llama_alone': its config's "
            "max_position_embeddings is 64",
        ),
    ],
)
def test_a_model_alone_where_it_cannot_train_is_a_clear_error(
    tmp_path: Path, entrypoint: str, fields: dict, message: str
) -> None:
    path = _token_file(tmp_path / "train.bin", np.arange(1000) % 200)
    fields = json.loads(json.dumps(fields).replace("{path}", str(path)))
    with pytest.raises(EntrypointError) as raised:
        build_bundle(JobSpec(name="alone", model=f"{__name__}:{entrypoint}", **fields))

    line = build_embedding_alone.__code__.co_firstlineno
    assert message.format(module=__name__, here=os.path.relpath(__file__), line=line) in str(raised.value)


def test_token_windows_pickle_as_their_path_not_their_tokens(tmp_path: Path) -> None:
    import pickle

    path = _token_file(tmp_path / "train.bin", np.arange(100_001) % 256)
    windows = TokenWindows(path, "uint16", 10, name=str(path))
    windows[0]  # maps the file

    copy = pickle.loads(pickle.dumps(windows))
    assert len(pickle.dumps(windows)) < 1000
    assert copy[9_999][1].tolist() == windows[9_999][1].tolist()


# --- remote token files: fetched once per node -------------------------------------------------------------------


def test_remote_token_file_is_fetched_once_into_the_cache_and_again_when_it_changes(node_cache: Path) -> None:
    filesystem = fsspec.filesystem("memory")
    uri = "memory://corpus/train.bin"
    filesystem.pipe(uri, (np.arange(65) % 256).astype(np.uint16).tobytes())

    first, fetched = node_local_file(uri)
    again, fetched_again = node_local_file(uri)
    assert (fetched, fetched_again, first) == (True, False, again)
    assert first.parent == node_cache and np.fromfile(first, np.uint16).tolist() == (np.arange(65) % 256).tolist()

    filesystem.pipe(uri, (np.arange(129) % 256).astype(np.uint16).tobytes())
    changed, fetched_changed = node_local_file(uri)
    assert fetched_changed and changed != first and len(np.fromfile(changed, np.uint16)) == 129
    with pytest.raises(JobInputError, match=r"data file 'memory://corpus/absent.bin' does not exist"):
        node_local_file("memory://corpus/absent.bin")
    filesystem.rm("/corpus", recursive=True)


def test_two_ranks_on_a_node_fetch_an_s3_token_file_once(s3_endpoint: str, tmp_path: Path) -> None:  # noqa: F811
    tokens = np.arange(4097) % 256
    uri = f"s3://{BUCKET}/corpus/train.bin"
    fsspec.filesystem("s3", skip_instance_cache=True).pipe(uri, tokens.astype(np.uint16).tobytes())

    run_on_ranks(fetch_on_rank, 2, uri, str(tmp_path))

    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert sorted(rank["fetched"] for rank in ranks) == [False, True], "exactly one rank of the node downloads"
    assert ranks[0]["path"] == ranks[1]["path"]
    assert ranks[0]["last"] == ranks[1]["last"] == tokens[4081:4097].tolist()
    assert [p.name for p in Path(ranks[0]["path"]).parent.iterdir() if ".partial-" in p.name] == []


# --- Hugging Face datasets directories ---------------------------------------------------------------------------


def _hf_data(path: Path, **fields: Any):
    from ringmaster.service.spec import HFDatasetData

    return HFDatasetData.model_validate({"kind": "hf_dataset", "path": str(path), **fields})


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    rows = {"text": ["def f():", None, "    return 1", "é"], "ids": [[1, 2, 3], [4], [], [5, 6, 7, 8, 9]]}
    directory = tmp_path / "hf"
    datasets.Dataset.from_dict(rows).save_to_disk(str(directory))
    return directory


def test_string_column_is_packed_as_utf8_bytes_joined_by_newlines(hf_dir: Path) -> None:
    train, validation = hf_dataset_splits(_hf_data(hf_dir, column="text", seq_len=4), vocab_size=256)

    packed = list("def f():\n    return 1\né".encode())
    assert validation is None and len(train) == (len(packed) - 1) // 4
    assert [train[i][0].tolist() for i in range(len(train))] == [packed[i * 4 : i * 4 + 4] for i in range(len(train))]
    assert train[len(train) - 1][1].tolist() == packed[(len(train) - 1) * 4 + 1 : len(train) * 4 + 1]


def test_token_list_column_is_packed_id_after_id(hf_dir: Path) -> None:
    train, _ = hf_dataset_splits(_hf_data(hf_dir, column="ids", seq_len=2), vocab_size=None)

    assert [(train[i][0].tolist(), train[i][1].tolist()) for i in range(len(train))] == [
        ([1, 2], [2, 3]),
        ([3, 4], [4, 5]),
        ([5, 6], [6, 7]),
        ([7, 8], [8, 9]),
    ]


def test_missing_column_names_it_and_the_columns_there_are(hf_dir: Path) -> None:
    with pytest.raises(ValueError) as raised:
        hf_dataset_splits(_hf_data(hf_dir, column="content", seq_len=2), vocab_size=None)

    assert "data.column 'content' is not a column of" in str(raised.value) and "['text', 'ids']" in str(raised.value)


def test_dataset_dict_trains_on_its_split_and_validates_on_another(tmp_path: Path) -> None:
    directory = tmp_path / "dict"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"ids": [list(range(0, 50)), list(range(50, 81))]}),
            "validation": datasets.Dataset.from_dict({"ids": [list(range(100, 121))]}),
        }
    ).save_to_disk(str(directory))

    train, validation = hf_dataset_splits(
        _hf_data(directory, column="ids", seq_len=10, val_split="validation"), vocab_size=None
    )
    assert (len(train), len(validation)) == (8, 2)
    assert train[7][1].tolist() == list(range(71, 81)) and validation[1][0].tolist() == list(range(110, 120))

    train, validation = hf_dataset_splits(
        _hf_data(directory, column="ids", seq_len=10, val_fraction=0.25), vocab_size=None
    )
    assert (len(train), len(validation)) == (6, 2) and validation[0][0].tolist() == list(range(60, 70))

    with pytest.raises(ValueError, match=r"has no split 'test'; its splits are \['train', 'validation'\]"):
        hf_dataset_splits(_hf_data(directory, column="ids", seq_len=10, split="test"), vocab_size=None)


def test_hf_dataset_that_is_missing_or_of_the_wrong_shape_is_a_clear_error(tmp_path: Path, hf_dir: Path) -> None:
    with pytest.raises(JobInputError, match=f"data.path '{tmp_path / 'absent'}' is not a directory on this node"):
        hf_dataset_splits(_hf_data(tmp_path / "absent", column="text", seq_len=4), vocab_size=None)
    with pytest.raises(ValueError, match=r"holds a single Dataset, not a DatasetDict: leave data.split"):
        hf_dataset_splits(_hf_data(hf_dir, column="text", seq_len=4, split="train"), vocab_size=None)
    numbers = tmp_path / "numbers"
    datasets.Dataset.from_dict({"score": [1.5, 2.5]}).save_to_disk(str(numbers))
    with pytest.raises(ValueError, match="holds double; it must hold strings or lists of integer token ids"):
        hf_dataset_splits(_hf_data(numbers, column="score", seq_len=4), vocab_size=None)


def test_hf_packing_is_written_once_per_node(hf_dir: Path, node_cache: Path) -> None:
    data = _hf_data(hf_dir, column="ids", seq_len=2)
    first, _ = hf_dataset_splits(data, vocab_size=None)
    written = {path: path.stat().st_mtime_ns for path in node_cache.iterdir() if path.name.endswith(".uint32")}

    second, _ = hf_dataset_splits(data, vocab_size=None)

    assert len(written) == 1 and first.path == second.path in written
    assert {path: path.stat().st_mtime_ns for path in node_cache.iterdir() if path.name.endswith(".uint32")} == written


# --- the exactly-once order with DataLoader workers -------------------------------------------------------------


_START = DataPosition()  # the stream copies the position it is given, so one shared default is never moved


def _stream(
    dataset: TokenWindows, dp_rank: int, num_workers: int, position: DataPosition = _START
) -> GlobalBatchStream:
    return GlobalBatchStream(
        dataset,
        micro_batch_size=3,
        dp_rank=dp_rank,
        dp_size=2,
        seed=5,
        global_batch_size=12,
        position=position,
        num_workers=num_workers,
    )


def _draw(stream: GlobalBatchStream, count: int) -> list[tuple[int, list[int], list[list[int]]]]:
    drawn = []
    for _ in range(count):
        inputs, _ = stream.next_batch()
        drawn.append((stream.position.epoch, stream.last_sample_ids, inputs.tolist()))
    return drawn


def test_dataloader_workers_keep_the_exactly_once_order_of_two_ranks(tmp_path: Path) -> None:
    path = _token_file(tmp_path / "train.bin", np.arange(50 * 4 + 1) % 256)
    dataset = TokenWindows(path, "uint16", 4, name=str(path))  # 50 windows: an epoch uses 48, 8 micro-steps per rank
    micro_steps = 20  # two and a half epochs

    by_workers = {}
    for num_workers in (0, 2):
        streams = [_stream(dataset, rank, num_workers) for rank in range(2)]
        by_workers[num_workers] = [_draw(stream, micro_steps) for stream in streams]
        for stream in streams:
            stream.close()

    assert by_workers[0] == by_workers[2]
    for epoch in (0, 1):
        used = [i for rank in by_workers[2] for (e, ids, _) in rank if e == epoch for i in ids]
        assert len(used) == len(set(used)) == 48, f"epoch {epoch}: every sample once, 48 of 50 (whole global batches)"
    first_rank = by_workers[2][0]
    assert all(inputs == [dataset[i][0].tolist() for i in ids] for _, ids, inputs in first_rank)


def test_a_stream_resumed_mid_epoch_with_workers_continues_with_the_same_samples(tmp_path: Path) -> None:
    path = _token_file(tmp_path / "train.bin", np.arange(50 * 4 + 1) % 256)
    dataset = TokenWindows(path, "uint16", 4, name=str(path))
    straight = _stream(dataset, 1, 0)
    _draw(straight, 5)
    position = DataPosition(straight.position.epoch, straight.position.samples_in_epoch)
    assert position == DataPosition(0, 30)

    resumed = _stream(dataset, 1, 2, position)
    assert _draw(resumed, 9) == _draw(straight, 9)
    assert resumed.position == straight.position == DataPosition(1, 36)
    resumed.close()


# --- training on a token file ------------------------------------------------------------------------------------


def test_tiny_gpt_trains_on_a_token_file_over_two_ranks_the_same_with_dataloader_workers(tmp_path: Path) -> None:
    path = _token_file(tmp_path / "text.bin", np.frombuffer(TEXT, dtype=np.uint8))

    run_on_ranks(train_on_ranks, 2, str(path), str(tmp_path))

    runs = json.loads((tmp_path / "runs.json").read_text())
    losses = runs["in-process"]["losses"]
    assert len(losses) == 8 and runs["workers"]["losses"] == losses, "DataLoader workers change nothing, to the bit"
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, f"the loss falls: {losses}"
    assert np.isfinite(runs["in-process"]["val_loss"]) and runs["workers"]["val_loss"] == runs["in-process"]["val_loss"]
    assert runs["resumed"]["stopped_at"] == STOP_AFTER and runs["resumed"]["losses"] == losses[STOP_AFTER:]


# --- bad input at submit -----------------------------------------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'ringmaster.db'}", data_dir=tmp_path)
    with TestClient(create_app(settings)) as test_client:
        authorize(test_client)
        yield test_client


TOKENS = {"kind": "tokens", "path": "s3://corpora/train.bin"}


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"data": {**TOKENS, "seq_len": 65}},
            "data.seq_len",
            "data.seq_len (65) exceeds model 'tiny-gpt''s model_options.seq_len (64)",
        ),
        (
            {"data": {**TOKENS, "seq_len": 129}, "model_options": {"seq_len": 128}},
            "data.seq_len",
            "model_options.seq_len (128)",
        ),
        ({"data": {**TOKENS, "dtype": "int8"}}, "data.tokens.dtype", "'uint16' or 'uint32'"),
        ({"data": {**TOKENS, "val_fraction": 1.0}}, "data.tokens.val_fraction", "less than 1"),
        ({"data": {**TOKENS, "num_workers": 65}}, "data.tokens.num_workers", "less than or equal to 64"),
        ({"data": {**TOKENS, "seq_len": 0}}, "data.tokens.seq_len", "greater than or equal to 1"),
        (
            {"data": {**TOKENS, "val_fraction": 0.1, "val_path": "/data/val.bin"}},
            "data.tokens.val_fraction",
            "not both",
        ),
        ({"data": {"kind": "parquet", "path": "/data"}}, "data", "a mapping whose kind is 'tokens' or 'hf_dataset'"),
        ({"data": {"kind": "hf_dataset", "path": "/data/hf"}}, "data.hf_dataset.column", "Field required"),
        ({"data": TOKENS, "model": "mlp"}, "data", "model 'mlp' trains on 'synthetic' only"),
        ({"data": TOKENS, "model": "my_pkg.models:build"}, "data.seq_len", "data.seq_len must be set"),
        (
            {"data": TOKENS, "train": {"eval_every_steps": 5}},
            "train.eval_every_steps",
            "train.eval_every_steps needs a validation set",
        ),
        ({"data": "pysource", "model": "mlp"}, "data", "trains on 'synthetic' or a token data source, got 'pysource'"),
        (
            {
                "data": {**TOKENS, "seq_len": 4096},
                "model": "hf:LlamaForCausalLM",
                "model_options": {"max_position_embeddings": 128},
            },
            "data.seq_len",
            "data.seq_len (4096) exceeds the context length of model 'hf:LlamaForCausalLM': "
            "model_options.max_position_embeddings is 128",
        ),
        (
            {
                "data": {**TOKENS, "seq_len": 1025},
                "model": "hf:GPT2LMHeadModel",
            },  # GPT-2's context length is n_positions
            "data.seq_len",
            "GPT2Config's default n_positions is 1024",
        ),
        (
            {
                "data": {**TOKENS, "seq_len": 129},
                "model": "hf:LlamaForCausalLM",
                "model_options": {"max_position_embeddings": 128.0},
            },
            "data.seq_len",
            "model_options.max_position_embeddings is 128",
        ),  # a JSON number written 128.0 is the same length
        (
            {
                "model": "hf:GPT2LMHeadModel",
                "model_options": {"n_positions": 32},
            },  # the built-in corpus's windows are 64
            "model_options.seq_len",
            "model_options.seq_len (64) exceeds the context length of model 'hf:GPT2LMHeadModel': "
            "model_options.n_positions is 32",
        ),
    ],
)
def test_bad_data_is_a_422_naming_what_is_wrong_and_writes_nothing(
    api: TestClient, fields: dict, field: str, message: str
) -> None:
    before = table_rows(api.app)
    response = api.post("/v1/jobs", json={"name": "bad-data", "model": "tiny-gpt", **fields})

    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["field"] == field and message in error["msg"], error
    assert table_rows(api.app) == before


def test_a_token_job_is_accepted_with_its_seq_len_from_the_model(api: TestClient) -> None:
    text = "name: tokens\nmodel: tiny-gpt\nmodel_options: {seq_len: 128}\ndata: {kind: tokens, path: s3://corpora/train.bin}\n"

    response = api.post("/v1/jobs", content=text, headers={"Content-Type": "application/yaml"})

    assert response.status_code == 201, response.text
    assert response.json()["spec"]["data"] == {
        "kind": "tokens",
        "path": "s3://corpora/train.bin",
        "dtype": "uint16",
        "seq_len": 128,
        "val_path": None,
        "val_fraction": 0.0,
        "num_workers": 0,
    }
    stored = JobSpec.model_validate(response.json()["spec"])
    assert stored.spec_hash() == JobSpec.model_validate(stored.model_dump(mode="json")).spec_hash()
