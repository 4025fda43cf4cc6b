"""fa4dist.data.sharding: a packed sample's plan and this rank's shard, checked alike at every cp size."""

import pytest
import torch

from fa4dist.data.packing import IGNORE, PackedTokenStream
from fa4dist.data.sharding import SingleRankPlan, make_sample_plan, shard_sample


def _sample():
    return PackedTokenStream(["abcdefg", "hijklmnopqrs", "tuv"], seqlen=16, seed=0).window(0)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_the_shards_cover_every_label_once(cp):
    sample = _sample()
    plan = make_sample_plan(sample, cp)
    shards = [shard_sample(sample, plan, r) for r in range(cp)]
    labels = torch.cat([s.labels for s in shards])
    assert sorted(labels[labels != IGNORE].tolist()) == sorted(sample.labels[sample.labels != IGNORE].tolist())
    assert isinstance(plan, SingleRankPlan) == (cp == 1)


@pytest.mark.parametrize("cp, num_chunks", [(2, 6), (3, None), (3, 9)])
def test_the_shards_are_the_samples_own_tokens_without_padding(cp, num_chunks):
    """16 tokens in chunks that do not divide them (6 of 3, the last short; 24 of 1, 8 of them empty; 9 of 2, the
    last empty): the ranks hold the sample's tokens, labels and positions, nothing added, in the plan's order."""
    sample = _sample()
    plan = make_sample_plan(sample, cp, num_chunks=num_chunks)
    assert plan.padded_len > sample.tokens.numel()
    shards = [shard_sample(sample, plan, r) for r in range(cp)]
    assert sum(s.tokens.numel() for s in shards) == sample.tokens.numel()
    for field in ("tokens", "labels", "positions"):
        got = plan.unshard([getattr(s, field) for s in shards], seq_dim=0)
        assert torch.equal(got, getattr(sample, field)), field


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(balancer="nope"), ValueError, "balancer must be one of"),
    (dict(num_chunks=-1), ValueError, "num_chunks must be >= 1"),
    (dict(num_chunks="x"), TypeError, "num_chunks must be an int"),
])
def test_bad_plan_arguments_are_refused_at_every_cp_size(cp, kwargs, error, message):
    with pytest.raises(error, match=message):
        make_sample_plan(_sample(), cp, **kwargs)


def test_a_single_rank_plan_has_rank_0_only_and_checks_its_boundaries():
    sample = _sample()
    plan = make_sample_plan(sample, 1)
    for rank in (1, -1):
        with pytest.raises(ValueError, match=f"a single-rank plan has only rank 0, got {rank}"):
            shard_sample(sample, plan, rank)
    for rank in (0.0, False, None):  # 0.0 and False were taken at cp 1 (refused at cp > 1), None too
        with pytest.raises(TypeError, match=f"rank must be an int, got {type(rank).__name__}"):
            shard_sample(sample, plan, rank)
    with pytest.raises(TypeError, match="rank must be an int, got float"):
        plan.positions(0.0)
    assert torch.equal(plan.positions(), plan.positions(0))  # the identity needs no rank
    with pytest.raises(ValueError, match="cu_seqlens needs at least 2 entries"):
        SingleRankPlan([])
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        SingleRankPlan([0, 5, 3])
    assert "max/mean compute over ranks = 1.0000" in str(plan.balance_report())


@pytest.mark.parametrize("cp", [1, 2])
def test_a_plan_of_another_sample_is_refused_at_every_cp_size(cp):
    sample = _sample()
    other = PackedTokenStream(["abc", "de"], seqlen=8, seed=0).window(0)
    with pytest.raises(ValueError, match="has 16 tokens along seq_dim=0, but the plan expects 8"):
        shard_sample(sample, make_sample_plan(other, cp), 0)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("end", [10, 12])
def test_a_sample_whose_documents_do_not_cover_its_tokens_is_refused_by_name(cp, end):
    """cu_seqlens ending before or past the tokens made a plan, and shard_sample then said "x has 11 tokens along
    seq_dim=0, but the plan expects 10": an argument the caller never gave, against the sample's own plan."""
    from fa4dist.data.packing import Sample

    tokens = torch.arange(11)
    bad = Sample(tokens, tokens.clone(), tokens.clone(), torch.tensor([0, 5, end], dtype=torch.int32))
    with pytest.raises(ValueError, match=f"sample.cu_seqlens ends at {end} but sample.tokens holds 11 tokens"):
        make_sample_plan(bad, cp)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_a_plan_of_other_documents_of_the_same_length_is_refused_at_every_cp_size(cp):
    """A plan of another sample as long as this one was taken: the model attended within the plan's documents while
    the labels and positions followed the sample's (a silent wrong loss)."""
    from fa4dist.data.packing import Sample, positions_from_cu_seqlens

    def sample(cu):
        cu = torch.tensor(cu, dtype=torch.int32)
        tokens = torch.arange(int(cu[-1]))
        return Sample(tokens, tokens.clone(), positions_from_cu_seqlens(cu), cu)

    this, other = sample([0, 10, 20]), sample([0, 5, 20])
    with pytest.raises(ValueError, match=r"plan is for the documents cu_seqlens \[0, 5, 20\], but the sample's are "
                                         r"\[0, 10, 20\]"):
        shard_sample(this, make_sample_plan(other, cp), 0)
    if cp > 1:  # a plan of one dense sequence (make_plan(20, cp)) serves a sample of one document only
        from fa4dist.context_parallel import make_plan

        shard_sample(sample([0, 20]), make_plan(20, cp), 0)
        with pytest.raises(ValueError, match=r"plan is for the documents cu_seqlens \[0, 20\]"):
            shard_sample(this, make_plan(20, cp), 0)


