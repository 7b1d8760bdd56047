# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Rejection sampling must stay lossless when the draft logits are not finite.

A drafter with a corrupted state (say, a KV cache full of huge values) emits
NaN or +/-inf logits. Verification must then accept nothing at or after the
first such draft position and resample from the target distribution alone, so
that a broken drafter can only lower the acceptance rate, never change the
output distribution.

The kernels run compiled, so these tests need a GPU.
"""

from collections.abc import Callable

import pytest
import torch

from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda_alike(), reason="Triton kernels need a GPU"
)

NAN, INF = float("nan"), float("inf")

# One target distribution per position. They differ, so that a token drawn from
# the wrong position's distribution is as visible as one drawn from no
# distribution at all.
TARGET_PROBS = torch.tensor(
    [
        [0.1, 0.2, 0.3, 0.4],
        [0.4, 0.1, 0.2, 0.3],
        [0.3, 0.4, 0.1, 0.2],
        [0.2, 0.3, 0.4, 0.1],
    ]
)
VOCAB_SIZE = TARGET_PROBS.shape[1]

# How a corrupted drafter fills the draft logits at one position.
ROW_CORRUPTIONS = {"nan": NAN, "+inf": INF, "-inf": -INF}
# A single bad entry in an otherwise finite row.
ENTRY_CORRUPTIONS = {"nan entry": NAN, "+inf entry": INF}

METHODS = {"standard": False, "block": True}

RejectionSample = Callable[[dict], tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture
def rejection_sample() -> RejectionSample:
    """Runs rejection_sample on the GPU: CPU inputs in, CPU outputs out. The
    draft logits tensor of the inputs is handed over in a DraftLogitsCache."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils
    from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache

    def run(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {
            name: value.cuda() if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()
        }
        draft_logits = inputs.pop("draft_logits")
        row_mapping = inputs.pop("draft_logits_row_mapping", None)
        cache = None
        if draft_logits is not None:
            cache = DraftLogitsCache(
                1, 1, 1, dtype=draft_logits.dtype, fill=0.0, device=draft_logits.device
            )
            cache.values = draft_logits
            cache.row_mapping = row_mapping
        sampled, num_sampled = rejection_sampler_utils.rejection_sample(
            draft_logits_cache=cache, **inputs
        )
        return sampled.cpu(), num_sampled.cpu()

    return run


def _inputs(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    use_block_verification: bool,
) -> dict:
    """rejection_sample kwargs, one request per row, each with its own seed.

    target_logits: [num_reqs, K + 1, V], temperature already applied.
    draft_logits: [num_reqs, K, V], before temperature, or None (one-hot).
    draft_tokens: [num_reqs, K].
    """
    num_reqs, k = draft_tokens.shape
    draft_sampled = torch.zeros(num_reqs, k + 1, dtype=torch.int64)
    draft_sampled[:, 1:] = draft_tokens
    reqs = torch.arange(num_reqs, dtype=torch.int32)
    return dict(
        target_logits=target_logits.reshape(num_reqs * (k + 1), -1).contiguous(),
        draft_logits=None if draft_logits is None else draft_logits.contiguous(),
        draft_sampled=draft_sampled.flatten(),
        cu_num_logits=torch.arange(num_reqs + 1, dtype=torch.int32) * (k + 1),
        pos=torch.arange(num_reqs * (k + 1), dtype=torch.int32),
        idx_mapping=reqs,
        expanded_idx_mapping=reqs.repeat_interleave(k + 1),
        expanded_local_pos=torch.arange(k + 1, dtype=torch.int32).repeat(num_reqs),
        temperature=temperature,
        seed=reqs.to(torch.int64),
        num_speculative_steps=k,
        use_block_verification=use_block_verification,
    )


def _draw(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of [..., V] logits."""
    probs = logits.softmax(-1).reshape(-1, logits.shape[-1])
    tokens = torch.multinomial(probs, 1, generator=generator)
    return tokens.view(logits.shape[:-1])


def _emitted(sampled: torch.Tensor, num_sampled: torch.Tensor) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(sampled, num_sampled.tolist())]


def _assert_follows(tokens: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    """Chi-square goodness of fit of sampled tokens to a distribution."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert (expected >= 5).all(), f"{label}: too few samples for a chi-square test"
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    p_value = torch.special.gammaincc(dof, chi2 / 2).item()
    assert p_value > 1e-3, (
        f"{label}: counts {counts.int().tolist()}, expected "
        f"{[round(e, 1) for e in expected.tolist()]}: chi2 = {chi2.item():.1f}, "
        f"p = {p_value:.2g}"
    )


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_draft_is_verified_like_a_placeholder(
    rejection_sample: RejectionSample, method: str
):
    """A position whose draft logits are not finite ends verification exactly
    like a -1 placeholder there: nothing at or after it is accepted, and the
    recovery token comes from the target alone (or, under block verification,
    from the residual of the finite prefix), bit for bit.
    """
    k, reqs_per_case = 3, 6
    cases = [(kind, value, 0, k) for kind, value in ROW_CORRUPTIONS.items()]
    cases += [(kind, value, 1, 2) for kind, value in ROW_CORRUPTIONS.items()]
    cases += [(kind, value, 1, 2) for kind, value in ENTRY_CORRUPTIONS.items()]
    num_reqs = len(cases) * reqs_per_case

    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(num_reqs, k + 1, VOCAB_SIZE, generator=generator)
    draft_logits = torch.randn(num_reqs, k, VOCAB_SIZE, generator=generator)
    temperature = torch.tensor([1.0, 0.6]).repeat(num_reqs // 2)
    draft_tokens = _draw(draft_logits / temperature[:, None, None], generator)

    corrupted = draft_logits.clone()
    placeholders = draft_tokens.clone()
    first_bad = torch.empty(num_reqs, dtype=torch.int64)
    for case, (kind, value, start, end) in enumerate(cases):
        reqs = slice(case * reqs_per_case, (case + 1) * reqs_per_case)
        if kind in ENTRY_CORRUPTIONS:
            corrupted[reqs, start:end, 1] = value
        else:
            corrupted[reqs, start:end] = value
        placeholders[reqs, start] = -1
        first_bad[reqs] = start

    use_block = METHODS[method]
    sampled, num_sampled = rejection_sample(
        _inputs(target_logits, corrupted, draft_tokens, temperature, use_block)
    )
    expected, expected_num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, placeholders, temperature, use_block)
    )

    assert (num_sampled <= first_bad + 1).all(), (
        f"accepted a draft token at or after a non-finite draft: "
        f"num_sampled {num_sampled.tolist()}, first bad {first_bad.tolist()}"
    )
    assert _emitted(sampled, num_sampled) == _emitted(expected, expected_num_sampled)
    # The finite prefix is verified: some requests reach the bad position.
    assert (num_sampled[first_bad > 0] > 1).any()


@pytest.mark.parametrize("skip_masked_vocab_blocks", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_nan_in_a_vocab_block_without_finite_logits(
    rejection_sample: RejectionSample, method: str, skip_masked_vocab_blocks: bool
):
    """NaN logits in a vocab block whose other logits are -inf, next to a block
    of finite logits: a NaN-suppressing max reduction must not hide them."""
    k, num_reqs, block_size = 2, 4, 8192
    vocab_size = block_size + VOCAB_SIZE
    # Every distribution lives in the second vocab block.
    target_logits = torch.full((num_reqs, k + 1, vocab_size), -INF)
    target_logits[..., block_size:] = TARGET_PROBS[: k + 1].log()
    draft_logits = target_logits[:, :k].clone()
    generator = torch.Generator().manual_seed(0)
    draft_tokens = block_size + _draw(draft_logits[..., block_size:], generator)
    # The draft matches the target, so only the NaN can reject it.
    corrupted = draft_logits.clone()
    corrupted[:, 1, : block_size // 2] = NAN
    placeholders = draft_tokens.clone()
    placeholders[:, 1] = -1
    temperature = torch.ones(num_reqs)

    use_block = METHODS[method]
    # The resample kernel skips the first vocab block (no target token in it).
    skip = {"skip_masked_vocab_blocks": skip_masked_vocab_blocks}
    sampled, num_sampled = rejection_sample(
        _inputs(target_logits, corrupted, draft_tokens, temperature, use_block) | skip
    )
    expected, expected_num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, placeholders, temperature, use_block)
        | skip
    )

    assert num_sampled.tolist() == [2] * num_reqs
    assert _emitted(sampled, num_sampled) == _emitted(expected, expected_num_sampled)


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_draft_recovers_from_target(
    rejection_sample: RejectionSample, method: str
):
    """NaN/+inf/-inf draft logits at every position, or at position 1 only:
    acceptance stops right before them and the emitted recovery tokens follow
    the target distribution of that position.

    The first draft matches the target, so it is always accepted and position
    1 is always reached; the draft after the bad one matches the target too,
    so verifying past the bad position would accept it.
    """
    k, reqs_per_kind = 2, 30
    num_reqs = 2 * len(ROW_CORRUPTIONS) * reqs_per_kind
    target_logits = TARGET_PROBS[: k + 1].log().expand(num_reqs, -1, -1)
    draft_logits = TARGET_PROBS[:k].log().repeat(num_reqs, 1, 1)
    generator = torch.Generator().manual_seed(0)
    draft_tokens = _draw(draft_logits, generator)
    values = torch.tensor(list(ROW_CORRUPTIONS.values()))
    kinds = torch.arange(num_reqs) % len(ROW_CORRUPTIONS)
    everywhere = torch.arange(num_reqs) < num_reqs // 2
    draft_logits[everywhere] = values[kinds[everywhere], None, None]
    draft_logits[~everywhere, 1] = values[kinds[~everywhere], None]
    temperature = torch.ones(num_reqs)

    sampled, num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, draft_tokens, temperature, METHODS[method])
    )

    first_bad = torch.where(everywhere, 0, 1)
    assert num_sampled.tolist() == (first_bad + 1).tolist()
    assert (sampled[~everywhere, 0] == draft_tokens[~everywhere, 0]).all()
    recovered = sampled[torch.arange(num_reqs), first_bad]
    _assert_follows(recovered[everywhere], TARGET_PROBS[0], "bad at every position")
    _assert_follows(recovered[~everywhere], TARGET_PROBS[1], "bad at position 1")


