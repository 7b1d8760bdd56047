"""On the ROCm machine: AITER's non-causal MLA decode of a K3 draft block
equals TRITON_MLA's (the runbook's draft-attention step, MI355X, AITER on).

A K3 DSpark draft block is non-causal: each of its query_len rows attends the
whole context and the whole block. vLLM 0.34.0 picks ROCM_AITER_MLA for it on
gfx950 with AITER on, and upstream has no GPU test that AITER's decode obeys
`causal=False` at K3's shapes (kv_lora_rank 512, rope 64, 8/16 heads per
rank). Both backends run here through their own metadata builder and
`forward_mqa`, on one paged cache, by vLLM's MLA test harness
(tests/v1/attention/test_mla_backends.py); each must match a torch reference
without a mask, and each other.

Run from the patched tree's root (the runbook mounts its tests/ there):
    python3 -m pytest -v --rootdir . -c pyproject.toml <this file>
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import default_vllm_config, dist_init, workspace_init  # noqa: F401
from tests.v1.attention import test_mla_backends as harness
from tests.v1.attention.utils import BatchSpec, create_common_attn_metadata, create_vllm_config
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

pytestmark = pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm only")

# DeepSeek-R1's MLA dimensions are K3's; only its head count is overridden.
MODEL = "deepseek-ai/DeepSeek-R1"
KV_LORA_RANK, ROPE, NOPE, V_HEAD = 512, 64, 128, 128
CONTEXTS = (37, 1000, 2500)  # three requests, ragged
TOLERANCE = {"auto": 2e-2, "fp8": 1.5e-1}  # atol, as vLLM's MLA backend test
BACKENDS = (AttentionBackendEnum.TRITON_MLA, AttentionBackendEnum.ROCM_AITER_MLA)


def _config(heads: int, query_len: int, page: int, kv_dtype: str):
    from vllm.config import SpeculativeConfig

    config = create_vllm_config(model_name=MODEL, max_model_len=4096, num_gpu_blocks=600,
                                block_size=page,
                                hf_config_override={"num_attention_heads": heads})
    config.model_config.model_arch_config.total_num_attention_heads = heads
    config.cache_config.cache_dtype = kv_dtype
    # The draft block's rows count as one decode (reorder threshold = query_len).
    config.speculative_config = SpeculativeConfig(method="ngram",
                                                  num_speculative_tokens=query_len - 1)
    return config


def _inputs(heads: int, query_len: int, kv_dtype: str, device) -> dict:
    """Queries, latent KV and the kv_b_proj weights of one draft block per request."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * scale

    seqs = [c + query_len for c in CONTEXTS]
    x = {"q": [randn(query_len, heads, NOPE + ROPE) for _ in seqs],
         "kv_c": [randn(s, KV_LORA_RANK) for s in seqs],
         "k_pe": [randn(s, 1, ROPE) for s in seqs],
         "w": randn(KV_LORA_RANK, heads, NOPE + V_HEAD, scale=KV_LORA_RANK ** -0.5)}
    cached = (lambda t: harness._fp8_cache_roundtrip(t, 1.0)) if kv_dtype == "fp8" else (
        lambda t: t)
    x["kv_c_cached"] = [cached(t) for t in x["kv_c"]]
    x["k_pe_cached"] = [cached(t) for t in x["k_pe"]]
    return x


def _reference(x: dict, query_len: int, *, causal: bool) -> torch.Tensor:
    """Latent-space attention of every block row over its request's cached tokens:
    all of them (a draft block), or up to its own position (causal)."""
    w_uk, w_uv = x["w"].split([NOPE, V_HEAD], dim=-1)
    outs = []
    for q, kv_c, k_pe in zip(x["q"], x["kv_c_cached"], x["k_pe_cached"]):
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        q_lat = torch.cat([torch.einsum("qnh,lnh->qnl", q_nope, w_uk), q_pe], dim=-1)
        k = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1).float()
        scores = torch.einsum("qnd,sd->nqs", q_lat.float(), k) * (NOPE + ROPE) ** -0.5
        if causal:
            s = k.shape[0]
            rows = torch.arange(query_len, device=k.device)[:, None] + s - query_len
            scores = scores.masked_fill(torch.arange(s, device=k.device) > rows, float("-inf"))
        lat = torch.einsum("nqs,sl->qnl", scores.softmax(-1), kv_c.float())
        outs.append(torch.einsum("qnl,lnv->qnv", lat, w_uv.float()).flatten(1))
    return torch.cat(outs).to(torch.bfloat16)


