"""cp_cross_entropy, invariant_sum and reduce_value (fa4dist/models/loss.py): argument checks, the shares of a cp
group adding up to the whole sequence's loss, the exact value's bits at every cp size, and ranks that call them
differently raising the same error on every rank (CPU gloo, ranks 0 and 1 of a 4-rank pool) instead of a gloo
abort, a hang or a silently local result."""

import pytest
import torch
import torch.nn.functional as F

from cp_harness import GROUPS, fresh_group, shared_pool
from fa4dist.data.packing import IGNORE
from fa4dist.models import cp_cross_entropy, invariant_sum

pytestmark = pytest.mark.timeout(300)

VOCAB = 11


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


def _inputs(tokens=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    labels[::5] = IGNORE
    return torch.randn(tokens, VOCAB, generator=gen), labels


@pytest.mark.parametrize("logits, labels, error, message", [
    (torch.zeros(1, 4, VOCAB), torch.zeros(4, dtype=torch.long), ValueError,
     r"logits must be 2-D \(local_tokens, vocab\) with vocab >= 1, got shape \(1, 4, 11\)"),
    (torch.zeros(4, 0), torch.zeros(4, dtype=torch.long), ValueError, "with vocab >= 1, got shape"),
    (torch.zeros(4, VOCAB, dtype=torch.long), torch.zeros(4, dtype=torch.long), TypeError,
     "logits must have a floating-point dtype, got torch.int64"),
    (torch.zeros(4, VOCAB), torch.zeros(1, 4, dtype=torch.long), ValueError,
     r"labels must be 1-D with one label per logits row \(4\), got shape \(1, 4\)"),
    (torch.zeros(4, VOCAB), torch.zeros(5, dtype=torch.long), ValueError, r"got shape \(5,\)"),
    (torch.zeros(4, VOCAB), torch.zeros(4), TypeError, "labels must have an integer dtype .* got torch.float32"),
    (torch.zeros(4, VOCAB), torch.zeros(4, dtype=torch.bool), TypeError, "integer dtype"),
    (torch.zeros(4, VOCAB), [0, 1, 2, 3], TypeError, "labels must be a torch.Tensor, got list"),
    (torch.zeros(4, VOCAB), torch.tensor([0, 1, VOCAB, 3]), ValueError,
     r"labels hold 1 id\(s\) outside the vocabulary \[0, 11\) that are not IGNORE \(-100\), e.g. 11"),
    (torch.zeros(4, VOCAB), torch.tensor([0, -1, -100, 3]), ValueError, r"e.g. -1"),
])
def test_bad_arguments_are_refused_by_name(logits, labels, error, message):
    with pytest.raises(error, match=message):
        cp_cross_entropy(logits, labels)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "60", True])
def test_a_bad_timeout_is_refused_without_a_group(timeout):
    """Taken silently at cp 1 (no wait), refused at cp > 1: checked alike at every size."""
    from fa4dist.models import reduce_value

    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        cp_cross_entropy(*_inputs(), timeout=timeout)
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        reduce_value(torch.ones(()), timeout=timeout)



@pytest.mark.parametrize("op", ["max", 3, None])
def test_a_bad_reduce_op_is_refused_without_a_group(op):
    """Taken silently without a group (a plain copy), refused on a group of several ranks: checked alike."""
    from fa4dist.models import reduce_value

    with pytest.raises(TypeError, match=f"op must be a torch.distributed.ReduceOp, got {type(op).__name__}"):
        reduce_value(torch.ones(()), op=op)
    assert reduce_value(torch.ones(2), op=torch.distributed.ReduceOp.MAX).tolist() == [1.0, 1.0]


