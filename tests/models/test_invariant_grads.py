"""A whole training step's parameter gradients with the same bytes at every cp size
(fa4dist/models/invariant_grads.py): the tiny Llama with cp_invariant attention and invariant gradients, one
packed sample, cp = 1, 2, 4 (ring and Ulysses) on CPU gloo in fp32."""

import pytest
import torch

from cp_cases import call_errors
from cp_harness import GROUPS, shared_pool

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


def _step(rank, world, layouts, tokens=700, docs=(0, 150, 151, 420, 700)):
    """Per layout (cp, strategy): the gradients' bytes (rank 0 of the layout), or None elsewhere."""
    import torch.distributed as dist

    from fa4dist.data.packing import IGNORE, Sample, positions_from_cu_seqlens
    from fa4dist.data.sharding import shard_sample
    from fa4dist.models import FA4Llama, cp_cross_entropy, get_config

    config = get_config("tiny")
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor(docs, dtype=torch.int32)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=gen)
    labels = torch.roll(ids, -1).clone()
    labels[cu[1:] - 1] = IGNORE
    sample = Sample(ids, labels, positions_from_cu_seqlens(cu), cu)
    results = []
    for cp, strategy in layouts:
        grads = None
        if rank < cp:
            group = GROUPS[cp] if cp > 1 else None
            torch.manual_seed(0)
            model = FA4Llama(config, group, strategy=strategy, cp_invariant=True, backend="reference")
            model.set_invariant_grads(True, GROUPS[cp])  # the gradients' sum: this layout's ranks only
            plan = model.make_plan(cu)
            local = shard_sample(sample, plan, model.cp_rank)
            logits = model(local.tokens, local.positions, plan)
            cp_cross_entropy(logits, local.labels, group).loss.backward()
            model.invariant_grads.finish()
            if rank == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append(grads)
        dist.barrier()
    return results


def test_gradients_are_the_same_bytes_at_every_cp_size(pool):
    layouts = [(1, "ring"), (2, "ring"), (4, "ring"), (2, "ulysses"), (3, "ring")]
    per_rank = pool.run(_step, layouts=layouts)
    base, *others = per_rank[0]
    assert base and len(base) > 10
    for (cp, strategy), grads in zip(layouts[1:], others):
        for name, g in grads.items():
            assert torch.equal(g.view(torch.int32), base[name].view(torch.int32)), (cp, strategy, name)


