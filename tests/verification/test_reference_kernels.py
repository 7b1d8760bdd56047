"""Each reference kernel against a case computed by hand.

These run in the pytest process (the reference kernels import nothing from
vLLM). They guard the harness itself: every end-to-end check trusts them.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.verification.harness import reference as R

BF16 = torch.bfloat16


def test_concat_and_cache_mla_bf16_scatter_by_slot():
    kv_c = torch.tensor([[1.0, 2.0], [5.0, 6.0]], dtype=BF16)
    k_pe = torch.tensor([[3.0, 4.0], [7.0, 8.0]], dtype=BF16)
    cache = torch.zeros(2, 2, 4, dtype=BF16)  # 2 blocks of 2 slots
    # token 0 -> slot 3 (block 1, offset 1); token 1 padded (-1)
    R.concat_and_cache_mla(
        kv_c, k_pe, cache, torch.tensor([3, -1]), "auto", torch.ones(1)
    )
    want = torch.zeros(2, 2, 4, dtype=BF16)
    want[1, 1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(cache, want)


@pytest.mark.parametrize(
    ("fp8_dtype", "saturation"),
    [(torch.float8_e4m3fn, 448.0), (torch.float8_e4m3fnuz, 240.0)],
    ids=["e4m3fn", "e4m3fnuz-mi300"],
)
def test_concat_and_cache_mla_fp8_with_scale(fp8_dtype, saturation):
    kv_c = torch.tensor([[1.0, -3.0]], dtype=BF16)
    k_pe = torch.tensor([[1000.0, 0.5]], dtype=BF16)
    cache = torch.zeros(1, 2, 4, dtype=torch.uint8)
    R.concat_and_cache_mla(
        kv_c, k_pe, cache, torch.tensor([1]), "fp8", torch.tensor([0.5]),
        fp8_dtype=fp8_dtype,
    )
    # x / 0.5: 2, -6, 2000 -> saturates at the format's max, 1
    got = cache[0, 1].view(fp8_dtype).float().tolist()
    assert got == [2.0, -6.0, saturation, 1.0]
    assert cache[0, 0].tolist() == [0, 0, 0, 0]


def test_concat_and_cache_mla_reads_fp32_k_pe_as_bf16_bits():
    """An fp32 k_pe handed to the bf16-dispatched kernel is read as bf16 halves
    (little endian: low half first), at bf16 offsets: the review's defect."""
    kv_c = torch.tensor([[1.0, 2.0]], dtype=BF16)
    k_pe = torch.tensor([[3.0, 1.0 + 2**-20]], dtype=torch.float32)
    cache = torch.zeros(1, 1, 4, dtype=BF16)
    R.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0]), "auto", torch.ones(1))
    # 3.0f = 0x40400000 -> halves 0x0000 (0.0), 0x4040 (3.0)
    assert cache[0, 0].tolist() == [1.0, 2.0, 0.0, 3.0]


def test_grouped_insert_writes_through_live_base_addresses():
    reg = R.LiveCacheRegistry()
    caches = [reg.register(torch.zeros(2, 2, 3, dtype=BF16)) for _ in range(2)]
    kv_c = torch.tensor([[[1.0, 2.0]], [[4.0, 5.0]]], dtype=BF16)  # [L=2, T=1, 2]
    k_pe = torch.tensor([[[3.0]], [[6.0]]], dtype=BF16)
    ptrs = torch.tensor([c.data_ptr() for c in caches])
    slots = torch.tensor([[2], [1]])
    R.concat_and_cache_mla_grouped(
        kv_c,
        k_pe,
        ptrs,
        slots,
        2,
        caches[0].stride(0),
        caches[0].stride(1),
        None,
        "auto",
        registry=reg,
        rocm=True,
    )
    assert caches[0][1, 0].tolist() == [1.0, 2.0, 3.0]
    assert caches[1][0, 1].tolist() == [4.0, 5.0, 6.0]
    assert caches[0].count_nonzero() == 3 and caches[1].count_nonzero() == 3


def test_grouped_insert_detects_write_through_freed_cache():
    reg = R.LiveCacheRegistry()
    old = reg.register(torch.zeros(2, 2, 3, dtype=BF16))
    ptrs = torch.tensor([old.data_ptr()])
    reg.free(old)
    reg.register(torch.zeros(2, 2, 3, dtype=BF16))
    args = (
        torch.ones(1, 1, 2, dtype=BF16),
        torch.ones(1, 1, 1, dtype=BF16),
        ptrs,
        torch.tensor([[0]]),
        2,
        6,
        3,
        None,
        "auto",
    )
    with pytest.raises(R.StaleCachePointerError, match="freed"):
        R.concat_and_cache_mla_grouped(*args, registry=reg, rocm=True)
    assert old.count_nonzero() == 0
    with pytest.raises(R.StaleCachePointerError, match="not the base"):
        R.concat_and_cache_mla_grouped(
            *args[:2], torch.tensor([12345]), *args[3:], registry=reg, rocm=True
        )


