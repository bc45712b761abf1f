"""workers/models/registry.py: the next-token loss takes the logits out of whatever shape of output a plain model's
forward returns where the meaning is clear, and otherwise fails the job in one line that says what to return."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringmaster.workers.models.registry import EntrypointError, next_token_loss

VOCAB, BATCH, POSITIONS = 11, 2, 5


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Returns(nn.Module):
    """A model whose forward wraps its logits as `wrap` says."""

    def __init__(self, wrap: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, VOCAB)
        self.wrap = wrap

    def forward(self, tokens: torch.Tensor) -> object:
        return self.wrap(self.embedding(tokens))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, POSITIONS + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize(
    "wrap",
    [
        lambda logits: logits,
        lambda logits: (logits, None),  # (logits, loss) without targets, as nanoGPT-style code returns
        lambda logits: [logits, torch.tensor(0.0)],
        lambda logits: Output(logits),
        lambda logits: {"logits": logits, "loss": None},
    ],
    ids=["tensor", "tuple", "list", "dataclass", "dict"],
)
def test_the_logits_are_found_in_every_output_whose_meaning_is_clear(wrap: Callable[[torch.Tensor], object]) -> None:
    model = Returns(wrap)
    inputs, targets = _batch()
    expected = F.cross_entropy(model.embedding(inputs).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(next_token_loss(model, (inputs, targets)), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("wrap", "named"),
    [
        (lambda logits: None, "returned a NoneType"),
        (lambda logits: (None, logits), "returned a tuple of (NoneType, Tensor)"),
        (lambda logits: {"scores": logits}, "returned a dict"),
    ],
    ids=["none", "tuple-without-logits-first", "dict-without-logits"],
)
def test_an_output_without_clear_logits_fails_in_one_line_saying_what_to_return(
    wrap: Callable[[torch.Tensor], object], named: str
) -> None:
    with pytest.raises(EntrypointError) as raised:
        next_token_loss(Returns(wrap), _batch())
    message = str(raised.value)
    assert named in message and "return the logits tensor, a tuple whose first item is it" in message
    assert "\n" not in message


def test_logits_of_the_last_position_alone_are_refused_with_their_shape() -> None:
    model = Returns(lambda logits: (logits[:, -1:, :], None))  # what nanoGPT's forward returns without targets
    with pytest.raises(EntrypointError, match=r"logits of shape \(2, 1, 11\) for a window of shape \(2, 5\)"):
        next_token_loss(model, _batch())