def _misaligned(rank, world):
    """The error a cp = 2 model with invariant gradients raises for a plan not made by model.make_plan."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.models import FA4Llama, get_config

    if rank >= 2:
        return None
    model = FA4Llama(get_config("tiny"), GROUPS[2], cp_invariant=True, backend="reference")
    model.set_invariant_grads(True, GROUPS[2])
    cu = torch.tensor([0, 700], dtype=torch.int32)
    plan = make_plan(cu, 2)  # 16 chunks of 44 tokens
    aligned = model.make_plan(cu)
    try:
        model(torch.zeros(350, dtype=torch.long), torch.arange(350), plan)
    except ValueError as err:
        return str(err), aligned.chunk_size
    return None


def test_misaligned_plans_are_refused(pool):
    message, aligned = pool.run(_misaligned)[0]
    assert "multiples of 64" in message and aligned % 64 == 0


def test_gradients_match_autograd():
    from fa4dist.models import FA4Llama, get_config

    config = get_config("tiny")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, config.vocab_size, (300,), generator=gen)
    positions = torch.arange(300)
    grads = []
    for invariant in (False, True):
        torch.manual_seed(0)
        model = FA4Llama(config, None, cp_invariant=True, backend="reference")
        if invariant:
            model.set_invariant_grads(True)
        model(ids, positions).float().logsumexp(-1).sum().backward()
        if invariant:
            model.invariant_grads.finish()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[1].items():
        want = grads[0][name]
        assert (g - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_row_invariant_linear_weight_gradient_is_one_product():
    """Row blocks in the forward (Linear.row_invariant), but the weight gradient is dy^T x in one product: in bf16
    the same bytes as F.linear's (autograd through the blocks would add 16-bit rounded block gradients)."""
    from fa4dist.models.llama import Linear

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1000, 48, generator=gen).bfloat16()
    dy = torch.randn(1000, 32, generator=gen).bfloat16()
    grads = []
    for row_invariant in (False, True):
        layer = Linear(48, 32, bias=True).bfloat16()
        torch.manual_seed(0)
        torch.nn.init.normal_(layer.weight)
        layer.row_invariant = row_invariant
        xi = x.clone().requires_grad_()
        layer(xi).backward(dy)
        grads.append((layer.weight.grad, layer.bias.grad, xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert (grads[0][2].float() - grads[1][2].float()).abs().max() <= 1e-2 * grads[0][2].float().abs().max()


def test_micro_batches_add_in_backward_order():
    """Two backward passes before finish() (gradient accumulation): each is converted with its own scale and the
    step's gradient is their sum in backward order -- the bytes of finishing each alone and adding; the returned
    norm is the gradients' whole norm."""
    from fa4dist.models import FA4Llama, get_config

    config = get_config("tiny")
    gen = torch.Generator().manual_seed(6)
    batches = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (200, 130)]

    def model_and_loss(ids):
        return model(ids, torch.arange(ids.numel())).float().logsumexp(-1).sum()

    torch.manual_seed(0)
    model = FA4Llama(config, None, cp_invariant=True, backend="reference")
    model.set_invariant_grads(True)
    alone = []
    for ids in batches:
        model_and_loss(ids).backward()
        model.invariant_grads.finish()
        alone.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    for ids in batches:
        model_and_loss(ids).backward()
    norm = model.invariant_grads.finish()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads.items():
        assert torch.equal(g, alone[0][name] + alone[1][name]), name
    whole = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads.values()]).norm()
    assert torch.allclose(norm, whole, rtol=1e-12)


def test_frozen_parameters_get_no_gradient():
    """A frozen Linear weight, norm gain or embedding (requires_grad False) gets no .grad from finish() and adds
    nothing to its norm, as with autograd; the others' gradients are unchanged; divide_by must be positive."""
    from fa4dist.models import FA4Llama, get_config

    config = get_config("tiny")
    ids = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(7))
    runs = []
    for freeze in (False, True):
        torch.manual_seed(0)
        model = FA4Llama(config, None, cp_invariant=True, backend="reference")
        model.set_invariant_grads(True)
        frozen = [n for n, p in model.named_parameters()
                  if n.endswith(("q_proj.weight", "input_layernorm.weight", "embed_tokens.weight"))]
        assert "embed_tokens.weight" in frozen and len(frozen) >= 3, frozen
        if freeze:
            for n, p in model.named_parameters():
                p.requires_grad_(n not in frozen)
        model(ids, torch.arange(200)).float().logsumexp(-1).sum().backward()
        norm = model.invariant_grads.finish()
        runs.append(({n: p.grad for n, p in model.named_parameters()}, norm))
    (free, free_norm), (held, held_norm) = runs
    for name, g in held.items():
        if name in frozen:
            assert g is None, name
        else:
            assert torch.equal(g, free[name]), name
    others = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for n, g in free.items() if n not in frozen])
    assert torch.allclose(held_norm, others.norm(), rtol=1e-12) and held_norm < free_norm
    with pytest.raises(ValueError, match="divide_by must be a positive number"):
        model.invariant_grads.finish(divide_by=0)


def _linears(model):
    from fa4dist.models.llama import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def test_turning_invariant_grads_off_restores_the_products():
    """set_invariant_grads(False) leaves the products as set_row_invariant set them (they were left row-invariant),
    including a change made while it was on; the fixed-point path is gone everywhere."""
    from fa4dist.models import FA4Llama, get_config

    model = FA4Llama(get_config("tiny"), None, cp_invariant=True, backend="reference")
    for before in (False, True):
        model.set_row_invariant(before)
        model.set_invariant_grads(True)
        model.set_invariant_grads(False)
        assert [m.row_invariant for m in _linears(model)] == [before] * len(_linears(model)), before
    model.set_invariant_grads(True)
    model.set_row_invariant(False)  # while on: the fixed-point products stay row-blocked, the setting is kept
    model.set_invariant_grads(False)
    assert not any(m.row_invariant for m in _linears(model))
    assert model.invariant_grads is None and all(getattr(m, "fixed_grads", None) is None for m in model.modules())
    with pytest.raises(TypeError, match="enabled must be a bool, got str"):
        model.set_row_invariant("False")


