"""fa4dist.compat's flash-attn 2 decoding call on a CUDA cache: the GPU backends (the CuTe kernels where installed)
against the fp64 run of the same call on the CPU, ragged caches and a whole-cache prefill."""

import pytest
import torch

from fa4dist.compat import flash_attn as fa2
from oracle import REL_TOL, rel_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqlens, sq, new, head_dim", [
    ([700, 33, 1500], 1, 1, 128),  # decode steps on ragged caches (one packed call)
    ([0, 900, 128], 4, 2, 64),  # 4 queries, 2 new rows; an empty cache: its first 2 queries see no key
    ([1024, 1024], 256, 256, 128),  # equal lengths: the cache read in place
])
def test_with_kvcache_on_the_gpu_equals_the_fp64_call(dtype, seqlens, sq, new, head_dim):
    gen = torch.Generator().manual_seed(len(seqlens) * 1000 + sq)
    batch, heads, kv_heads, cache_len = len(seqlens), 8, 2, 2048
    host = [torch.randn(s, generator=gen, dtype=torch.float64) for s in (
        (batch, sq, heads, head_dim), (batch, cache_len, kv_heads, head_dim), (batch, cache_len, kv_heads, head_dim),
        (batch, new, kv_heads, head_dim), (batch, new, kv_heads, head_dim))]
    q, k_cache, v_cache, k, v = (t.to(dtype).cuda() for t in host)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    out, lse = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths.cuda(), causal=True,
                                           return_softmax_lse=True)
    ref = [t.cpu().double() for t in (q, k_cache, v_cache, k, v)]  # the same rounded inputs, in fp64
    ref_out, ref_lse = fa2.flash_attn_with_kvcache(*ref, cache_seqlens=lengths, causal=True,
                                                   return_softmax_lse=True)
    for b, end in enumerate(seqlens):  # the new rows went into the CUDA cache in place
        assert torch.equal(k_cache[b, end:end + new], k[b]) and torch.equal(v_cache[b, end:end + new], v[b])
    assert rel_error(out.cpu(), ref_out) < REL_TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert float((lse.cpu().double() - ref_lse)[finite].abs().max()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_with_kvcache_on_a_paged_gpu_cache_equals_the_fp64_call(dtype):
    """A paged CUDA cache (blocks of 256 rows in shuffled order, as an inference engine hands them out): the new
    rows land in the blocks the table names, and the result is the fp64 call's on the same pages."""
    gen = torch.Generator().manual_seed(11)
    seqlens, sq, new, heads, kv_heads, head_dim, page, blocks = [700, 33, 1500], 1, 1, 8, 2, 128, 256, 32
    batch, per_seq = len(seqlens), 8
    host = [torch.randn(s, generator=gen, dtype=torch.float64) for s in (
        (batch, sq, heads, head_dim), (blocks, page, kv_heads, head_dim), (blocks, page, kv_heads, head_dim),
        (batch, new, kv_heads, head_dim), (batch, new, kv_heads, head_dim))]
    q, k_pages, v_pages, k, v = (t.to(dtype).cuda() for t in host)
    table = torch.randperm(blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    ref = [t.cpu().double() for t in (q, k_pages, v_pages, k, v)]  # the same rounded inputs, in fp64
    out, lse = fa2.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=lengths.cuda(),
                                           block_table=table.cuda(), causal=True, return_softmax_lse=True)
    ref_out, ref_lse = fa2.flash_attn_with_kvcache(*ref, cache_seqlens=lengths, block_table=table, causal=True,
                                                   return_softmax_lse=True)
    for b, end in enumerate(seqlens):
        block, row = int(table[b, end // page]), end % page
        assert torch.equal(k_pages[block, row], k[b, 0]) and torch.equal(v_pages[block, row], v[b, 0])
    assert rel_error(out.cpu(), ref_out) < REL_TOL[dtype]
    assert float((lse.cpu().double() - ref_lse).abs().max()) < 1e-3


def test_flash_attn_4_varlen_with_a_page_table_on_the_gpu_equals_the_fp64_call():
    """flash-attn 4's paged varlen call (page_table, seqused_k; packed queries with seqused_q) on CUDA tensors against
    the same call in fp64 on the CPU."""
    from fa4dist.compat import flash_attn_cute as fa4

    gen = torch.Generator().manual_seed(12)
    rows_q, used_q, used_k, heads, kv_heads, d, page, pages = [300, 1, 64], [300, 1, 40], [1000, 513, 64], 8, 2, \
        128, 128, 40
    dtype = torch.bfloat16
    host = [torch.randn(s, generator=gen, dtype=torch.float64) for s in (
        (sum(rows_q), heads, d), (pages, page, kv_heads, d), (pages, page, kv_heads, d))]
    q, k, v = (t.to(dtype).cuda() for t in host)
    table = torch.randperm(pages, generator=gen)[:24].view(3, 8).to(torch.int32)
    cu_q = torch.tensor([0, *rows_q]).cumsum(0).to(torch.int32)
    args = dict(cu_seqlens_q=cu_q, seqused_q=torch.tensor(used_q, dtype=torch.int32), page_table=table,
                seqused_k=torch.tensor(used_k, dtype=torch.int32), causal=True, return_lse=True)
    out, lse = fa4.flash_attn_varlen_func(q, k, v, **{n: t.cuda() if isinstance(t, torch.Tensor) else t
                                                      for n, t in args.items()})
    ref_out, ref_lse = fa4.flash_attn_varlen_func(*(t.cpu().double() for t in (q, k, v)), **args)
    assert rel_error(out.cpu(), ref_out) < REL_TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert float((lse.cpu().double() - ref_lse)[finite].abs().max()) < 1e-3