def test_grouped_insert_fp8_scales_and_rocm_e5m2_rejection():
    reg = R.LiveCacheRegistry()
    caches = [reg.register(torch.zeros(1, 1, 2, dtype=torch.uint8)) for _ in range(2)]
    kv_c = torch.tensor([[[8.0]], [[8.0]]], dtype=BF16)
    k_pe = torch.tensor([[[-2.0]], [[-2.0]]], dtype=BF16)
    ptrs = torch.tensor([c.data_ptr() for c in caches])
    slots = torch.zeros(2, 1, dtype=torch.int64)
    scales = torch.tensor([2.0, 4.0])

    def insert(cache_dtype, **kwargs):
        # block_size 1, block_stride 2, entry_stride 2: one 2-wide entry per block.
        R.concat_and_cache_mla_grouped(
            kv_c, k_pe, ptrs, slots, 1, 2, 2, scales, cache_dtype,
            registry=reg, **kwargs,
        )

    insert("fp8", rocm=True, fp8_dtype=torch.float8_e4m3fn)
    assert caches[0].view(torch.float8_e4m3fn).float().flatten().tolist() == [4.0, -1.0]
    assert caches[1].view(torch.float8_e4m3fn).float().flatten().tolist() == [2.0, -0.5]
    with pytest.raises(RuntimeError, match="fp8_e5m2"):
        insert("fp8_e5m2", rocm=True)
    insert("fp8_e5m2", rocm=False)  # the CUDA build takes it
    assert caches[0].view(torch.float8_e5m2).float().flatten().tolist() == [4.0, -1.0]


def test_rms_norm_per_layer_weights():
    x = torch.tensor([[[3.0, 4.0]], [[1.0, 1.0]]])  # [L=2, T=1, H=2]
    w = torch.tensor([[1.0, 2.0], [3.0, 3.0]])
    out = torch.empty_like(x)
    R.rms_norm(out, x, w, 0.0)
    # rms(3,4) = sqrt(12.5); rms(1,1) = 1
    s = math.sqrt(12.5)
    torch.testing.assert_close(out, torch.tensor([[[3 / s, 8 / s]], [[3.0, 3.0]]]))


def test_rotary_embedding_interleaved_in_place():
    # rot_dim 4: pairs (0,1) and (2,3); position 1 uses row 1 of the table.
    cos_sin = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.5, 1.0, 0.0]])
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=BF16)  # [T=1, heads=1, 4]
    R.rotary_embedding(torch.tensor([1]), q, None, 4, cos_sin, is_neox=False)
    # pair0: cos 0 sin 1 -> (x*0 - y*1, y*0 + x*1) = (-2, 1)
    # pair1: cos .5 sin 0 -> (1.5, 2)
    assert q.dtype == BF16
    assert q.flatten().tolist() == [-2.0, 1.0, 1.5, 2.0]
    k = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=BF16)
    R.rotary_embedding(torch.tensor([1]), k, None, 4, cos_sin, is_neox=True)
    # neox pairs (0,2) and (1,3): (1,3)->cos0 sin1 -> (-3, 1); (2,4)->(1, 2)
    assert k.flatten().tolist() == [-3.0, 1.0, 1.0, 2.0]


def test_rotary_embedding_writes_through_strided_views():
    # The ROCm drafter passes q[..., nope:] (head stride 6) and the k_pe slice
    # of the latent projection; only the rope columns may change.
    cos_sin = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.5, 1.0, 0.0]])
    q = torch.arange(12, dtype=BF16).view(1, 2, 6)
    kv = torch.arange(6, dtype=BF16).view(1, 6)
    R.rotary_embedding(
        torch.tensor([1]), q[..., 2:], kv[:, 2:].unsqueeze(1), 4, cos_sin, False
    )
    assert q[..., :2].flatten().tolist() == [0.0, 1.0, 6.0, 7.0]
    assert q[0, 0, 2:].tolist() == [-3.0, 2.0, 2.0, 2.5]
    assert kv.flatten().tolist() == [0.0, 1.0, -3.0, 2.0, 2.0, 2.5]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mla_decode_epilogue_concats_ropes_and_inserts(fp8):
    # kv_lora_rank 2, rope 2 (one interleaved pair); 1 token, 1 head.
    cos_sin = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # position 1: rotate 90°
    ql_nope = torch.tensor([[[1.0, 2.0]]], dtype=BF16)
    q_pe = torch.tensor([[[3.0, 4.0]]], dtype=BF16)
    kv_c = torch.tensor([[5.0, 6.0]], dtype=BF16)
    k_pe = torch.tensor([[[7.0, 8.0]]], dtype=BF16)
    f8 = torch.float8_e4m3fn
    mqa_q = torch.zeros(1, 1, 4, dtype=f8 if fp8 else BF16)
    cache = torch.zeros(2, 2, 4, dtype=torch.uint8 if fp8 else BF16)
    scales = [torch.tensor([0.5]), torch.tensor([2.0])] if fp8 else [None, None]
    R.mla_decode_q_concat_kv_cache_insert(
        ql_nope, q_pe, kv_c, k_pe, mqa_q, cache, torch.tensor([3]), 2,
        torch.tensor([1]), cos_sin, *scales, fp8_max=10.0,
    )
    # (x, y) at 90°: (-y, x). fp8: q * 0.5, cache * 2 saturated at 10.
    want_q, want_row = [1.0, 2.0, -4.0, 3.0], [5.0, 6.0, -8.0, 7.0]
    if fp8:
        want_q = [0.5, 1.0, -2.0, 1.5]
        want_row = [10.0, 10.0, -10.0, 10.0]
    assert mqa_q.float().flatten().tolist() == want_q
    row = cache[1, 1].view(f8) if fp8 else cache[1, 1]  # slot 3: block 1, entry 1
    assert row.float().tolist() == want_row
    assert not cache[0].float().any() and not cache[1, 0].float().any()