def test_enabling_again_keeps_the_installed_object():
    """A second set_invariant_grads(True) with the same options returns the object the caller holds (with the sums
    of backward passes it already got); other options or off retire it, and its finish() then raises instead of
    quietly setting no gradient."""
    from fa4dist.models import FA4Llama, get_config

    config = get_config("tiny")
    model = FA4Llama(config, None, cp_invariant=True, backend="reference")
    ids = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(8))
    first = model.set_invariant_grads(True)
    model(ids, torch.arange(70)).float().logsumexp(-1).sum().backward()
    assert model.set_invariant_grads(True) is first
    first.finish()
    assert all(p.grad is not None for p in model.parameters())
    other = model.set_invariant_grads(True, zero_weight_grads=True)
    assert other is not first and model.invariant_grads is other
    with pytest.raises(RuntimeError, match=r"a later set_invariant_grads\(True\) retired it"):
        first.finish()
    model.set_invariant_grads(False)
    with pytest.raises(RuntimeError, match=r"set_invariant_grads\(False\) retired it"):
        other.finish()


def test_a_refused_installation_changes_nothing():
    """A Linear with a bias is refused by name before any module is switched to fixed-point gradients."""
    from fa4dist.models import FA4Llama, get_config

    model = FA4Llama(get_config("tiny"), None, cp_invariant=True, backend="reference")
    down = model.layers[-1].mlp.down_proj
    down.bias = torch.nn.Parameter(torch.zeros(down.out_features))
    with pytest.raises(ValueError, match=r"bias-free Linear layers only; these have a bias: \['layers.1.mlp.down_proj"):
        model.set_invariant_grads(True)
    assert model.invariant_grads is None and all(getattr(m, "fixed_grads", None) is None for m in model.modules())


def test_parameters_replaced_after_installation_are_refused():
    """Parameters replaced after set_invariant_grads (here load_state_dict(assign=True); fully_shard does the same)
    would get no gradient, silently: the forward refuses them, and installing again fixes it."""
    from fa4dist.models import FA4Llama, get_config

    config = get_config("tiny")
    model = FA4Llama(config, None, cp_invariant=True, backend="reference")
    ids = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(9))
    model.set_invariant_grads(True)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"installed for parameters the model no longer holds \(21, e.g. "
                                         r"\['embed_tokens.weight'.*call model.set_invariant_grads\(True\) again"):
        model(ids, torch.arange(70))
    model.set_invariant_grads(True)
    model(ids, torch.arange(70)).float().logsumexp(-1).sum().backward()
    model.invariant_grads.finish()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("max_norm", [-1.0, 0.0, float("nan"), True, "1"])
def test_a_bad_max_norm_is_refused_before_the_sums_are_used(max_norm):
    """A negative max_norm flipped every gradient's sign, NaN made them NaN, 0 zeroed them (silently); the refusal
    comes before finish() consumes the step's sums, so a corrected call still gets them."""
    from fa4dist.models import FA4Llama, get_config
    from fa4dist.models.invariant_grads import clip_by_norm

    torch.manual_seed(0)
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    model.set_invariant_grads(True)
    model(torch.arange(20), torch.arange(20)).float().logsumexp(-1).sum().backward()
    with pytest.raises(ValueError, match=r"max_norm must be a number > 0 \(None: no clipping\), got "):
        model.invariant_grads.finish(max_norm=max_norm)
    with pytest.raises(TypeError, match="assign must be a function"):
        model.invariant_grads.finish(assign=3)
    norm = model.invariant_grads.finish(max_norm=1e-3)
    assert norm > 1e-3 and all(p.grad is not None for p in model.parameters())
    clipped = torch.stack([p.grad.double().norm() for p in model.parameters()]).norm()
    assert abs(float(clipped) - 1e-3) < 1e-7
    with pytest.raises(ValueError, match="max_norm must be a number > 0"):
        clip_by_norm(list(model.parameters()), max_norm, norm)