@pytest.mark.parametrize("method", METHODS)
def test_finite_draft_sampled_from_draft_is_lossless(
    rejection_sample: RejectionSample, method: str
):
    """Drafts sampled from a finite draft distribution unlike the target: the
    emitted tokens follow the target distribution."""
    k, num_reqs = 2, 200
    target_logits = TARGET_PROBS[: k + 1].log().expand(num_reqs, -1, -1)
    # The draft ranks every position's tokens in the opposite order.
    draft_logits = TARGET_PROBS[:k].flip(-1).log().repeat(num_reqs, 1, 1)
    generator = torch.Generator().manual_seed(0)
    draft_tokens = _draw(draft_logits, generator)
    temperature = torch.ones(num_reqs)

    sampled, num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, draft_tokens, temperature, METHODS[method])
    )

    assert (num_sampled < 3).any() and (num_sampled > 1).any()
    _assert_follows(sampled[:, 0], TARGET_PROBS[0], "first emitted token")


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_draft_leaves_greedy_unchanged(
    rejection_sample: RejectionSample, method: str
):
    """Greedy verification never reads the draft logits."""
    k, num_reqs = 3, 6
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(num_reqs, k + 1, VOCAB_SIZE, generator=generator)
    draft_logits = torch.randn(num_reqs, k, VOCAB_SIZE, generator=generator)
    # Drafts that match the target argmax up to a request-dependent position.
    draft_tokens = target_logits[:, :k].argmax(-1)
    mismatch = torch.arange(k) >= torch.arange(num_reqs)[:, None] % (k + 1)
    draft_tokens[mismatch] = (draft_tokens[mismatch] + 1) % VOCAB_SIZE
    corrupted = draft_logits.clone()
    values = torch.tensor([NAN, INF, -INF])
    corrupted[:] = values[torch.arange(num_reqs) % 3, None, None]
    temperature = torch.zeros(num_reqs)

    use_block = METHODS[method]
    sampled, num_sampled = rejection_sample(
        _inputs(target_logits, corrupted, draft_tokens, temperature, use_block)
    )
    expected, expected_num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, draft_tokens, temperature, use_block)
    )

    assert _emitted(sampled, num_sampled) == _emitted(expected, expected_num_sampled)
    assert num_sampled.tolist() == [1 + n % (k + 1) for n in range(num_reqs)]
    for req, tokens in enumerate(_emitted(sampled, num_sampled)):
        assert tokens == target_logits[req, : len(tokens)].argmax(-1).tolist()