def _kv_b_proj(x: dict, heads: int, device):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    proj = ColumnParallelLinear(input_size=KV_LORA_RANK, output_size=heads * (NOPE + V_HEAD),
                                bias=False).to(device=device, dtype=torch.bfloat16)
    weight = x["w"].reshape(KV_LORA_RANK, heads * (NOPE + V_HEAD)).T
    proj.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return proj


def _metadata_and_cache(x: dict, query_len: int, page: int, kv_dtype: str, device):
    spec = BatchSpec(seq_lens=[c + query_len for c in CONTEXTS],
                     query_lens=[query_len] * len(CONTEXTS))
    common = create_common_attn_metadata(spec, page, device)
    width = harness.get_block_table_width(common.block_table_tensor.shape[1], page)
    table = torch.nn.functional.pad(common.block_table_tensor,
                                    (0, width - common.block_table_tensor.shape[1]))
    common = common.replace(block_table_tensor=table, causal=False)
    blocks = sum(-(-s // page) for s in spec.seq_lens) + 101
    cache = harness.create_and_prepopulate_kv_cache(
        kv_c_contexts=[t[:c] for t, c in zip(x["kv_c"], CONTEXTS)],
        k_pe_contexts=[t[:c] for t, c in zip(x["k_pe"], CONTEXTS)],
        block_size=page, head_size=KV_LORA_RANK + ROPE, dtype=torch.bfloat16, device=device,
        num_blocks=blocks, common_attn_metadata=common, randomize_blocks=True,
        kv_cache_dtype=kv_dtype, scale=1.0)
    return common, cache


def _decode(backend, config, x, common, cache, page, kv_dtype, heads, device):
    spec = MLAAttentionSpec(block_size=page, num_kv_heads=1, head_size=KV_LORA_RANK + ROPE,
                            dtype=torch.bfloat16, cache_dtype_str=kv_dtype,
                            non_causal_multi_token_decode=True)
    return harness.run_attention_backend(
        backend, spec, ["draft.attn"], config, device, common, torch.cat(x["q"]),
        torch.cat([t[c:] for t, c in zip(x["kv_c"], CONTEXTS)]),
        torch.cat([t[c:] for t, c in zip(x["k_pe"], CONTEXTS)]), cache.clone(),
        KV_LORA_RANK, NOPE, ROPE, V_HEAD, _kv_b_proj(x, heads, device), q_scale=1.0,
        k_scale=1.0, kv_cache_dtype=kv_dtype)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("query_len", [3, 6, 8])
@pytest.mark.parametrize("heads", [8, 16])
def test_aiter_non_causal_draft_block_matches_triton_mla(
        heads, query_len, page, kv_dtype, monkeypatch, default_vllm_config,  # noqa: F811
        dist_init, workspace_init):  # noqa: F811
    device = torch.device("cuda:0")
    # The harness's layer marks the attention group as a (non-causal) draft's.
    monkeypatch.setattr(harness.MockMLAAttentionLayer, "non_causal_multi_token_decode", True,
                        raising=False)
    x = _inputs(heads, query_len, kv_dtype, device)
    want = _reference(x, query_len, causal=False)
    atol = TOLERANCE[kv_dtype]
    # The check has teeth: a decode that applied a causal mask would miss.
    assert _max_diff(_reference(x, query_len, causal=True), want) > 4 * atol
    config = _config(heads, query_len, page, kv_dtype)
    common, cache = _metadata_and_cache(x, query_len, page, kv_dtype, device)
    got = {b.name: _decode(b, config, x, common, cache, page, kv_dtype, heads, device)
           for b in BACKENDS}
    for name, out in got.items():
        assert torch.isfinite(out).all(), f"{name}: non-finite output"
        assert torch.allclose(out, want, rtol=1e-2, atol=atol), (
            f"{name} differs from the non-causal reference by {_max_diff(out, want):.4f}")
    triton, aiter = got["TRITON_MLA"], got["ROCM_AITER_MLA"]
    assert torch.allclose(aiter, triton, rtol=1e-2, atol=atol), (
        f"ROCM_AITER_MLA differs from TRITON_MLA by {_max_diff(aiter, triton):.4f}")