def _pickling(rank, world):
    """A cp-size-1 model whose invariant gradients sum over a process group (data parallelism): the (type, message)
    of pickle.dumps of its FixedPointGrads and of torch.save(model); whether a deep copy's shares the group; whether
    the model saves once the gradients have no group."""
    import copy
    import io
    import pickle

    from fa4dist.models import FA4Llama, get_config

    if rank >= 2:
        return None
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    grads = model.set_invariant_grads(True, GROUPS[2])
    errors = call_errors(lambda: pickle.dumps(grads), lambda: torch.save(model, io.BytesIO()))
    twin = copy.deepcopy(model)
    torch.save(model.state_dict(), io.BytesIO())  # what the message says to save
    model.set_invariant_grads(True, None)
    saved = io.BytesIO()
    torch.save(model, saved)
    return errors, twin.invariant_grads.group is grads.group and twin.invariant_grads is not grads, saved.tell() > 0


def test_pickling_invariant_gradients_on_a_group_says_what_to_save(pool):
    """torch.save(model) of a model whose FixedPointGrads sums over a process group failed with pickle's own
    "cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object", naming neither the object nor the remedy (the
    attention module on a group already said it)."""
    for errors, shared, saved in pool.run(_pickling)[:2]:
        for error in errors:
            assert error is not None and error[0] == "TypeError", error
            assert "FixedPointGrads" in error[1] and "cannot be pickled" in error[1], error
            assert "state_dict()" in error[1] and "set_invariant_grads" in error[1], error
        assert shared and saved


def _outsider(rank, world):
    """Ranks 2 and 3 install invariant gradients summed over the group of ranks 0 and 1, which they are not in:
    (error type, message) and whether the model kept the FixedPointGrads it had, still live."""
    from fa4dist.models import FA4Llama, get_config

    if rank < 2:
        return None
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    before = model.set_invariant_grads(True)
    try:
        model.set_invariant_grads(True, GROUPS[2])
        error = None
    except Exception as err:  # noqa: BLE001
        error = type(err).__name__, str(err)
    return error, model.invariant_grads is before and before.retired is None


def test_invariant_gradients_over_a_group_without_this_rank_are_refused(pool):
    """new_group gives a rank outside the group a placeholder of size -1: FixedPointGrads took it as 'not
    distributed' and finish() left that rank's gradients its own tokens' share, silently.  Now it is refused by
    name, and the model keeps the invariant gradients it had."""
    for error, kept in pool.run(_outsider)[2:]:
        assert error is not None and error[0] == "ValueError" and "not a member" in error[1], error
        assert kept


def _timed_finish(grads):
    """grads.finish()'s (error type, message) or None, and the seconds it took."""
    import time

    start = time.monotonic()
    try:
        grads.finish()
        error = None
    except Exception as err:  # noqa: BLE001
        error = type(err).__name__, str(err)
    return error, time.monotonic() - start


def _one_rank_refuses_finish(rank, world):
    """Ranks 0 and 1 sum their invariant gradients over their group; after the backward rank 1 replaces its
    parameters (load_state_dict(assign=True)), which its finish() refuses: each rank's (error type, message) and
    the seconds its finish() took, and whether a second, agreed finish() then completes on both."""

    from fa4dist.models import FA4Llama, get_config

    if rank >= 2:
        return None
    torch.manual_seed(0)
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    grads = model.set_invariant_grads(True, GROUPS[2])
    model(torch.arange(20), torch.arange(20)).float().logsumexp(-1).sum().backward()
    held = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 1:
        model.load_state_dict(held, assign=True)
    error, seconds = _timed_finish(grads)
    if rank == 1:  # back to the installed parameters: the step's sums are still there
        for site in grads.sites:
            site.module._parameters["weight"] = site.param
    grads.finish()
    return error, seconds, all(p.grad is not None for p in model.parameters())


