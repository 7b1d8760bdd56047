# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The rejection sampler when draft probabilities are not finite.

A drafter with a corrupted state emits NaN or +/-inf draft logits, and their
softmax is NaN. Such a draft position is rejected whatever the target
(``draft_prob > 0`` fails for NaN), so sampling stays lossless only if its
recovered token is drawn from the target itself. Without that, the residual
``max(target - NaN, 0)`` is 0 everywhere and the recovered token was token 0
every time. Finite draft rows keep their old arithmetic.

The kernels run compiled, so these tests need a GPU.
"""

import pytest
import torch

from vllm.platforms import current_platform
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import rejection_sample, sample_recovered_tokens

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda_alike(), reason="the sampler's kernels need a GPU"
)

DEVICE = current_platform.device_type
NON_FINITE = ["nan", "posinf", "all-neginf"]
TARGET = [0.1, 0.2, 0.3, 0.4]


def _draft_probs(kind: str, num_tokens: int, vocab_size: int) -> torch.Tensor:
    """Draft probabilities as a drafter's softmax gives them: NaN rows for a
    NaN or +inf logit, or for a row of -inf logits."""
    logits = torch.randn(
        num_tokens, vocab_size, generator=torch.Generator().manual_seed(0)
    )
    if kind == "nan":
        logits[:, 1] = float("nan")
    elif kind == "posinf":
        logits[:, 1] = float("inf")
    elif kind == "all-neginf":
        logits[:] = float("-inf")
    return torch.softmax(logits, dim=-1).to(DEVICE)


def _metadata(batch_size: int) -> SamplingMetadata:
    """Random sampling at temperature 1, each request with its own seed."""
    return SamplingMetadata(
        temperature=torch.ones(batch_size, device=DEVICE),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={
            i: torch.Generator(device=DEVICE).manual_seed(i) for i in range(batch_size)
        },
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch_size, device=DEVICE),
        presence_penalties=torch.zeros(batch_size, device=DEVICE),
        repetition_penalties=torch.ones(batch_size, device=DEVICE),
        output_token_ids=[[] for _ in range(batch_size)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=None,
    )


def _recovered(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Recovered tokens of one draft token per request, seeded per request."""
    batch_size = draft_probs.shape[0]
    return sample_recovered_tokens(
        max_spec_len=1,
        num_draft_tokens=[1] * batch_size,
        cu_num_draft_tokens=torch.arange(1, batch_size + 1, device=DEVICE),
        draft_token_ids=torch.zeros(batch_size, dtype=torch.int64, device=DEVICE),
        draft_probs=draft_probs,
        target_probs=target_probs,
        sampling_metadata=_metadata(batch_size),
        device=torch.device(DEVICE),
    )


@pytest.mark.parametrize("kind", NON_FINITE)
def test_recovered_token_is_drawn_from_the_target(kind: str):
    """Drawn by the same exponential race as every recovered token, on the
    target alone: what a draft row of zeros (residual = target) gives."""
    batch_size, vocab_size = 64, 1000
    target_probs = torch.softmax(
        torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(1)),
        dim=-1,
    ).to(DEVICE)
    broken = _draft_probs(kind, batch_size, vocab_size)
    got = _recovered(broken, target_probs)
    want = _recovered(torch.zeros_like(broken), target_probs)
    assert torch.equal(got, want)
    assert got.unique().numel() > 1  # not one token every time


def test_a_finite_draft_row_keeps_its_residual():
    """A draft row holding the whole mass on a token is never recovered to it
    (its residual is 0 there), next to non-finite rows of the same batch."""
    vocab_size = 4
    target_probs = torch.tensor([TARGET] * 64, device=DEVICE)
    draft_probs = _draft_probs("nan", 64, vocab_size)
    draft_probs[::2] = torch.tensor([0.0, 0.0, 0.0, 1.0], device=DEVICE)
    recovered = _recovered(draft_probs, target_probs)
    assert (recovered[::2] != 3).all()
    assert (recovered[1::2] == 3).any()


@pytest.mark.parametrize("kind", NON_FINITE)
def test_rejection_sample_stays_lossless(kind: str):
    """With a non-finite draft row the draft token is rejected and the output
    follows the target: counts against the target's probabilities (chi-square
    at 3 degrees of freedom, p = 0.001)."""
    batch_size, vocab_size = 2000, len(TARGET)
    target_logits = torch.tensor(TARGET, device=DEVICE).log().expand(batch_size, -1)
    # The target's most likely token: a finite draft would often be accepted.
    draft_token_ids = torch.full((batch_size,), 3, dtype=torch.int64, device=DEVICE)
    output = rejection_sample(
        draft_token_ids,
        [1] * batch_size,
        1,
        torch.arange(1, batch_size + 1, dtype=torch.int32, device=DEVICE),
        _draft_probs(kind, batch_size, vocab_size),
        target_logits.contiguous(),
        torch.zeros(batch_size, 1, dtype=torch.int64, device=DEVICE),
        _metadata(batch_size),
    )
    # Rejected: the bonus slot stays empty.
    assert (output[:, 1] == -1).all()
    counts = torch.bincount(output[:, 0], minlength=vocab_size).double().cpu()
    expected = batch_size * torch.tensor(TARGET, dtype=torch.float64)
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 16.27, counts.tolist()
