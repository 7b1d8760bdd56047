"""Speculative-decoding verification: vLLM's `rejection_sample`, as the GPU
model runner calls it (vllm/v1/worker/gpu/spec_decode/rejection_sampler.py).

Serving shapes of the K3 DSpark drafter: a 163840-token vocabulary, 6 draft
tokens per request, 1/16/64 requests, probabilistic drafts (draft logits
cached by the drafter), standard and block verification. Every request
samples (temperature 0.6); greedy requests skip most of the work.

The inputs have the dtypes the model runner passes: fp32 target logits (the
output of `Sampler.apply_sampling_params`, temperature applied) and draft
logits in the model's head dtype (bf16) before temperature. The drafter's
logits are the target's plus noise, and the draft tokens are sampled from
them, so some requests accept a few tokens and some reject early.

Since vLLM 0.34.0 `rejection_sample` takes the draft logits in the
speculator's `DraftLogitsCache`: here a replicated one (row_mapping None), as
K3's speculator builds it (a batch-sharded cache needs a target with
`compute_logits_local`). No request masks logits (no top-k or top-p), so
`skip_masked_vocab_blocks` is off, as the runner passes it then. Trees before
0.34.0 take the draft logits tensor itself.
"""

from __future__ import annotations

import inspect

import torch

FILES = ("vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py",)

VOCAB_SIZE = 163840
NUM_SPECULATIVE_STEPS = 6
TEMPERATURE = 0.6

SHAPES = tuple(
    {
        "name": f"{method}, {num_reqs} req",
        "method": method,
        "num_reqs": num_reqs,
        "vocab_size": VOCAB_SIZE,
        "num_speculative_steps": NUM_SPECULATIVE_STEPS,
    }
    for method in ("standard", "block")
    for num_reqs in (1, 16, 64)
)


def make_inputs(shape: dict, device: torch.device, generator: torch.Generator) -> dict:
    """Keyword arguments of one rejection_sample call."""
    num_reqs, k = shape["num_reqs"], shape["num_speculative_steps"]
    vocab_size = shape["vocab_size"]
    num_logits = num_reqs * (k + 1)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device)

    raw_target = 3.0 * randn(num_reqs, k + 1, vocab_size)
    # Before temperature, in the head dtype: the drafter's cached logits.
    draft_logits = (raw_target[:, :k] + randn(num_reqs, k, vocab_size)).bfloat16()
    temperature = torch.full((num_reqs,), TEMPERATURE, device=device)
    target_logits = (raw_target / TEMPERATURE).view(num_logits, vocab_size)
    del raw_target

    draft_probs = (draft_logits.float() / TEMPERATURE).softmax(-1)
    draft_tokens = torch.multinomial(
        draft_probs.view(-1, vocab_size), 1, generator=generator
    ).view(num_reqs, k)
    del draft_probs
    # Row r * (k + 1) + i + 1 holds draft token i of request r; the first row
    # of a request holds the token sampled last step.
    draft_sampled = torch.zeros(num_reqs, k + 1, dtype=torch.int32, device=device)
    draft_sampled[:, 1:] = draft_tokens

    local_pos = torch.arange(k + 1, dtype=torch.int32, device=device)
    first_pos = torch.randint(
        1000, 30000, (num_reqs, 1), generator=generator, device=device
    )
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32, device=device)
    return dict(
        target_logits=target_logits,
        draft_logits=draft_logits,
        draft_sampled=draft_sampled.view(-1),
        cu_num_logits=torch.arange(num_reqs + 1, dtype=torch.int32, device=device)
        * (k + 1),
        pos=(first_pos + local_pos).view(-1).long(),
        idx_mapping=idx_mapping,
        expanded_idx_mapping=idx_mapping.repeat_interleave(k + 1),
        expanded_local_pos=local_pos.repeat(num_reqs),
        temperature=temperature,
        seed=torch.randint(
            2**62, (num_reqs,), generator=generator, device=device
        ),
        num_speculative_steps=k,
        use_block_verification=shape["method"] == "block",
    )


def bind(load):
    module = load("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils")
    if "draft_logits_cache" not in inspect.signature(module.rejection_sample).parameters:

        def call_with_tensor(inputs: dict):
            return module.rejection_sample(**inputs)

        return call_with_tensor
    cache_class = load("vllm.v1.worker.gpu.spec_decode.draft_logits").DraftLogitsCache

    def call(inputs: dict):
        inputs = dict(inputs)
        cache = replicated_cache(cache_class, inputs.pop("draft_logits"))
        return module.rejection_sample(draft_logits_cache=cache, **inputs)

    return call


def replicated_cache(cache_class: type, values: torch.Tensor):
    """A replicated DraftLogitsCache holding `values` ([num_reqs, k, V], row
    req_state_idx), as `DraftLogitsCache(..., sharded=False)` leaves it, built
    without its __init__: the fill of a new tensor would be one more launch in
    every captured call."""
    cache = cache_class.__new__(cache_class)
    cache.row_mapping = None
    cache.values = values
    return cache


def same_output(a, b) -> bool:
    """The same tokens emitted: rows past num_sampled are never written."""
    (sampled_a, num_a), (sampled_b, num_b) = a, b
    if not torch.equal(num_a, num_b):
        return False
    columns = torch.arange(sampled_a.shape[1], device=sampled_a.device)
    emitted = columns < num_a[:, None]
    return torch.equal(sampled_a[emitted], sampled_b[emitted])