def test_a_finish_that_one_rank_refuses_fails_on_every_rank(pool):
    """finish()'s own checks (replaced parameters here) raised on the one rank whose check failed, while the other
    ranks went on into the all-reduce of the sums: they waited there until the group's timeout, or (here) it paired
    with the refusing rank's next finish() and they finished silently with mixed steps. Every rank now raises at
    once, the others naming the refusing rank and its error; a later agreed finish() still works."""
    results = pool.run(_one_rank_refuses_finish, timeout=60.0)[:2]
    (error0, seconds0, done0), (error1, seconds1, done1) = results
    assert error0 is not None and error0[0] == "ValueError", error0
    assert "rank 1" in error0[1] and "installed for parameters the model no longer holds" in error0[1], error0
    assert error1 is not None and error1[0] == "ValueError", error1
    assert "installed for parameters the model no longer holds" in error1[1], error1
    assert seconds0 < 20 and seconds1 < 20, (seconds0, seconds1)
    assert done0 and done1


def _finish_alone(rank, world, wait_s):
    """Ranks 0 and 1 install invariant gradients over a fresh group with a timeout of ``wait_s``; rank 1 never calls
    finish(): rank 0's (error type, message, seconds) from its finish()."""

    from cp_harness import fresh_group
    from fa4dist.models import FA4Llama, get_config

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    torch.manual_seed(0)
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    grads = model.set_invariant_grads(True, group, timeout=wait_s)
    model(torch.arange(20), torch.arange(20)).float().logsumexp(-1).sum().backward()
    if rank == 1:
        return None
    return _timed_finish(grads)


def test_the_invariant_gradients_wait_no_longer_than_their_timeout(pool):
    """A rank whose peer never reaches finish() raises a CommError naming the invariant gradients once their own
    timeout has passed (it was fixed at 300 s), not the group's or the attention's."""
    error, seconds = pool.run(_finish_alone, wait_s=3.0, timeout=60.0)[0]
    assert error is not None and error[0] == "CommError", error
    assert "fa4dist invariant gradients" in error[1], error
    assert 3.0 <= seconds < 30, seconds


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_a_bad_timeout_is_refused_by_name(timeout):
    from fa4dist.models import FA4Llama, get_config
    from fa4dist.models.invariant_grads import FixedPointGrads

    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        FixedPointGrads(None, timeout=timeout)
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        model.set_invariant_grads(True, timeout=timeout)
    assert model.invariant_grads is None  # a refused call leaves the model as it was


def _disagreeing_backward(rank, world, case):
    """Ranks 0 and 1 sum their invariant gradients over a fresh group (a refused exchange leaves its call numbers out
    of step), rank 1's step differing as ``case`` says: each rank's (error type, message, seconds) from its backward
    and finish(), or None where both completed."""
    import time

    from cp_harness import fresh_group
    from fa4dist.models import FA4Llama, get_config

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    torch.manual_seed(0)
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    if case == "dtype" and rank == 1:
        model.double()
    grads = model.set_invariant_grads(True, group)
    if case == "frozen" and rank == 1:
        model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    backwards = 2 if case == "micro-batches" and rank == 1 else 1
    start = time.monotonic()
    try:
        for _ in range(backwards):
            model(torch.arange(20), torch.arange(20)).float().logsumexp(-1).sum().backward()
        grads.finish()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), time.monotonic() - start
    return None


@pytest.mark.parametrize("case, message", [
    # rank 1's site skipped: the next sites' all-reduces paired with other sites' (scales mixed), then rank 0 waited
    # in an all-reduce that rank 1 never made
    ("frozen", "ranks disagree on FixedPointGrads backward call"),
    # the scales' maxima are fp64 on every rank: a model in another dtype went through silently
    ("dtype", r"dtype: rank 0 'torch.float32', rank 1 'torch.float64'"),
    # rank 1's second backward settled its first one's sum in an all-reduce that rank 0 (in finish) never made
    ("micro-batches", "ranks disagree on FixedPointGrads"),
])
def test_a_backward_that_differs_between_ranks_fails_on_every_rank(pool, case, message):
    """The per-site exchanges of the backward (the scale's maxima and token count, a previous micro-batch's sum) are
    agreed first, as finish()'s sums are: every rank raises at once, naming the difference."""
    import re

    results = pool.run(_disagreeing_backward, case=case, timeout=60.0)[:2]
    for rank, result in enumerate(results):
        assert result is not None, (rank, results)
        kind, text, seconds = result
        assert kind == "ValueError" and text.startswith("fa4dist invariant gradients: "), (rank, result)
        assert seconds < 20, (rank, result)
    assert any(re.search(message, r[1]) for r in results), results