@pytest.mark.parametrize("method", METHODS)
def test_masked_draft_logits_are_still_verified(
    rejection_sample: RejectionSample, method: str
):
    """-inf draft logits next to finite ones are a masked vocabulary, not a
    broken drafter: a draft that puts all its mass on the drafted token this way
    is verified like a one-hot draft."""
    k, num_reqs = 2, 32
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(num_reqs, k + 1, VOCAB_SIZE, generator=generator)
    draft_tokens = torch.randint(VOCAB_SIZE, (num_reqs, k), generator=generator)
    draft_logits = torch.full((num_reqs, k, VOCAB_SIZE), -INF)
    draft_logits.scatter_(-1, draft_tokens[..., None], 0.0)
    temperature = torch.ones(num_reqs)

    use_block = METHODS[method]
    sampled, num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, draft_tokens, temperature, use_block)
    )
    expected, expected_num_sampled = rejection_sample(
        _inputs(target_logits, None, draft_tokens, temperature, use_block)
    )

    assert (num_sampled > 1).any()
    assert _emitted(sampled, num_sampled) == _emitted(expected, expected_num_sampled)


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_draft_in_a_batch_sharded_cache(
    rejection_sample: RejectionSample, method: str
):
    """A batch-sharded cache (DraftLogitsCache.row_mapping) holds a request's
    draft logits at another row: a non-finite row found there is verified like
    a placeholder, as in a replicated cache."""
    k, num_reqs = 2, 24
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(num_reqs, k + 1, VOCAB_SIZE, generator=generator)
    draft_logits = torch.randn(num_reqs, k, VOCAB_SIZE, generator=generator)
    temperature = torch.ones(num_reqs)
    draft_tokens = _draw(draft_logits, generator)
    corrupted = draft_logits.clone()
    values = torch.tensor([NAN, INF, -INF])
    corrupted[::2, 1] = values[torch.arange(num_reqs // 2) % 3, None]
    placeholders = draft_tokens.clone()
    placeholders[::2, 1] = -1
    use_block = METHODS[method]
    rows = torch.randperm(num_reqs, generator=generator)
    sharded = _inputs(target_logits, corrupted, draft_tokens, temperature, use_block)
    sharded["draft_logits_row_mapping"] = rows.to(torch.int32)
    sharded["draft_logits"] = torch.empty_like(corrupted)
    sharded["draft_logits"][rows] = corrupted

    sampled, num_sampled = rejection_sample(sharded)
    expected, expected_num_sampled = rejection_sample(
        _inputs(target_logits, draft_logits, placeholders, temperature, use_block)
    )

    assert _emitted(sampled, num_sampled) == _emitted(expected, expected_num_sampled)
