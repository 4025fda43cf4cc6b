"""The Ulysses head split's chunks (fa4dist.context_parallel.ulysses): how many a split allows, that they cut each
member's heads into runs of whole key/value head groups, and the environment variable that asks for them."""

import pytest

from fa4dist.context_parallel.ulysses import CHUNKS_ENV, MAX_CHUNKS, HeadSplit, requested_chunks


@pytest.mark.parametrize("heads_q, heads_kv, degree, asked, want", [
    (32, 8, 2, 1, 1), (32, 8, 2, 3, 2), (32, 8, 2, 4, 4), (32, 8, 2, 64, 4),  # 4 key/value heads per member
    (12, 6, 2, 2, 1), (12, 6, 2, 3, 3),  # 3 per member: 2 does not cut them evenly
    (8, 1, 2, 4, 1), (8, 2, 4, 4, 1),  # replicated key/value heads: their gradients are summed over members
    (32, 32, 4, 16, 8),  # no GQA: 8 heads per member
])
def test_chunk_count_is_the_largest_that_cuts_every_member_evenly(heads_q, heads_kv, degree, asked, want):
    assert HeadSplit.check(heads_q, heads_kv, degree, degree).chunk_count(asked) == want


@pytest.mark.parametrize("heads_q, heads_kv, degree, count", [(32, 8, 2, 4), (32, 8, 4, 2), (12, 6, 2, 3),
                                                              (16, 16, 2, 8)])
def test_chunks_cut_each_members_heads_into_whole_groups(heads_q, heads_kv, degree, count):
    split = HeadSplit.check(heads_q, heads_kv, degree, degree)
    group = heads_q // heads_kv
    chunks = split.chunks(count)
    for j in range(degree):
        q_runs = [c.q_heads(j) for c in chunks]
        kv_runs = [c.kv_heads(j) for c in chunks]
        assert q_runs[0][0] == split.q_heads(j)[0] and q_runs[-1][1] == split.q_heads(j)[1]
        assert kv_runs[0][0] == split.kv_heads(j)[0] and kv_runs[-1][1] == split.kv_heads(j)[1]
        for (qa, qb), (ka, kb), following in zip(q_runs, kv_runs, q_runs[1:] + [None]):
            assert qb > qa and (following is None or following[0] == qb)  # contiguous, in order
            assert (qa // group, (qb - 1) // group + 1) == (ka, kb)  # the chunk's query heads read its kv heads
            assert (qb - qa) == (kb - ka) * group  # whole groups


def test_requested_chunks_reads_the_environment(monkeypatch):
    monkeypatch.delenv(CHUNKS_ENV, raising=False)
    assert requested_chunks() == 1
    monkeypatch.setenv(CHUNKS_ENV, "4")
    assert requested_chunks() == 4
    for bad in ("0", "-1", "two", "2.5", str(MAX_CHUNKS + 1)):
        monkeypatch.setenv(CHUNKS_ENV, bad)
        with pytest.raises(ValueError, match=f"{CHUNKS_ENV} must be an int in \\[1, {MAX_CHUNKS}\\].*got '{bad}'"):
            requested_chunks()