def _disagreeing_backward_beside_cp_attention(rank, world, case):
    """Ranks 0 and 1 of a fresh group run a cp_invariant FA4Llama at cp 2 with invariant gradients over the same
    group, rank 1 skipping a site the other runs just before an attention call (o_proj frozen), or running a second
    micro-batch: each rank's (error type, message, seconds)."""
    import time

    from cp_harness import fresh_group
    from fa4dist.data.packing import Sample, positions_from_cu_seqlens
    from fa4dist.data.sharding import shard_sample
    from fa4dist.models import FA4Llama, cp_cross_entropy, get_config
    from fa4dist.models.attention import make_attention

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    torch.manual_seed(0)
    attention = lambda: make_attention(group, cp_invariant=True, backend="reference", timeout=60.0)  # noqa: E731
    model = FA4Llama(get_config("tiny"), group, attention_factory=attention)
    model.set_invariant_grads(True, group)
    if case == "frozen" and rank == 1:
        model.layers[1].self_attn.o_proj.weight.requires_grad_(False)
    ids = torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 128], dtype=torch.int32)
    sample = Sample(ids, torch.roll(ids, -1), positions_from_cu_seqlens(cu), cu)
    start = time.monotonic()
    try:
        for _ in range(2 if case == "micro-batches" and rank == 1 else 1):
            plan = model.make_plan(cu)
            local = shard_sample(sample, plan, model.cp_rank)
            cp_cross_entropy(model(local.tokens, local.positions, plan), local.labels, group).loss.backward()
        model.invariant_grads.finish()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), time.monotonic() - start
    return None


@pytest.mark.parametrize("case", ["frozen", "micro-batches"])
def test_a_backward_that_differs_beside_cp_attention_fails_on_every_rank_before_the_timeout(pool, case):
    """A site's exchange is an all-reduce and the attention's a store exchange, which never pair: rank 0 waited in
    the site's all-reduce, rank 1 in the attention's agreement check, each until its timeout (300 s by default).
    The all-reduce's wait now reads the peers' posted waits as a store exchange's does (comm.Transport._collective):
    both ranks fail within the blocking part of the wait (10 s), naming the two waits."""
    results = pool.run(_disagreeing_backward_beside_cp_attention, case=case, timeout=120.0)[:2]
    for rank, result in enumerate(results):
        assert result is not None, (rank, results)
        assert result[0] in ("CommError", "GroupBroken") and result[2] < 30, (rank, result)
    assert "waits for this rank in" in results[0][1] or "waits for this rank in" in results[1][1], results


@pytest.mark.parametrize("holder, intruder", [("invariant_grads", "reduce_value"), ("reduce_value", "invariant_grads")])
def test_a_second_thread_on_the_group_is_refused_at_once(pool, holder, intruder):
    """The backward's per-site all-reduces did not take the group's thread guard (comm.exclusive) that every other
    call on a group takes: a call from another thread meanwhile paired up differently on different ranks (here: the
    refused call waited out its timeout, or the two threads waited for each other's partners).  Now the second
    thread is refused at once and the call that held the group raises when it ends."""
    import uuid

    import cp_cases

    (refused, held), theirs = pool.run(cp_cases.intruding_thread_case, key=f"intrude-{uuid.uuid4().hex}",
                                       holder=holder, intruder=intruder, timeout=60)[:2]
    assert refused is not None and refused[0] == "RuntimeError" and "one thread at a time" in refused[1], refused
    assert refused[2] < 2, refused
    assert held is not None and held[0] == "RuntimeError" and "not trusted" in held[1], held
    assert theirs is None


