"""Context-parallel attention as training loops use it, on 4 CPU processes (gloo), in fp64 against the single-process
fp64 oracle: activation checkpointing (reentrant, non-reentrant and selective: its recompute calls the attention
again), gradient accumulation with an evaluation forward and an unused forward in between, a backward run twice
(retain_graph), a rank whose loss skips the attention, and DDP / FSDP2 over a dp group around cp layers of
different windows."""

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import cp_cases
from cp_harness import GROUPS, fresh_group, shared_pool
from oracle import naive_attention

pytestmark = pytest.mark.timeout(240)

TOL = 1e-10  # fp64 against the fp64 oracle


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


def _problem(module, seed=0):
    """(plan, shard function, global q, k, v, dout) of a packed sample for `module`."""
    plan = module.make_plan(cp_cases.random_docs(2, 6, 20))
    q, k, v, dout = cp_cases.global_inputs(seed, plan.total_len, 4, 2, 8, torch.float64)
    return plan, functools.partial(plan.shard, seq_dim=0, rank=module.cp_rank), (q, k, v, dout)


def _oracle(plan, q, k, v, dout):
    """out, dq, dk, dv of the whole sequence."""
    cu = torch.tensor(plan.cu_seqlens, dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = naive_attention(*leaves, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)[0]
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _errors(got, want, shard):
    return max(float((a.detach() - shard(b)).abs().max()) for a, b in zip(got, want))


# ---- checkpointing, accumulation, evaluation, retain_graph ------------------------------------------------------


def loop_case(rank, world, strategy, ulysses_degree, reentrant):
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(GROUPS[4], strategy=strategy, ulysses_degree=ulysses_degree,
                                         backend="reference", timeout=30)
    plan, shard, (q, k, v, dout) = _problem(module)
    want = _oracle(plan, q, k, v, dout)
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    errors = []
    for _ in range(2):  # two micro-batches: the gradients add up
        out = checkpoint(lambda a, b, c: module(a, b, c, plan=plan), *leaves, use_reentrant=reentrant)
        with torch.no_grad():  # an evaluation forward between the forward and its backward
            errors.append(_errors([module(*(shard(t) for t in (q, k, v)), plan=plan)], want[:1], shard))
        module(*(x * 1 for x in leaves), plan=plan)  # a forward nothing back-propagates through
        (out * shard(dout)).sum().backward()
        errors.append(_errors([out], want[:1], shard))
    errors.append(_errors([x.grad / 2 for x in leaves], want[1:], shard))
    for x in leaves:
        x.grad = None
    out = checkpoint(lambda a, b, c: module(a, b, c, plan=plan), *leaves, use_reentrant=reentrant)
    loss = (out * shard(dout)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    errors.append(_errors([x.grad / 2 for x in leaves], want[1:], shard))
    return max(errors)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("strategy, degree", [("ring", None), ("hybrid", 2)])
def test_checkpointing_accumulation_evaluation_and_retain_graph(pool, strategy, degree, reentrant):
    assert max(pool.run(loop_case, strategy=strategy, ulysses_degree=degree, reentrant=reentrant)) < TOL


# ---- selective activation checkpointing -------------------------------------------------------------------------


def _policy(saved, ctx, op, *args, **kwargs):
    """Saves the ops named in `saved` (by their name's start), recomputes the rest."""
    return CheckpointPolicy.MUST_SAVE if str(op).startswith(saved) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_case(rank, world, strategy, ulysses_degree, saved):
    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group(range(world))  # (a failed exchange must not leave messages on the pool's groups)
    module = FA4ContextParallelAttention(group, strategy=strategy, ulysses_degree=ulysses_degree,
                                         backend="reference", timeout=8)
    plan, shard, (q, k, v, dout) = _problem(module)
    want = _oracle(plan, q, k, v, dout)
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, saved))
    out = checkpoint(lambda a, b, c: module(a, b, c, plan=plan), *leaves, use_reentrant=False, context_fn=context)
    (out * shard(dout)).sum().backward()
    return _errors([out] + [x.grad for x in leaves], want, shard)


@pytest.mark.parametrize("saved", [("c10d.",), ("aten.bmm", "aten.mm")], ids=["communication", "matmuls"])
@pytest.mark.parametrize("strategy, degree", [("ring", None), ("hybrid", 2)])
def test_selective_checkpointing_policies_do_not_reach_inside_the_attention(pool, strategy, degree, saved):
    """A policy that saves the communication ops (not to repeat them in the recompute) had the recompute skip the
    sends and receives (the other ranks waited out the timeout); one that saves the matmuls raised torch's 'cached
    tensor has been mutated' from inside a kernel.  The attention's own ops all run again in the recompute."""
    assert max(pool.run(selective_case, strategy=strategy, ulysses_degree=degree, saved=saved, timeout=90)) < TOL