def test_integer_labels_of_any_width():
    """int32 labels (F.cross_entropy takes int64 or uint8 only) give the int64 labels' loss."""
    logits, labels = _inputs()
    want = cp_cross_entropy(logits, labels)
    got = cp_cross_entropy(logits, labels.int())
    assert torch.equal(got.loss, want.loss) and got.local_tokens == want.local_tokens == int((labels != IGNORE).sum())


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_labels_of_any_width(dtype):
    """Unsigned labels (no IGNORE: they cannot hold it) give the int64 labels' loss; uint16/32/64 failed inside the
    labels' range check, with torch's NotImplementedError '"lt_cpu" not implemented for 'UInt16''."""
    logits, labels = _inputs()
    labels[labels == IGNORE] = VOCAB - 1
    want = cp_cross_entropy(logits, labels)
    got = cp_cross_entropy(logits, labels.to(dtype))
    assert torch.equal(got.loss, want.loss) and got.local_tokens == want.local_tokens == labels.numel()


@pytest.mark.parametrize("dtype, vocab, ids", [
    (torch.uint8, 200, [156, 1, 2, 3]),  # 156 is -100 wrapped to uint8: it was counted as IGNORE
    (torch.uint8, 300, [50, 1, 2, 3]),  # the vocab wrapped to 44 in uint8: 50 was refused
    (torch.int8, 300, [50, 1, -100, 3]),
    (torch.int16, 40000, [7, 1, 2, -100]),  # the vocab wrapped to -25536 in int16: every id was refused
])
def test_narrow_labels_are_compared_in_int64(dtype, vocab, ids):
    """IGNORE and the vocabulary size were compared with the labels in the labels' own dtype, where they wrap: a
    wrong target count (the loss of 4 tokens divided by 3) or valid ids refused."""
    logits = torch.randn(4, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    wide = torch.tensor(ids)
    got, want = cp_cross_entropy(logits, wide.to(dtype)), cp_cross_entropy(logits, wide)
    assert torch.equal(got.loss, want.loss) and got.local_tokens == want.local_tokens == int((wide != IGNORE).sum())


def _shares(rank, world):
    """cp = 2 over 24 tokens: each rank's share and the whole sequence's mean."""
    if rank >= 2:
        return None
    logits, labels = _inputs(24)
    part = slice(0, 10) if rank == 0 else slice(10, 24)  # unequal shards
    res = cp_cross_entropy(logits[part], labels[part], GROUPS[2])
    return float(res.loss), int(res.tokens), res.local_tokens


def test_shares_add_up_to_the_sequence_loss(pool):
    logits, labels = _inputs(24)
    (a, total, na), (b, total_b, nb) = pool.run(_shares)[:2]
    assert total == total_b == na + nb == int((labels != IGNORE).sum())
    assert abs(a + b - float(F.cross_entropy(logits, labels, ignore_index=IGNORE))) < 1e-6


def _plan_shares(rank, world, cp, balancer):
    """cp = 2, 3, 4 over a packed fp64 sequence cut by a plan (a rank's chunks not contiguous under zigzag / LPT),
    rank 1's labels all IGNORE: this rank's share, its logits' gradient, and the global label count."""
    if rank >= cp:
        return None
    logits, labels, plan = _planned_inputs(cp, balancer)
    local = plan.shard(logits, seq_dim=0, rank=rank).requires_grad_(True)
    res = cp_cross_entropy(local, plan.shard(labels, seq_dim=0, rank=rank), GROUPS[cp])
    res.loss.backward()
    return float(res.loss), local.grad, int(res.tokens)


def _planned_inputs(cp, balancer):
    from fa4dist.context_parallel import make_plan

    logits, labels = _inputs(41, seed=3)
    logits = logits.double()
    plan = make_plan([0, 9, 30, 41], cp, balancer=balancer)
    labels[plan.shard(torch.arange(41), seq_dim=0, rank=1)] = IGNORE  # a rank without targets
    return logits, labels, plan


@pytest.mark.parametrize("cp, balancer", [(2, "zigzag"), (3, "lpt"), (4, "lpt"), (4, "contiguous")])
def test_shares_and_gradients_equal_the_unsharded_loss_in_fp64(pool, cp, balancer):
    results = pool.run(_plan_shares, cp=cp, balancer=balancer)[:cp]
    logits, labels, plan = _planned_inputs(cp, balancer)
    whole = logits.clone().requires_grad_(True)
    want = F.cross_entropy(whole, labels, ignore_index=IGNORE)
    want.backward()
    assert abs(sum(r[0] for r in results) - float(want)) <= 1e-10
    assert all(r[2] == int((labels != IGNORE).sum()) for r in results)
    got = plan.unshard([r[1] for r in results], seq_dim=0)
    assert float((got - whole.grad).abs().max()) <= 1e-10



def _checkpointed_shares(rank, world, selective):
    """_plan_shares at cp 4 with the loss inside an activation checkpoint (its recompute exchanges the label counts
    again); ``selective``: under a policy that saves the communication ops (torch.utils.checkpoint's context_fn)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op).startswith("c10d.") else CheckpointPolicy.PREFER_RECOMPUTE

    group = fresh_group(range(world))  # (a failed exchange must not leave messages on the pool's groups)
    logits, labels, plan = _planned_inputs(world, "lpt")
    local = plan.shard(logits, seq_dim=0, rank=rank).requires_grad_(True)
    local_labels = plan.shard(labels, seq_dim=0, rank=rank)
    context = dict(context_fn=functools.partial(create_selective_checkpoint_contexts, policy)) if selective else {}
    loss = checkpoint(lambda x: cp_cross_entropy(x, local_labels, group, timeout=8).loss, local, use_reentrant=False,
                      **context)
    loss.backward()
    return float(loss), local.grad


@pytest.mark.parametrize("selective", [False, True], ids=["checkpoint", "selective-checkpoint"])
def test_a_checkpointed_loss_gives_the_unsharded_gradient(pool, selective):
    """A selective checkpoint's policy that saved the label counts' all-gather replayed it in the recompute: its
    buffers stayed unfilled, and the agreement check found garbage (torch's 'aten.zeros.default encountered during
    backward but not found in storage' from the disagreement's exchange).  The exchange now runs again."""
    results = pool.run(_checkpointed_shares, selective=selective, timeout=90)
    logits, labels, plan = _planned_inputs(4, "lpt")
    whole = logits.clone().requires_grad_(True)
    want = F.cross_entropy(whole, labels, ignore_index=IGNORE)
    want.backward()
    assert abs(sum(r[0] for r in results) - float(want)) <= 1e-10
    got = plan.unshard([r[1] for r in results], seq_dim=0)
    assert float((got - whole.grad).abs().max()) <= 1e-10

def _disagreeing(rank, world, case):
    """Ranks 0 and 1 of a cp group call cp_cross_entropy, rank 1 differently: the error each raises."""
    if rank >= 2:
        return None
    logits, labels = _inputs(6, seed=rank)
    if rank == 1:
        if case == "dtype":
            logits = logits.double()  # gloo aborted the process (an all-reduce of fp32 with fp64)
        elif case == "vocab":
            logits = torch.cat([logits, logits[:, :1]], 1)
        elif case == "shape":
            logits = logits[None]  # rank 1 raised alone, rank 0 waited in the all-reduce
        elif case == "label":
            labels[2] = VOCAB
        elif case == "grad":
            logits.requires_grad_()
    timeout = -1 if case == "timeout" and rank == 1 else 60.0
    exact = case == "exact" and rank == 1
    try:
        cp_cross_entropy(logits, labels, GROUPS[2], timeout=timeout, exact_value=exact)
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("case, message", [
    ("dtype", "ranks disagree on cp_cross_entropy call .*: dtype: rank 0 'torch.float32', rank 1 'torch.float64'"),
    ("vocab", "ranks disagree on cp_cross_entropy call .*: vocab: rank 0 11, rank 1 12"),
    ("grad", "grad: rank 0 False, rank 1 True"),
    ("exact", "exact_value: rank 0 False, rank 1 True"),  # rank 1 would wait in the exact value's reductions
    ("shape", r"rank 1 rejected its inputs: ValueError: logits must be 2-D .* got shape \(1, 6, 11\)"),
    ("label", r"rank 1 rejected its inputs: ValueError: labels hold 1 id\(s\) outside the vocabulary"),
    # was a CommError on both ranks at once ("did every rank call it?"): the exchange itself waited -1 s
    ("timeout", "rank 1 rejected its inputs: ValueError: timeout must be a positive, finite number of seconds, got -1"),
])
def test_ranks_that_disagree_all_raise(pool, case, message):
    import re

    results = pool.run(_disagreeing, case=case)
    assert results[0] == results[1] and results[0] is not None, results
    kind, text = results[0]
    assert kind == "ValueError" and text.startswith("fa4dist cp_cross_entropy: ") and re.search(message, text), text


def _outsider(rank, world):
    """Ranks 2 and 3 pass the group of ranks 0 and 1 (new_group gives them a non-member placeholder)."""
    from fa4dist.models import reduce_value

    if rank < 2:
        return None
    errors = []
    for call in (lambda: cp_cross_entropy(*_inputs(), GROUPS[2]), lambda: reduce_value(torch.ones(()), GROUPS[2])):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_a_group_without_this_rank_is_refused(pool):
    """Was a silently local loss (and an unreduced value): the group's size is -1 on a non-member."""
    for rank, errors in enumerate(pool.run(_outsider)[2:], start=2):
        assert len(errors) == 2, errors
        assert all(f"is a process group that this rank (global rank {rank}) is not a member of" in e for e in errors)


def _reduce(rank, world, case):
    """reduce_value on ranks 0 and 1, rank 1's call as `case` says; the value or the error on each rank."""
    from fa4dist.context_parallel.comm import CommError
    from fa4dist.models import reduce_value

    group = fresh_group([0, 1])  # a skipped call leaves the group's store exchanges out of step: throw it away
    if rank >= 2:
        return None
    value, op = torch.tensor([1.0 + rank, 5.0 - rank]), torch.distributed.ReduceOp.SUM
    if rank == 1:
        if case == "dtype":
            value = value.double()
        elif case == "shape":
            value = value[:1]
        elif case == "op":
            op = torch.distributed.ReduceOp.MAX
        elif case == "not a tensor":
            value = 3.0
    try:
        if case == "skip" and rank == 1:
            return None
        timeout = 1.0 if case == "skip" else 0 if case == "timeout" and rank == 1 else 60.0
        return reduce_value(value, group, op, timeout=timeout).tolist()
    except (TypeError, ValueError, CommError) as err:
        return type(err).__name__, str(err)


@pytest.mark.parametrize("case, message", [
    ("dtype", "dtype: rank 0 'torch.float32', rank 1 'torch.float64'"),
    ("shape", r"shape: rank 0 \[2\], rank 1 \[1\]"),
    ("op", "op: rank 0 'SUM', rank 1 'MAX'"),
])
def test_reduce_value_calls_that_differ_all_raise(pool, case, message):
    import re

    results = pool.run(_reduce, case=case)
    assert results[0] == results[1] and results[0] is not None, results
    kind, text = results[0]
    want = f"^fa4dist reduce_value: ranks disagree on reduce_value call 1: {message}"
    assert kind == "ValueError" and re.search(want, text), text


def test_reduce_value_agreement_and_failures(pool):
    assert pool.run(_reduce, case="same")[:2] == [[3.0, 9.0]] * 2
    (kind0, text0), (kind1, text1) = pool.run(_reduce, case="not a tensor")[:2]
    assert text0 == text1 and "rank 1 rejected its inputs: TypeError: value must be a torch.Tensor, got float" in text0
    assert (kind0, kind1) == ("ValueError", "TypeError")  # rank 0 does not wait for rank 1's refused call
    (kind0, text0), (kind1, text1) = pool.run(_reduce, case="timeout")[:2]  # rank 1's own wait was 0 s
    assert (kind0, kind1) == ("ValueError", "ValueError") and text0 == text1, (text0, text1)
    assert "rank 1 rejected its inputs: ValueError: timeout must be a positive, finite number of seconds, got 0" \
        in text0
    kind, text = pool.run(_reduce, case="skip")[0]
    assert kind == "CommError" and "failed waiting for the agreement check of reduce_value call 1" in text, text


@pytest.mark.parametrize("holder, intruder", [("attention", "cp_cross_entropy"), ("attention", "reduce_value"),
                                              ("cp_cross_entropy", "attention"), ("reduce_value", "cp_cross_entropy")])
def test_a_second_thread_on_the_group_is_refused_at_once(pool, holder, intruder):
    """The losses' and reduce_value's exchanges did not take the group's thread guard (comm.exclusive) that the
    attention takes: a call from a second thread while another call ran on the group went ahead, pairing up
    differently on different ranks (here: waiting out its timeout for a call the other rank never makes).  Now it is
    refused at once, and the call that held the group raises when it ends (its partners may have been mismatched)."""
    import uuid

    import cp_cases

    (refused, held), theirs = pool.run(cp_cases.intruding_thread_case, key=f"intrude-{uuid.uuid4().hex}",
                                       holder=holder, intruder=intruder, timeout=60)[:2]
    kind, message, seconds = refused
    assert kind == "RuntimeError" and "one thread at a time" in message and seconds < 2, refused
    assert held is not None and held[0] == "RuntimeError" and "not trusted" in held[1], held
    assert (intruder if intruder != "attention" else "forward call") in held[1], held  # names the intruding call
    assert theirs is None


def _without_targets(rank, world, where):
    """One fp64 sequence of 10 tokens, without a target anywhere (``where="all"``) or in its first 5 tokens only
    (``"rank 0"``: cp rank 0's whole shard): cp_cross_entropy and tiled_cp_cross_entropy at cp 1 (no group, and
    a one-rank gloo group) on rank 0 and at cp 2 (two contiguous shards) on ranks 0 and 1.  Per layout: this
    rank's (loss, label tokens, logits' gradient, tiled loss, hidden states' gradient)."""
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    gen = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(10, 5, generator=gen, dtype=torch.float64), torch.randn(VOCAB, 5, generator=gen,
                                                                                         dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (10,), generator=gen)
    labels[:10 if where == "all" else 5] = IGNORE
    results = {}
    for name, cp, group in (("none", 1, None), ("gloo 1", 1, GROUPS[1]), ("gloo 2", 2, GROUPS[2])):
        if rank >= cp:
            continue
        part = slice(0, 10) if cp == 1 else slice(5 * rank, 5 * rank + 5)
        h = hidden[part].clone().requires_grad_(True)
        logits = (h @ weight.t()).detach().requires_grad_(True)
        res = cp_cross_entropy(logits, labels[part], group)
        res.loss.backward()
        tiled = tiled_cp_cross_entropy(h, weight, labels[part], group, chunk_tokens=2)
        tiled.backward()
        results[name] = (res.loss.item(), res.tokens.item(), logits.grad, tiled.item(), h.grad)
    return results


def test_a_sequence_without_targets_gives_zero_at_every_cp_size(pool):
    """No target in the whole sequence (every label IGNORE, on every rank): the loss is 0 with zero gradients at
    cp 1 and cp 2, on every rank, for both losses (documented in cp_cross_entropy: torch's mean cross entropy and
    the transformers models' loss are NaN there, which would poison every replica's gradients)."""
    logits = torch.zeros(3, VOCAB, dtype=torch.float64)
    assert torch.isnan(F.cross_entropy(logits, torch.full((3,), IGNORE), ignore_index=IGNORE))  # what we differ from
    per_rank = pool.run(_without_targets, where="all")[:2]
    calls = [(rank, name, got) for rank, results in enumerate(per_rank) for name, got in results.items()]
    assert len(calls) == 4, calls  # cp 1 twice on rank 0, cp 2 on ranks 0 and 1
    for rank, name, (loss, tokens, grad, tiled, hidden_grad) in calls:
        assert (loss, tokens, tiled) == (0.0, 0.0, 0.0), (rank, name)
        assert not grad.any() and not hidden_grad.any(), (rank, name)


def test_a_rank_without_targets_still_gives_the_global_mean(pool):
    """cp rank 0's shard has no target, rank 1's has: rank 0's share is 0 and the shares add up to the mean over
    the whole sequence's targets, as at cp 1, for both losses and their gradients."""
    (first, second) = pool.run(_without_targets, where="rank 0")[:2]
    tol = 64 * torch.finfo(torch.float64).eps
    for name in ("none", "gloo 1"):
        loss, tokens, grad, tiled, hidden_grad = first[name]
        shares = [first["gloo 2"], second["gloo 2"]]
        assert shares[0][0] == 0.0 and shares[0][3] == 0.0 and tokens == shares[0][1] == shares[1][1] == 5.0
        assert abs(shares[0][0] + shares[1][0] - loss) <= tol * abs(loss), (name, shares, loss)
        assert abs(shares[0][3] + shares[1][3] - tiled) <= tol * abs(tiled), (name, shares, tiled)
        assert abs(loss - tiled) <= tol * abs(loss)
        assert float((torch.cat([shares[0][2], shares[1][2]]) - grad).abs().max()) <= tol * float(grad.abs().max())
        assert float((torch.cat([shares[0][4], shares[1][4]]) - hidden_grad).abs().max()) <= \
            tol * float(hidden_grad.abs().max())


def _exact_values(rank, world, dtype):
    """The mean loss of one 97-token sequence (a fifth of the labels IGNORE) with exact_value=True, at cp 1 without
    a group and at cp 1-4 on gloo, the tokens cut by a plan into uneven, non-contiguous shards: per layout this
    rank's (value, share)."""
    from fa4dist.context_parallel import make_plan

    gen = torch.Generator().manual_seed(11)
    logits = (8 * torch.randn(97, VOCAB, generator=gen)).to(dtype)  # wide logits: losses from ~0 to ~60
    labels = torch.randint(0, VOCAB, (97,), generator=gen)
    labels[::5] = IGNORE
    got = {}
    for cp, balancer in ((1, None), (1, "contiguous"), (2, "zigzag"), (3, "lpt"), (4, "lpt")):
        if rank >= cp:
            continue
        group, plan = (None, None) if balancer is None else (GROUPS[cp], make_plan([0, 40, 97], cp, balancer=balancer))
        mine = (logits, labels) if plan is None else (plan.shard(logits, seq_dim=0, rank=rank),
                                                    plan.shard(labels, seq_dim=0, rank=rank))
        res = cp_cross_entropy(*mine, group, exact_value=True)
        got[f"cp {cp} {balancer}"] = (res.value.item(), res.loss.item())
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_exact_value_has_the_same_bits_at_every_cp_size(pool, dtype):
    """exact_value=True: every rank of every layout (cp 1 with and without a group, cp 2-4 under zigzag / LPT
    plans) gets the same fp64 value, which is the mean of the fp32 (fp64) token losses within the fixed point's
    bound; the shares still add up to it within their own rounding."""
    per_rank = pool.run(_exact_values, dtype=dtype)
    values = {got[0] for results in per_rank for got in results.values()}
    assert len(values) == 1, per_rank
    gen = torch.Generator().manual_seed(11)
    logits = (8 * torch.randn(97, VOCAB, generator=gen)).to(dtype)
    labels = torch.randint(0, VOCAB, (97,), generator=gen)
    labels[::5] = IGNORE
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    per_token = F.cross_entropy(logits.to(compute), labels, ignore_index=IGNORE, reduction="none")
    want = float(per_token.double().sum()) / int((labels != IGNORE).sum())
    # n terms below 2^e: each truncated by less than 2^(e - 61), then one fp64 rounding of the sum
    bound = 97 * 97 * float(per_token.abs().max()) * 2.0 ** -60 + 2 * torch.finfo(torch.float64).eps * abs(want)
    assert abs(values.pop() - want) <= bound
    eps = torch.finfo(compute).eps
    for cp in (2, 3, 4):
        key = [k for k in per_rank[0] if k.startswith(f"cp {cp} ")][0]
        shares = sum(per_rank[r][key][1] for r in range(cp))
        assert abs(shares - want) <= 97 * eps * float(per_token.abs().max()), (cp, shares, want)


def _split_sums(rank, world, pieces):
    """invariant_sum of this rank's piece of fixed terms (pieces: one slice per rank of GROUPS[len(pieces)])."""
    if rank >= len(pieces):
        return None
    return invariant_sum(_terms()[pieces[rank]], GROUPS[len(pieces)]).item()


def _terms():
    """Terms over 60 orders of magnitude and both signs, whose float sums depend on their order."""
    gen = torch.Generator().manual_seed(5)
    return torch.randn(200, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (200,), generator=gen)


@pytest.mark.parametrize("pieces", [
    [slice(0, 200)],
    [slice(0, 13), slice(13, 200)],
    [slice(0, 0), slice(0, 150), slice(150, 200)],  # a rank without terms
    [slice(0, 50), slice(50, 51), slice(51, 120), slice(120, 200)],
])
def test_invariant_sum_has_the_same_bits_for_every_split(pool, pieces):
    terms = _terms()
    alone = invariant_sum(terms)  # not distributed: this process's terms
    assert all(invariant_sum(terms[torch.randperm(200)]).item() == alone.item() for _ in range(3))
    got = pool.run(_split_sums, pieces=pieces)[:len(pieces)]
    assert got == [alone.item()] * len(pieces)
    # against the exact sum (fractions): n terms below 2^e, each truncated by less than 2^(e - 61)
    from fractions import Fraction

    exact = float(sum(Fraction(float(t)) for t in terms))
    assert abs(alone.item() - exact) <= 200 * 200 * float(terms.abs().max()) * 2.0 ** -60


def test_invariant_sum_of_non_finite_terms_and_bad_input():
    inf, nan = float("inf"), float("nan")
    assert invariant_sum(torch.tensor([1.0, inf, 2.0])).item() == inf
    assert invariant_sum(torch.tensor([-inf, 1.0])).item() == -inf
    assert torch.isnan(invariant_sum(torch.tensor([inf, -inf])))
    assert torch.isnan(invariant_sum(torch.tensor([1.0, nan])))
    assert invariant_sum(torch.zeros(0)).item() == 0.0
    assert invariant_sum(torch.tensor([[1.5, -0.25], [0.75, 2.0]], dtype=torch.bfloat16)).item() == 4.0
    with pytest.raises(TypeError, match="terms must be a floating-point torch.Tensor, got torch.int64"):
        invariant_sum(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="terms must be a floating-point torch.Tensor, got list"):
        invariant_sum([1.0])
    with pytest.raises(TypeError, match="exact_value must be a bool, got int"):
        cp_cross_entropy(*_inputs(), exact_value=1)


def _meshes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    logits, labels = _inputs(seed=rank)
    x = torch.tensor([rank + 0.25])
    got = (invariant_sum(x, grid).item(), cp_cross_entropy(logits, labels, grid, exact_value=True).value.item())
    world_group = torch.distributed.group.WORLD
    want = (invariant_sum(x, world_group).item(),
            cp_cross_entropy(logits, labels, world_group, exact_value=True).value.item())
    replicas = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    try:
        invariant_sum(x, replicas)
        refused = None
    except ValueError as err:
        refused = str(err)
    return got, want, refused


def test_a_ring_by_ulysses_mesh_is_the_group_of_all_its_ranks(pool):
    """The model and the attention take a 2-D ("ring", "ulysses") mesh as their cp group; the losses failed on it
    with torch's "needs mesh_dim". They sum over all its ranks now, and a 2-D mesh of other dims (a (dp, cp) one
    would sum over the replicas too) is refused, naming what to pass."""
    for got, want, refused in pool.run(_meshes):
        assert got == want
        assert "mesh_dim_names=('ring', 'ulysses')" in refused and "mesh['cp']" in refused, refused