@pytest.mark.parametrize("cp, balancer", [(2, "lpt"), (2, "zigzag"), (3, "contiguous")])
def test_the_shards_carry_the_samples_own_positions(cp, balancer):
    """Positions that do not restart at every document (a document continued from the previous window) reach the
    ranks as they are, as at cp 1: not replaced by positions recomputed from cu_seqlens."""
    from fa4dist.data.packing import Sample

    s = _sample()
    sample = Sample(s.tokens, s.labels, s.positions + 5, s.cu_seqlens)
    single = shard_sample(sample, make_sample_plan(sample, 1), 0).positions
    plan = make_sample_plan(sample, cp, balancer=balancer)
    got = plan.unshard([shard_sample(sample, plan, r).positions for r in range(cp)], seq_dim=0)
    assert torch.equal(got, sample.positions) and torch.equal(single, sample.positions)


@pytest.mark.parametrize("cp", [1, 2])
def test_a_plan_or_sample_of_another_kind_is_refused_by_name(cp):
    """shard_sample(sample, None, 0) and make_sample_plan(tensor, ...) were AttributeErrors."""
    sample = _sample()
    plan = make_sample_plan(sample, cp)
    with pytest.raises(TypeError, match="plan must be a sharding plan .*got NoneType"):
        shard_sample(sample, None, 0)
    with pytest.raises(TypeError, match=r"sample must be a fa4dist.data.Sample, got torch.Tensor"):
        shard_sample(sample.tokens, plan, 0)
    with pytest.raises(TypeError, match=r"sample must be a fa4dist.data.Sample, got dict"):
        make_sample_plan(dict(cu_seqlens=sample.cu_seqlens), cp)


@pytest.mark.parametrize("cu", [[0, 0, 3, 3, 3, 8, 8], [0, 5, 5, 9], [0, 0, 4], [0, 4, 4], [0, 2, 6]])
def test_a_single_rank_plans_local_segments_are_the_sharded_plans(cu):
    """SingleRankPlan.local_cu_seqlens returned the sample's cu_seqlens as they were, zero-length documents included,
    while a ShardPlan's local segments (what every consumer of a plan reads, the cp=1 ShardPlan's too) drop them: a
    model saw other segment boundaries (and counts) for one sample at cp 1 through make_sample_plan than through
    make_plan(cu, 1)."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.models.attention import LocalPackedAttention

    single, sharded = SingleRankPlan(cu), make_plan(cu, 1)
    got, want = single.local_cu_seqlens(), sharded.local_cu_seqlens(0)
    assert got.dtype == want.dtype == torch.int32 and got.tolist() == want.tolist(), (got, want)
    assert all(b > a for a, b in zip(got.tolist(), got.tolist()[1:]))  # no zero-length segment
    assert torch.equal(single.local_cu_seqlens(0), got)
    for plan in (make_plan(cu, 2, num_chunks=4), make_plan(cu, 3, num_chunks=3)):  # the same rule at cp > 1
        segments = [plan.local_cu_seqlens(r).tolist() for r in range(plan.cp_size)]
        assert all(b > a for s in segments for a, b in zip(s, s[1:])), segments
    attention = LocalPackedAttention()
    assert torch.equal(attention._cu_seqlens(single, "cpu"), attention._cu_seqlens(sharded, "cpu"))


@pytest.mark.parametrize("cp", [1, 2])
def test_device_0_is_cuda_0_not_the_samples_device(cp):
    """device=0 (torch's cuda:0, as a local rank is often given) was falsy and ignored: the shard stayed on the
    sample's device (the CPU) silently while ranks 1.. moved to theirs. Without CUDA, moving there must fail."""
    sample = _sample()
    plan = make_sample_plan(sample, cp)
    if torch.cuda.is_available():
        local = shard_sample(sample, plan, 0, device=0)
        assert {t.device for t in (local.tokens, local.labels, local.positions)} == {torch.device("cuda", 0)}
    else:
        with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda|accelerator"):
            shard_sample(sample, plan, 0, device=0)
    assert shard_sample(sample, plan, 0, device="cpu").tokens.device == torch.device("cpu")
