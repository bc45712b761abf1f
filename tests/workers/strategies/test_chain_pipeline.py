"""A plain model with no pipeline hook, written as common GPT code is (tok + pos embeddings, ``b, t = idx.size()``,
blocks in ``transformer.h``, an lm_head tied to wte), is split automatically: its pipeline losses equal one process's
and the tied weight stays equal on both stages; a forward that is not the chain fails in one line asking for a hook."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.data.pysource import pysource_splits
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import ModelBundle, next_token_loss
from ringmaster.workers.strategies import pipeline
from ringmaster.workers.strategies.chain_stages import chain_pipeline_stage
from ringmaster.workers.trainer import TrainContext, run_training

DIM, HEADS, LAYERS, SEQ_LEN, VOCAB = 32, 4, 4, 16, 256
SCHEDULES = ["1f1b", "gpipe"]
CORPUS_BYTES = 8_192
TIED = ("transformer.wte.weight", "lm_head.weight")


class _CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (part.view(b, t, HEADS, c // HEADS).transpose(1, 2) for part in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(DIM), _CausalSelfAttention(), nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, DIM),
                "wpe": nn.Embedding(SEQ_LEN, DIM),
                "drop": nn.Dropout(0.0),
                "h": nn.ModuleDict({str(index): _Block() for index in range(LAYERS)}),
                "ln_f": nn.LayerNorm(DIM),
            }
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        b, t = idx.size()  # noqa: RUF059 (as nanoGPT writes it: a shape a pipeline stage must not break)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class LongSkipGPT(NanoGPT):
    """Adds the embeddings again after the blocks: not the chain embeddings → blocks → norm → head."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        embedded = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        x = embedded
        for block in self.transformer.h.values():
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x + embedded)), None


def nano_gpt() -> ModelBundle:
    """The job's model entrypoint: the model with the next-token loss of its logits, and no validation set (whose
    evaluation would take most of the test's time)."""
    train, _ = pysource_splits(seq_len=SEQ_LEN, max_corpus_bytes=CORPUS_BYTES)
    return ModelBundle(NanoGPT(), train, None, next_token_loss)


def _spec(strategy: str, workers: int, micro_batch_size: int, **parallel: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": f"chain-{strategy}-{parallel.get('schedule', 'single')}",
            "model": f"{__name__}:nano_gpt",
            "data": "user",
            "strategy": strategy,
            "parallel": parallel,
            "workers": {"min": workers, "max": workers, "cpus_per_worker": 1},
            "train": {"steps": 3, "global_batch_size": 8, "micro_batch_size": micro_batch_size, "lr": 3e-3, "seed": 5},
            "checkpoint": {"every_steps": 0, "keep": 1},
        }
    )


def _train(spec: JobSpec, rank: int, world_size: int, root: str) -> list[float]:
    points: list[Any] = []
    context = TrainContext(
        rank,
        world_size,
        torch.device("cpu"),
        spec.name,
        f"{root}/{spec.name}",
        sink=CallbackSink(on_metric=points.append),
    )
    run_training(spec, context)
    return [point.loss for point in points if point.loss is not None]


def _pipeline_runs(rank: int, world_size: int, root: str) -> None:
    """Each schedule in turn in one pair of processes: the losses, and the tied weight as each stage holds it."""
    stages: list[nn.Module] = []
    split = pipeline.chain_pipeline_stage

    def recording_split(bundle: ModelBundle, num_stages: int) -> Any:
        stage_fn = split(bundle, num_stages)
        return lambda model, index, total: stages.append(stage_fn(model, index, total)) or stages[-1]

    pipeline.chain_pipeline_stage = recording_split
    results = {}
    for schedule in SCHEDULES:
        stages.clear()
        losses = _train(
            _spec("pipeline", world_size, 2, pp=world_size, microbatches=4, schedule=schedule), rank, world_size, root
        )
        held = {name: parameter.detach().clone() for name, parameter in stages[0].named_parameters()}
        results[schedule] = (losses, {name: held[name] for name in TIED if name in held}, sorted(held))
    torch.save(results, f"{root}/rank{rank}.pt")


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("chain")
    run_on_ranks(_pipeline_runs, 2, str(root))
    return [torch.load(root / f"rank{rank}.pt") for rank in range(2)]


def test_a_plain_gpt_pipelines_without_a_hook_as_one_process_trains_it(
    pipeline_results: list[dict[str, Any]], single_rank_group: None, tmp_path: Path
) -> None:
    single_process = _train(_spec("ddp", 1, 8), 0, 1, str(tmp_path))
    assert len(single_process) == 3
    for schedule in SCHEDULES:
        losses, _, _ = pipeline_results[0][schedule]
        assert losses == pytest.approx(single_process, abs=1e-6, rel=0), schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_stages_hold_the_unsplit_names_and_keep_the_tied_weight_equal(
    pipeline_results: list[dict[str, Any]], schedule: str
) -> None:
    (_, first_tied, first_names), (_, last_tied, last_names) = (ranks[schedule] for ranks in pipeline_results)
    assert "transformer.wpe.weight" in first_names and "transformer.ln_f.weight" in last_names
    assert not set(first_names) & set(last_names)
    assert sorted(first_names + last_names) == sorted(
        {name for name, _ in NanoGPT().named_parameters(remove_duplicate=False)}
    )
    assert list(first_tied) == ["transformer.wte.weight"] and list(last_tied) == ["lm_head.weight"]
    torch.testing.assert_close(first_tied["transformer.wte.weight"], last_tied["lm_head.weight"], rtol=0, atol=0)


def test_a_forward_that_is_not_the_chain_fails_in_one_line_asking_for_a_hook() -> None:
    train, _ = pysource_splits(seq_len=SEQ_LEN, max_corpus_bytes=CORPUS_BYTES)
    bundle = ModelBundle(LongSkipGPT(), train, None, next_token_loss)
    with pytest.raises(JobInputError) as raised:
        chain_pipeline_stage(bundle, 2)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("model LongSkipGPT") and "cannot be split into pipeline stages" in message
    assert message.endswith("do not give its output; give ModelBundle.pipeline_stage (and output_loss_fn)")