# ---- a rank whose loss skips the attention ------------------------------------------------------------------------


def skipped_backward_case(rank, world):
    """Step 2's loss on cp rank 1 does not depend on the attention output (a data-dependent loss that skipped it):
    that rank makes its next forward call while the others run the backward of step 2's call."""
    import time

    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group(range(world))  # (the failed exchange must not leave messages on the pool's groups)
    module = FA4ContextParallelAttention(group, strategy="ring", backend="reference", timeout=20)
    plan, shard, (q, k, v, dout) = _problem(module)
    start = time.monotonic()
    try:
        for step in range(3):
            leaves = [shard(t).requires_grad_() for t in (q, k, v)]
            out = module(*leaves, plan=plan)
            used = out if not (step == 1 and module.cp_rank == 1) else leaves[0]
            (used * shard(dout)).sum().backward()
    except ValueError as err:
        return str(err), time.monotonic() - start
    return None


def test_a_rank_that_skips_a_backward_fails_every_rank_at_once_naming_forward_and_backward(pool):
    """The backward's check named the skipping rank's direction None (forward signatures had no direction)."""
    for rank, res in enumerate(pool.run(skipped_backward_case, timeout=90)):
        assert res is not None, f"rank {rank} trained on instead of failing"
        message, elapsed = res
        assert "direction (" in message and "rank 1 'forward'" in message and "rank 0 'backward'" in message, message
        assert elapsed < 10, (rank, elapsed, message)


# ---- data parallel around context parallel -----------------------------------------------------------------------


class _Layers(torch.nn.Module):
    """Projections around attention layers of different windows, each layer its own module on one cp group."""

    def __init__(self, attns, width=16, heads=(4, 2), head_dim=4):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.attns, self.heads, self.head_dim = attns, heads, head_dim
        qkv = (heads[0] + 2 * heads[1]) * head_dim
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, qkv, dtype=torch.float64) for _ in attns)
        self.o = torch.nn.ModuleList(torch.nn.Linear(heads[0] * head_dim, width, dtype=torch.float64) for _ in attns)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)

    def layer(self, i, x, plan):
        hq, hkv = self.heads
        q, k, v = self.qkv[i](x).split([hq * self.head_dim, hkv * self.head_dim, hkv * self.head_dim], -1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        return x + self.o[i](self.attns[i](q, k, v, plan=plan).flatten(-2))

    def forward(self, x, plan, ckpt=False):
        for i in range(len(self.attns)):  # per-layer checkpoints: the recompute runs the layers last to first
            x = checkpoint(self.layer, i, x, plan, use_reentrant=False) if ckpt else self.layer(i, x, plan)
        return x


def data_parallel_case(rank, world, wrap):
    """dp 2 x cp 2 (cp groups {0, 1}, {2, 3}): each dp replica trains two steps on its own sample, checkpointed per
    layer; the parameters' gradients (summed over cp, averaged over dp) against one process's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    cp, dp = GROUPS["ulysses"], GROUPS["ring"]
    windows = [(3, 0), (-1, -1)]
    model = _Layers([FA4ContextParallelAttention(cp, window=w, backend="reference", timeout=30) for w in windows])
    ref = _Layers([FA4ContextParallelAttention(None, window=w, backend="reference") for w in windows])
    if wrap == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model, process_group=dp)
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dp, "cpu")
        for part in list(model.qkv) + list(model.o):
            fully_shard(part, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    samples = []
    for seed in range(2):
        cu = cp_cases.random_docs(seed, 5, 14)
        plan = model.attns[0].make_plan(cu)
        gen = torch.Generator().manual_seed(seed)
        x, dout = (torch.randn(plan.total_len, 16, generator=gen, dtype=torch.float64) for _ in range(2))
        samples.append((plan, make_plan(cu, 1), x, dout))
    plan, _, x, dout = samples[rank // 2]
    shard = functools.partial(plan.shard, seq_dim=0, rank=model.attns[0].cp_rank)
    for _ in range(2):
        local = shard(x).requires_grad_()
        out = trained(local, plan, ckpt=True)
        (out * shard(dout)).sum().backward()
    for plan1, full, want_dout in [s[1:] for s in samples]:
        for _ in range(2):
            (ref(full, plan1) * want_dout).sum().backward()
    errors = [float((out.detach() - shard(ref(x, samples[rank // 2][1]))).abs().max())]
    for p, want in zip(model.parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        dist.all_reduce(grad, group=cp)
        errors.append(float((grad - want.grad / 2).abs().max()))
    return max(errors)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_data_parallel_wrappers_around_context_parallel_layers(pool, wrap):
    assert max(pool.run(data_parallel_case, wrap=wrap, timeout=90)) < TOL