def _micro_batches_over_a_group(rank, world):
    """Ranks 0 and 1 (another token count on each), two micro-batches each, finish() over GROUPS[2]: the invariant
    gradients, autograd's summed over the ranks and micro-batches, how many exchanges fa4dist's store channel of
    the group carried meanwhile, and (sites, agreement all-reduces)."""
    import torch.distributed as dist

    from fa4dist.context_parallel import comm
    from fa4dist.models import FA4Llama, get_config

    if rank >= 2:
        return None
    config = get_config("tiny")
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randint(0, config.vocab_size, (n + 7 * rank,), generator=gen) for n in (40, 25)]
    runs = []
    for invariant in (False, True):
        torch.manual_seed(0)
        model = FA4Llama(config, None, backend="reference")
        grads = model.set_invariant_grads(True, GROUPS[2]) if invariant else None
        _, prefix = comm._store_channel(GROUPS[2])
        before = comm._STORE_SEQ.get(prefix, 0)
        for ids in batches:
            model(ids, torch.arange(ids.numel())).float().logsumexp(-1).sum().backward()
        if invariant:
            grads.finish()
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=GROUPS[2])
        runs.append({n: p.grad for n, p in model.named_parameters()})
    return runs, comm._STORE_SEQ.get(prefix, 0) - before, (len(grads.sites), grads.exchanges)


def test_micro_batches_over_a_group_agree_without_the_store(pool):
    """Each site's exchanges in a backward (and finish()'s) were agreed through the group's store: a round trip per
    site and backward, hundreds per step.  The check now rides on the site's all-reduce of its maxima and token
    counts (one per site and backward, one more in finish), and two micro-batches of other sizes on each rank still
    give autograd's gradients summed over the group, the same bytes on both ranks."""
    (runs0, stored0, counts0), (runs1, stored1, counts1) = pool.run(_micro_batches_over_a_group, timeout=60.0)[:2]
    sites, exchanges = counts0
    assert stored0 == stored1 == 0 and counts1 == counts0 and exchanges == 2 * sites + 1, (stored0, counts0)
    (autograd, invariant), (_, invariant1) = runs0, runs1
    tol = 100 * torch.finfo(torch.float32).eps
    for name, want in autograd.items():
        assert torch.equal(invariant[name], invariant1[name]), name
        assert (invariant[name] - want).abs().max() <= tol * want.abs().max(), name


def _finish_differently(rank, world, case):
    """Ranks 0 and 1 sum their invariant gradients over a fresh group, rank 1's finish() given another divide_by or
    max_norm: each rank's (error type, message) or, where finish() completed, its gradients' sum."""
    from cp_harness import fresh_group
    from fa4dist.models import FA4Llama, get_config

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    torch.manual_seed(0)
    model = FA4Llama(get_config("tiny"), None, backend="reference")
    grads = model.set_invariant_grads(True, group)
    model(torch.arange(20), torch.arange(20)).float().logsumexp(-1).sum().backward()
    options = dict(divide_by=1 + rank) if case == "divide_by" else dict(max_norm=1.0 + rank)
    try:
        grads.finish(**options)
    except ValueError as err:
        return type(err).__name__, str(err)
    return float(sum(p.grad.double().sum() for p in model.parameters()))


@pytest.mark.parametrize("case, message", [
    ("divide_by", "divide_by: rank 0 1.0, rank 1 2.0"),
    ("max_norm", "max_norm: rank 0 1.0, rank 1 2.0"),
])
def test_a_finish_whose_options_differ_between_ranks_fails_on_every_rank(pool, case, message):
    """finish(divide_by=...) or max_norm that differs between ranks scaled or clipped each rank's copy of the summed
    gradients differently: the replicas' weights drifted apart silently.  Now every rank raises, naming it."""
    results = pool.run(_finish_differently, case=case, timeout=60.0)[:2]
    assert results[0] == results[1] and isinstance(results[0], tuple), results
    assert message in results[0][1] and "ranks disagree on FixedPointGrads.finish call" in results[0][1], results
