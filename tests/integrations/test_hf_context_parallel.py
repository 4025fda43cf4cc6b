"""enable_context_parallel on transformers models (gloo, CPU, fp64): tiny Llama, Qwen2, Mistral (a sliding window),
Gemma 2 (sliding and global layers, soft-capping), Gemma 3, GPT-OSS (sliding window, learned sinks) and Llama 4
(chunked attention, temperature-tuned NoPE queries, against the packed row through its own attention), a packed
batch of 3 documents from DataCollatorWithFlattening, all longer than the window, cp = 2 and 3, ring and Ulysses.
The ranks' loss shares add up to, and their all-reduced gradients (the sinks' included) equal, those of a
single-process oracle that runs each document alone with the model's eager attention in fp64 (1e-9 relative), with
the loss from the logits and tiled from the hidden states alike.  Options the attention cannot compute are refused;
disable() gives back the model's own attention.

The oracle's attention is ``hf_tiny.EAGER_FP64``: the models' eager attention with its softmax in the model's dtype
(the stock ``eager`` computes it in fp32 whatever the dtype, which alone moves gradients by ~1e-7)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from cp_harness import GROUPS, shared_pool  # noqa: E402
from hf_tiny import EAGER_FP64, VOCAB  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

from fa4dist.integrations.hf import UnsupportedMask, decoder_of, enable_context_parallel  # noqa: E402
from fa4dist.integrations.hf_context_parallel import (  # noqa: E402
    PLAN_KEY, CheckedCausalMask, _cp_attention, chunk_starts,
)
from fa4dist.integrations.hf_loss import TiledCausalLMLoss  # noqa: E402

LENGTHS = (23, 41, 17)
REL = 1e-9


def tiny_model(family: str, seed: int = 0, **overrides):
    return hf_tiny.tiny_model(family, seed, attn_implementation="eager", **overrides)


def packed_batch(lengths=LENGTHS, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]
    return DataCollatorWithFlattening()(docs)


def per_document_logits(model, batch, lengths=LENGTHS) -> torch.Tensor:
    """(1, T, vocab): each document alone through EAGER_FP64 attention (the model's own is put back after)."""
    own = model.config._attn_implementation
    model.set_attn_implementation(EAGER_FP64)
    ids = batch["input_ids"][0]
    bounds = torch.tensor((0,) + tuple(lengths)).cumsum(0).tolist()
    logits = torch.cat([model(input_ids=ids[None, a:b], use_cache=False).logits[0]
                        for a, b in zip(bounds, bounds[1:])])
    model.set_attn_implementation(own)
    return logits[None]


def oracle(family: str, lengths=LENGTHS):
    """Each document alone through the model's eager attention in fp64: (mean loss, {name: grad})."""
    model = tiny_model(family)
    model.set_attn_implementation(EAGER_FP64)
    ids = packed_batch(lengths)["input_ids"][0]
    total, count, start = 0.0, 0, 0
    for n in lengths:
        doc = ids[start:start + n]
        logits = model(input_ids=doc[None], use_cache=False).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum")
        count += n - 1
        start += n
    loss = total / count
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def packed_oracle(family: str, lengths=LENGTHS, **overrides):
    """The packed row through the model's own eager attention in fp64 (transformers' packed-sequence mask):
    (mean loss, {name: grad}).  The reference where a model treats a packed row otherwise than its documents alone
    (Llama 4's temperature tuning scales a query by its token's index in the row)."""
    model = tiny_model(family, **overrides)
    model.set_attn_implementation(EAGER_FP64)
    batch = packed_batch(lengths)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], ignore_index=-100)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _cp_run(rank, world, family, cp, tiled, strategy="auto", cp_invariant=None, overrides=None, lengths=LENGTHS):
    """On ranks < cp: the loss share and gradients, summed over the cp group (rank 0 returns them)."""
    import torch.distributed as dist

    if rank >= cp:
        return None
    group = GROUPS[cp]
    model = tiny_model(family, **(overrides or {}))
    handle = enable_context_parallel(model, group=group, strategy=strategy, cp_invariant=cp_invariant)
    assert handle.cp_size == cp and handle.cp_rank == rank
    local = handle.shard_batch(packed_batch(lengths))
    if tiled:
        loss = TiledCausalLMLoss(model, handle, chunk_tokens=5)(local)
    else:
        loss = handle.loss(model(**local).logits, local)
    loss.backward()
    assert all(core.cp.cp_invariant == bool(cp_invariant) for core in handle._cores.values())
    strategies = sorted({core.cp.strategy_name(core.cp.degree(4, 2, local[PLAN_KEY])) for core in
                         handle._cores.values()})
    handle.disable()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    tokens = torch.tensor([local["input_ids"].shape[1]])
    dist.all_reduce(tokens, group=group)
    return (float(total), grads, int(tokens), strategies) if rank == 0 else None


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


class _Oracles(dict):
    """Each family's oracle, computed when a test first asks for it."""

    def __missing__(self, family):
        self[family] = oracle(family)
        return self[family]


@pytest.fixture(scope="module")
def oracles():
    return _Oracles()


def assert_rel_close(got: float, want: float, what: str):
    assert abs(got - want) <= REL * abs(want), f"{what}: {got!r} vs {want!r}"


def check_against_oracle(result, want, strategy=None, lengths=LENGTHS):
    loss, grads, tokens, strategies = result
    want_loss, want_grads = want
    assert tokens == sum(lengths)
    if strategy is not None:
        assert strategies == [strategy]
    assert_rel_close(loss, want_loss, "summed loss shares")
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        hf_tiny.assert_close_rel(grads[name], g, REL, name)


@pytest.mark.parametrize("tiled", [False, True], ids=["logits", "tiled"])
@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cp_loss_and_gradients_equal_per_document_oracle(pool, oracles, family, cp, tiled):
    check_against_oracle(pool.run(_cp_run, family=family, cp=cp, tiled=tiled)[0], oracles[family])


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_cp_invariant_attention_through_the_handle_equals_the_oracle(pool, oracles, family):
    """enable_context_parallel(cp_invariant=True) runs every attention core in that mode (the gather engine), with
    the model's loss and gradients (GPT-OSS: with its sinks and their gradient)."""
    check_against_oracle(pool.run(_cp_run, family=family, cp=2, tiled=False, cp_invariant=True)[0],
                         oracles[family])


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "gpt_oss"])
def test_cp_windows_softcap_and_sinks_equal_per_document_oracle(pool, oracles, family, strategy):
    """Windows of 6 tokens in documents of 17-41 split over 2 ranks in chunks of ~5: windows cross every shard
    edge; Gemma 2's soft-capping; GPT-OSS's sinks, whose gradient is summed over the ranks (Ulysses: by heads)."""
    check_against_oracle(pool.run(_cp_run, family=family, cp=2, tiled=False, strategy=strategy)[0],
                         oracles[family], strategy)
    if family == "gpt_oss":
        assert {f"model.layers.{i}.self_attn.sinks" for i in range(2)} <= oracles[family][1].keys()


LLAMA4_TUNED = dict(floor_scale=8)  # temperature tuning binds from the 8th token of the row on (default 8192)


@pytest.mark.parametrize("cp, strategy, cp_invariant, lengths", [
    (2, "ring", None, LENGTHS), (2, "ulysses", None, LENGTHS), (3, "ring", None, LENGTHS), (2, "ring", True, LENGTHS),
    # documents shorter than a chunk and one not a whole number of chunks; the MoE layers' routers see other token
    # counts on each rank than in the packed row (hf_tiny runs their sigmoid in fp64: the stock fp32 one rounds an
    # ulp apart with the count, 1e-8 here)
    (3, "ring", None, (3, 13, 7, 11))])
def test_cp_chunked_attention_and_temperature_tuning_equal_the_packed_model(pool, cp, strategy, cp_invariant,
                                                                           lengths):
    """Llama 4: three chunked layers (chunks of 6 tokens within documents of 17-41, on their own plan, the shards'
    documents cut at the chunks) and a NoPE layer whose queries are scaled by their token's index in the packed
    row (which each rank's model would take from its index in the shard)."""
    want = packed_oracle("llama4", lengths, **LLAMA4_TUNED)
    got = pool.run(_cp_run, family="llama4", cp=cp, tiled=False, strategy=strategy, cp_invariant=cp_invariant,
                   overrides=LLAMA4_TUNED, lengths=lengths)[0]
    check_against_oracle(got, want, lengths=lengths)
    # the tuning binds: without it (scales of 1) the oracle differs
    assert abs(packed_oracle("llama4", lengths)[0] - want[0]) > 1e-6


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_tiled_loss_of_windowed_families_is_the_models_loss(pool, oracles, family):
    """TiledCausalLMLoss on Gemma 2 (final logits soft-capped at the config's value), Gemma 3 (not capped) and
    GPT-OSS (plain head, sinks in the attention)."""
    check_against_oracle(pool.run(_cp_run, family=family, cp=2, tiled=True)[0], oracles[family])


def _different_batches(rank, world):
    if rank >= 2:
        return None
    handle = enable_context_parallel(tiny_model("llama"), group=GROUPS[2])
    try:
        handle.shard_batch(packed_batch(seed=1 + rank))
    except ValueError as err:
        return str(err)
    finally:
        handle.disable()
    return "no error"


def test_ranks_with_different_batches_fail_alike(pool):
    messages = pool.run(_different_batches)[:2]
    assert all("different batches" in m for m in messages), messages


def _enable_unlike(rank, world, case):
    """Ranks 0 and 1 enable context parallelism with one difference on rank 1: the error each raises (and how long
    it took), or "no error"."""
    import time

    if rank >= 2:
        return None
    kw, overrides = {}, {}
    if rank == 1 and case == "check_batch":
        kw["check_batch"] = False
    elif rank == 1 and case == "layers":
        overrides["num_hidden_layers"] = 3
    model = tiny_model("llama", **overrides)
    t0 = time.monotonic()
    try:
        handle = enable_context_parallel(model, group=GROUPS[2], timeout=60.0, **kw)
    except ValueError as err:
        return f"{time.monotonic() - t0:.1f}s {err}"
    handle.disable()
    return "no error"


@pytest.mark.parametrize("case, field", [("check_batch", "check_batch"), ("layers", "num_hidden_layers")])
def test_ranks_that_enable_unlike_fail_at_once(pool, case, field):
    """A rank whose check_batch or layer count differs: every rank raises when the handle is made, naming the
    field (it used to surface only as the others' wait in the first batch's exchange, until the timeout)."""
    messages = pool.run(_enable_unlike, case=case, timeout=30)[:2]
    for m in messages:
        assert "ranks disagree" in m and field in m, messages
        assert float(m.split("s ", 1)[0]) < 10, messages


def _one_rank_rejects_its_batch(rank, world, case="padding"):
    """Rank 1's batch has padding, or labels as a Python list (refused before the checksum exchange); rank 0's is
    fine."""
    if rank >= 2:
        return None
    handle = enable_context_parallel(tiny_model("llama"), group=GROUPS[2])
    batch = packed_batch()
    if rank == 1 and case == "padding":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, -1] = 0
    elif rank == 1 and case == "list labels":
        batch["labels"] = batch["labels"].tolist()
    try:
        handle.shard_batch(batch)
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    finally:
        handle.disable()
    return "no error"


@pytest.mark.parametrize("case, message", [
    ("padding", "UnsupportedMask: context parallelism takes packed documents without padding (attention_mask has "
                "zeros)"),
    # was an AttributeError ('list' object has no attribute 'shape') on rank 1
    ("list labels", "TypeError: batch['labels'] must be a torch.Tensor (1, 81) like input_ids, got list"),
])
def test_a_rank_that_rejects_its_batch_does_not_leave_the_others_waiting(pool, case, message):
    """Rank 0 used to wait in the checksum exchange that rank 1 never joined (a hang)."""
    messages = pool.run(_one_rank_rejects_its_batch, case=case, timeout=30)[:2]
    assert "rank(s) [1] of the cp group rejected the batch" in messages[0], messages
    assert messages[1].startswith(message), messages


def _one_rank_refuses_its_loss(rank, world, case):
    """handle.loss on ranks 0 and 1, rank 1's refused before the loss's exchange (rank 0's is fine): the error
    each raises."""
    if rank >= 2:
        return None
    handle = enable_context_parallel(tiny_model("llama"), group=GROUPS[2], timeout=10.0)
    try:
        local = handle.shard_batch(packed_batch())
        logits = torch.randn(1, local["input_ids"].shape[1], VOCAB, dtype=torch.float64)
        if rank == 1 and case == "no labels":
            local.pop("shift_labels")
        elif rank == 1 and case == "length":
            logits = logits[:, 1:]
        elif rank == 1 and case == "batch":
            logits = logits.expand(2, -1, -1)  # was read as its first row, silently
        handle.loss(logits, local)
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        handle.disable()
    return "no error"


@pytest.mark.parametrize("case, message", [
    ("no labels", r"the local batch has no labels"),
    ("length", r"logits hold (\d+) tokens but the local batch (?!\1)\d+"),
    ("batch", r"logits must be \(1, local_tokens, vocab\) or \(local_tokens, vocab\).* got shape \(2, \d+, "),
])
def test_a_rank_that_refuses_its_loss_does_not_leave_the_others_waiting(pool, case, message):
    """Rank 0 used to wait in the loss's exchange that rank 1 never joined, until the loss's timeout (300 s)."""
    import re

    messages = pool.run(_one_rank_refuses_its_loss, case=case, timeout=30)[:2]
    assert messages[0] == messages[1], messages
    assert re.search(rf"^ValueError: .*rank 1 rejected its inputs: ValueError: {message}", messages[0]), messages


def _one_rank_refuses_its_tiled_loss(rank, world, case):
    """TiledCausalLMLoss on ranks 0 and 1 of a throw-away group (a regression leaves its exchanges out of step),
    rank 1's batch without labels or plan, or rank 1 not calling the loss at all ("skip"): (the error each raises,
    seconds it took)."""
    import time

    from cp_harness import fresh_group

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    model = tiny_model("llama")
    handle = enable_context_parallel(model, group=group, timeout=2.0 if case == "skip" else 10.0)
    start = time.monotonic()
    try:
        local = handle.shard_batch(packed_batch())
        if rank == 1 and case == "no labels":
            local.pop("shift_labels")
        elif rank == 1 and case == "no plan":
            local.pop(PLAN_KEY)
        if rank == 1 and case == "skip":  # its attention calls, not the loss's exchange
            model.model(**{k: v for k, v in local.items() if k != "shift_labels"})
        else:
            TiledCausalLMLoss(model, handle, chunk_tokens=5)(local)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    finally:
        handle.disable()
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("case, message", [
    ("no labels", r"^ValueError: .*rank 1 rejected its inputs: ValueError: the local batch has no labels"),
    ("no plan", r"^ValueError: .*rank 1 rejected its inputs: ValueError: context-parallel attention needs the batch "
                r"from handle.shard_batch"),
])
def test_a_rank_that_refuses_its_tiled_loss_does_not_leave_the_others_waiting(pool, case, message):
    """Rank 0 used to wait in the tiled loss's exchange that rank 1 never joined, for 300 s (the handle's timeout
    was not passed), or in its attention's agreement check for the handle's timeout (10 s)."""
    import re

    (got, seconds), (theirs, _) = pool.run(_one_rank_refuses_its_tiled_loss, case=case, timeout=30)[:2]
    assert re.search(message, got), got
    assert seconds < 5, (seconds, got)
    if case == "no labels":
        assert theirs == got
    else:  # the rank without a plan names what it was missing
        assert theirs.startswith("ValueError: context-parallel attention needs the batch from handle.shard_batch"), \
            theirs


def _one_rank_with_another_head(rank, world):
    """tiled_cp_cross_entropy on ranks 0 and 1, rank 1's LM head weight in bfloat16 (hidden states in float32):
    each rank's (error type, message) or None."""
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    if rank >= 2:
        return None
    gen = torch.Generator().manual_seed(rank)
    hidden, weight = torch.randn(6, 4, generator=gen), torch.randn(10, 4, generator=gen)
    if rank == 1:
        weight = weight.bfloat16()
    try:
        tiled_cp_cross_entropy(hidden, weight, torch.randint(0, 10, (6,), generator=gen), GROUPS[2], timeout=10.0)
    except (TypeError, ValueError, RuntimeError) as err:
        return type(err).__name__, str(err)
    return None


def test_a_rank_whose_tiled_loss_head_differs_makes_every_rank_raise(pool):
    """The head's dtype was first used in the tiles, after the label counts' exchange: rank 1 raised a RuntimeError
    from the matrix product alone, rank 0 returned its share as if nothing had happened (to wait at its next
    exchange).  It is checked with the arguments now, so every rank raises, naming rank 1."""
    got, theirs = pool.run(_one_rank_with_another_head, timeout=30)[:2]
    assert got is not None and got[0] == "ValueError", got
    assert "rank 1 rejected its inputs: TypeError: weight must have the dtype of hidden" in got[1], got
    assert theirs is not None and theirs[0] == "TypeError" and theirs[1] == got[1], theirs


# rank 1's refusals in the forward: transformers' mask build (the handle's mask function) and the decoder's hook
_FORWARD_CASES = ("forward padding", "forward two rows", "no positions")


def _one_rank_refuses_its_call(rank, world, case):
    """Ranks 0 and 1 of a throw-away group, rank 1's call refused by the attention call's own checks (before the
    attention: _cp_attention called directly) or in its forward (_FORWARD_CASES: model(**local)): (the error each
    raises, seconds it took)."""
    import time

    from cp_harness import fresh_group

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    model = tiny_model("llama" if case in _FORWARD_CASES else "gpt_oss")
    handle = enable_context_parallel(model, group=group, timeout=10.0)
    start = time.monotonic()
    try:
        if case in _FORWARD_CASES:
            local = handle.shard_batch(packed_batch())
            if rank == 1 and case == "forward padding":
                local["attention_mask"] = torch.ones_like(local["input_ids"])
                local["attention_mask"][0, 0] = 0
            elif rank == 1 and case == "forward two rows":
                local["input_ids"] = local["input_ids"].expand(2, -1)
            elif rank == 1 and case == "no positions":
                del local["position_ids"]
            model(**local)
            return "no error", time.monotonic() - start
        plan = handle.shard_batch(packed_batch())[PLAN_KEY]
        n = plan.local_len(handle.cp_rank)
        module = model.model.layers[0].self_attn
        q = torch.randn(1, 4, n, 16, dtype=torch.float64)
        kv = torch.randn(1, 2, n, 16, dtype=torch.float64)
        mask, options = CheckedCausalMask("exhaustive", (5, 0)), dict(scaling=0.25, s_aux=module.sinks)
        if rank == 1 and case == "mask":
            mask = torch.ones(1, 1, n, n, dtype=torch.bool)
        elif rank == 1 and case == "batch":
            q, kv = q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1)
        elif rank == 1 and case == "window":
            options["sliding_window"] = 16
        elif rank == 1 and case == "sinks":
            options["s_aux"] = torch.zeros(2, dtype=torch.float64)
        elif rank == 1 and case == "dropout":
            model.train()
            options["dropout"] = 0.1
        _cp_attention(module, q, kv, kv, mask, **options, **{PLAN_KEY: plan})
    except ValueError as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    finally:
        handle.disable()
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("case, message", [
    ("mask", "got a precomputed Tensor mask"),
    ("batch", r"one packed row \(batch size 1\), got 2"),
    ("window", "sliding window of 16 tokens but the layer's mask"),
    ("sinks", r"shape \(4,\)"),
    ("dropout", "no attention dropout"),
    # refused in the mask function transformers calls before any attention call: raised on that rank alone, the
    # others waited in the attention's first exchange for the timeout and failed without the reason
    ("forward padding", r"packed documents without padding \(no attention_mask zeros\)"),
    ("forward two rows", r"one packed row \(batch size 1\), got batch size 2"),
    # a forward without position_ids ran silently with each shard's tokens numbered from 0 (RoPE at wrong places)
    ("no positions", "without position_ids, so it numbered each rank's tokens from 0"),
])
def test_a_rank_that_refuses_its_call_does_not_leave_the_others_waiting(pool, case, message):
    """The call's own checks (mask, batch, window, sinks, dropout; in the forward: the mask function's, the
    positions) ran before the attention's agreement check, or outside it: rank 0 waited in it for the handle's
    timeout (10 s) while rank 1 raised alone."""
    import re

    (got, seconds), (theirs, _) = pool.run(_one_rank_refuses_its_call, case=case, timeout=30)[:2]
    assert re.search(rf"^ValueError: .*rank 1 rejected its inputs: \w+: .*{message}", got), got
    assert seconds < 5, (seconds, got)
    assert re.search(rf"^\w+: .*{message}", theirs), theirs  # its own error, on the refusing rank


def test_the_tiled_loss_waits_the_handles_timeout(pool):
    """A rank that skips the loss: the others raise after the handle's timeout (2 s), not the loss's default 300."""
    (got, seconds), (theirs, _) = pool.run(_one_rank_refuses_its_tiled_loss, case="skip", timeout=30)[:2]
    assert got.startswith("CommError: fa4dist tiled_cp_cross_entropy") and "timeout 2s" in got, got
    assert seconds < 10, seconds
    assert theirs == "no error"


def _tiled_loss_calls(rank, world):
    """tiled_cp_cross_entropy on ranks 0 and 1: rank 1's hidden states and head in fp32, the others' in fp64 (their
    counts were all-reduced in the hidden dtype: gloo aborted); ranks 2 and 3 pass the group of ranks 0 and 1."""
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    gen = torch.Generator().manual_seed(rank)
    hidden, weight = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    labels = torch.randint(0, 10, (6,), generator=gen)
    try:
        if rank == 1:
            hidden, weight = hidden.float(), weight.float()
        tiled_cp_cross_entropy(hidden, weight, labels, GROUPS[2])
    except ValueError as err:
        return str(err)
    return "no error"


def test_tiled_loss_calls_that_differ_fail_alike(pool):
    messages = pool.run(_tiled_loss_calls)
    assert messages[0] == messages[1] and "ranks disagree on tiled_cp_cross_entropy call" in messages[0], messages
    assert "dtype: rank 0 'torch.float64', rank 1 'torch.float32'" in messages[0]
    assert all("is a process group that this rank" in m and "not a member of" in m for m in messages[2:]), messages


def _unnamed_2d_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))  # unnamed: FA4ContextParallelAttention reads it as (ring, ulysses)
    model = tiny_model("llama")
    try:
        enable_context_parallel(model, mesh=mesh).disable()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), model.config._attn_implementation
    return "no error", "", model.config._attn_implementation


def test_an_unnamed_2d_mesh_is_refused_naming_the_dims(pool):
    """The loss sums over the flattened mesh, which torch builds only for named dims: a clear ValueError at
    enable time (not torch's RuntimeError from inside), and the model keeps its own attention."""
    for kind, message, attn in pool.run(_unnamed_2d_mesh):
        assert kind == "ValueError" and "mesh_dim_names=('ring', 'ulysses')" in message, (kind, message)
        assert attn == "eager"


def _two_submeshes_of_one_root(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    whole = root._unflatten(0, (2, 2), ("ring", "ulysses"))  # cp = 4
    pairs = root._unflatten(0, (2, 1, 2), ("dp", "ring", "ulysses"))["ring", "ulysses"]  # dp = 2 x cp = 2
    groups = []
    for mesh in (whole, pairs, whole):
        with enable_context_parallel(tiny_model("llama"), mesh=mesh) as handle:
            groups.append(handle.loss_group)
    return [sorted(dist.get_process_group_ranks(g)) for g in groups], groups[2] is groups[0]


def test_handles_on_two_submeshes_of_one_root_mesh_get_their_own_loss_groups(pool):
    """The loss group is the flattened 2-D mesh, which torch keeps by name on the root mesh: a second handle on
    another submesh of that root gets a group of its own ranks (not torch's "has been created before" error), a
    handle on the first mesh again gets the first one's group back."""
    for rank, (groups, reused) in enumerate(pool.run(_two_submeshes_of_one_root)):
        assert groups == [[0, 1, 2, 3], [0, 1] if rank < 2 else [2, 3], [0, 1, 2, 3]], (rank, groups)
        assert reused, rank


TWO_HEADS = dict(num_attention_heads=2, num_key_value_heads=2)


def _plan_degree(rank, world):
    model = tiny_model("llama", **TWO_HEADS)
    handle = enable_context_parallel(model, group=GROUPS[4])
    plan = handle.make_plan([0, 23, 64, 81])
    runs = handle._planner.cp.degree(2, 2, plan)
    handle.disable()
    return plan.ulysses_degree, runs


def test_the_handles_plans_balance_for_the_degree_auto_runs(pool):
    """2 / 2 heads at cp 4: auto runs Ulysses over 2 ranks and a ring of 2 groups.  The handle costed its plans for
    a ring of 4 (it did not pass the model's head counts): exact, but the ring groups were up to 1.04x apart on
    document mixes that a plan for degree 2 balances within 0.5%."""
    assert pool.run(_plan_degree) == [(2, 2)] * 4
    check_against_oracle(pool.run(_cp_run, family="llama", cp=4, tiled=False, overrides=TWO_HEADS)[0],
                         packed_oracle("llama", **TWO_HEADS))


def _hybrid_on_one_group(rank, world):
    if rank >= 2:
        return None
    model = tiny_model("llama")
    try:
        enable_context_parallel(model, group=GROUPS[2], strategy="hybrid").disable()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), model.config._attn_implementation
    return "no error", "", model.config._attn_implementation


def test_hybrid_on_one_process_group_is_refused_at_enable_time(pool):
    """The handle takes no ulysses_degree, so 'hybrid' on one group could only fail later, in every attention call
    (asking for an option the handle does not have): refused at enable time, pointing to the 2-D mesh."""
    for kind, message, attn in filter(None, pool.run(_hybrid_on_one_group)):
        assert kind == "ValueError" and "2-D mesh" in message, (kind, message)
        assert attn == "eager"


# ---- single process: refusals and undo ------------------------------------------------------------------------


def test_cp_invariant_must_be_a_bool():
    with pytest.raises(TypeError, match="cp_invariant must be a bool"):
        enable_context_parallel(tiny_model("llama"), cp_invariant="yes")


@pytest.mark.parametrize("options, error, message", [
    (dict(balancer="nope"), ValueError, "balancer must be one of"),
    (dict(num_chunks=0), ValueError, "num_chunks"),
    (dict(balancer="zigzag", num_chunks=3), ValueError, "zigzag balancer needs num_chunks"),
    (dict(check_batch="no"), TypeError, "check_batch must be a bool, got str"),
    (dict(backend="nope"), ValueError, "backend must be 'auto' or one of"),
])
def test_plan_and_batch_options_are_checked_at_enable_time(options, error, message):
    """Refused by enable_context_parallel, before the model's attention is switched (not at the first
    shard_batch, with the model left on an attention it cannot use)."""
    model = tiny_model("llama")
    with pytest.raises(error, match=message):
        enable_context_parallel(model, **options)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("previous", ["eager", "sdpa"])
def test_a_checkpointed_recompute_after_the_with_block_is_refused_by_name(previous):
    """Gradient checkpointing recomputes each layer in the backward. A backward run after the handle's with block
    recomputes under the model's own attention (the config was switched back), with the shard's mask: that is
    refused naming the cause (transformers' attention raised a TypeError about a CheckedCausalMask). The same step
    with its backward inside the block trains."""
    model = hf_tiny.tiny_model("llama", 0, attn_implementation=previous)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = packed_batch()
    with enable_context_parallel(model) as handle:
        local = handle.shard_batch(batch)
        loss = handle.loss(model(**local).logits, local)
        late = handle.loss(model(**local).logits, local)
        loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(RuntimeError, match="context-parallel attention was switched off .* with block"):
        late.backward()


def test_enabling_one_model_again_reuses_its_registrations():
    """Each enable registered a new name with transformers' attention and mask interfaces, kept after disable (for
    the error a copy made while enabled gets): a loop enabling per step grew both registries by one entry a step.
    A model enabled again takes its name again; another model gets its own."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model, other = tiny_model("llama"), tiny_model("llama")
    sizes = lambda: (len(AttentionInterface._global_mapping), len(AttentionMaskInterface._global_mapping))  # noqa: E731
    with enable_context_parallel(model) as first:
        pass
    before = sizes()
    for _ in range(3):
        with enable_context_parallel(model) as again:
            assert again.name == first.name
    assert sizes() == before
    with enable_context_parallel(other) as elsewhere:
        assert elsewhere.name != first.name


def test_disable_restores_the_models_own_attention():
    model = tiny_model("llama")
    batch = packed_batch()
    with torch.no_grad():
        before = model(**batch, use_cache=False).logits
        with enable_context_parallel(model) as handle:
            assert model.config._attn_implementation == handle.name
            local = handle.shard_batch(batch)
            ours = model(**local).logits
        assert model.config._attn_implementation == "eager"
        after = model(**batch, use_cache=False).logits
        want = per_document_logits(model, batch)
    assert torch.equal(before, after)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)  # cp = 1: the whole batch
    with pytest.raises(RuntimeError, match="disabled"):
        handle.shard_batch(batch)
    # a batch sharded while it was enabled: the model's own attention ignores its plan (at cp > 1 each rank would
    # attend within its shard only, a loss ~2e-3 off), so the model and the losses refuse it
    with torch.no_grad(), pytest.raises(RuntimeError, match="sharded by a context-parallel handle"):
        model(**local)
    with pytest.raises(RuntimeError, match="handle.loss: this context-parallel handle was disabled"):
        handle.loss(ours, local)
    with pytest.raises(RuntimeError, match="TiledCausalLMLoss: this context-parallel handle was disabled"):
        TiledCausalLMLoss(model, handle)(local)
    handle.disable()  # idempotent
    with enable_context_parallel(model) as again:  # enabled again: the guard (one per model) lets its batch through
        assert torch.equal(model(**again.shard_batch(batch)).logits, ours)
    guards = [hook for hook in decoder_of(model)._forward_pre_hooks.values() if hook.__name__ == "_sharded_batch_guard"]
    assert len(guards) == 1


def test_group_none_under_torchrun_without_a_process_group_is_refused(monkeypatch):
    """group=None is the whole world once torch.distributed is initialized; a process that torchrun started as one
    of several, with no process group yet, would run alone on the whole batch (cp = 1 on every rank, silently)."""
    assert not torch.distributed.is_initialized()  # the pytest process itself: the cp tests run in spawned workers
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="init_process_group"):
        enable_context_parallel(model)
    assert model.config._attn_implementation == "eager"  # refused before anything was switched
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: that process is the world
    with enable_context_parallel(model) as handle:
        assert handle.cp_size == 1


def test_chunk_starts_follow_transformers_rule():
    """Chunks are counted on the positions of a packed row (transformers remaps indices to positions there) and on
    the token index of a row of one document (whatever its first position)."""
    packed = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7])
    assert chunk_starts(packed, 3).tolist() == [0, 3, 5, 8, 11]
    assert chunk_starts(torch.arange(5, 13), 3).tolist() == [0, 3, 6]


def test_disable_gives_back_the_models_temperature_tuning():
    model = tiny_model("llama4", **LLAMA4_TUNED)
    tuned = [m for m in model.modules() if getattr(m, "attn_temperature_tuning", None) is not None]
    before = [m.attn_temperature_tuning for m in tuned]
    with enable_context_parallel(model) as handle:
        assert len(handle.temperature_tuned) == 1  # the NoPE layer (the last of four)
        assert not handle.temperature_tuned[0].attn_temperature_tuning
    assert [m.attn_temperature_tuning for m in tuned] == before


def test_unsupported_models_and_options_are_refused():
    with pytest.raises(UnsupportedMask, match="chunked attention .* and a sliding window"):
        enable_context_parallel(tiny_model("mistral", attention_chunk_size=8))
    with pytest.raises(UnsupportedMask, match=r"layer types \['linear_attention'\]"):
        enable_context_parallel(tiny_model("llama", layer_types=["linear_attention", "full_attention"]))
    dropout = tiny_model("llama", attention_dropout=0.1).train()
    with enable_context_parallel(dropout) as handle, pytest.raises(UnsupportedMask, match="dropout"):
        dropout(**handle.shard_batch(packed_batch()))
    model = tiny_model("llama")
    with enable_context_parallel(model) as handle:
        with pytest.raises(ValueError, match="already enabled"):
            enable_context_parallel(model)
        with pytest.raises(ValueError, match="shard_batch"):
            model(**packed_batch(), use_cache=False)  # a batch that was not sharded
        two_rows = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
        with pytest.raises(ValueError, match=r"\(1, T\)"):
            handle.shard_batch(two_rows)
        padded = dict(packed_batch(), attention_mask=torch.ones(1, sum(LENGTHS), dtype=torch.long))
        padded["attention_mask"][0, -3:] = 0
        with pytest.raises(UnsupportedMask, match="padding"):
            handle.shard_batch(padded)


def test_a_model_sharing_the_enabled_models_config_is_told_so():
    """transformers switches attention through the config object: a second model built on the same config (a
    policy and its reference model, say) reaches the handle too.  A sharded batch runs through it (as a copy made
    while enabled does); an unsharded one is refused naming the shared config, not only asked for a sharded batch."""
    model = tiny_model("llama")
    other = type(model)(model.config).double()  # the same config object
    other.load_state_dict(model.state_dict())
    batch = packed_batch()
    with enable_context_parallel(model) as handle:
        with pytest.raises(ValueError, match="shares that config object"):
            other(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        with pytest.raises(ValueError, match="enabled on another model .*shares that config object"):
            enable_context_parallel(other)
        local = handle.shard_batch(batch)
        assert torch.equal(other(**local).logits, model(**local).logits)
    assert torch.isfinite(other(input_ids=batch["input_ids"], use_cache=False).logits).all()


def test_a_copy_made_while_enabled_gets_back_the_original_attention():
    """A deep copy made while enabled keeps the handle's attention name after disable(): its error names the
    attention to set back, and a handle enabled on the copy restores that one (not the dead name) when disabled."""
    import copy

    model = tiny_model("llama")
    with enable_context_parallel(model):
        twin = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match=r"a copy made while enabled: model.set_attn_implementation\('eager'\)"):
        twin(input_ids=packed_batch()["input_ids"], use_cache=False)
    with enable_context_parallel(twin) as handle:
        assert handle.previous == "eager"
    assert twin.config._attn_implementation == "eager"


@pytest.mark.parametrize("change, error, message", [
    # each was an AttributeError deep in shard_batch ('list' object has no attribute 'shape' / 'new_full')
    (lambda b: dict(b, labels=b["labels"].tolist()), TypeError,
     r"batch\['labels'\] must be a torch.Tensor \(1, 81\) like input_ids, got list"),
    (lambda b: dict(b, labels=b["labels"].numpy()), TypeError, r"batch\['labels'\] .* got ndarray"),
    (lambda b: dict(b, position_ids=b["position_ids"].tolist()), TypeError, r"batch\['position_ids'\] .* got list"),
    (lambda b: dict(b, attention_mask=[[1] * 81]), TypeError, r"batch\['attention_mask'\] .* got list"),
    (lambda b: dict(b, input_ids=b["input_ids"].tolist()), TypeError,
     r"batch\['input_ids'\] must be a \(1, T\) torch.Tensor: one packed row, as DataCollatorWithFlattening makes "
     r"\(return_tensors='pt'\); got list"),
    # no mapping at all: was "batch['input_ids'] must be a (1, T) tensor ...; got NoneType"
    (lambda b: [b], TypeError, r"batch must be a mapping .* got list"),
    # float ids went through (truncated by the checksum) to fail deep in the embedding; float positions went into
    # RoPE silently (a position 3.5); bool labels had their IGNORE tail turned into True (the loss refused them)
    (lambda b: dict(b, input_ids=b["input_ids"].double()), TypeError,
     r"batch\['input_ids'\] must hold integers, got dtype torch.float64"),
    (lambda b: dict(b, position_ids=b["position_ids"] + 0.5), TypeError,
     r"batch\['position_ids'\] must hold integers, got dtype torch.float32"),
    (lambda b: dict(b, labels=b["labels"] > 0), TypeError,
     r"batch\['labels'\] must hold integers, got dtype torch.bool"),
    # ids outside the model's embedding: an IndexError deep in the embedding (a device-side assert on CUDA, which
    # takes down that rank alone)
    (lambda b: dict(b, input_ids=b["input_ids"] + VOCAB), ValueError,
     rf"batch\['input_ids'\] must be ids in \[0, vocab_size={VOCAB}\), got ids from \d+ to \d+"),
    (lambda b: dict(b, input_ids=b["input_ids"] - VOCAB), ValueError, r"got ids from -\d+ to"),
    # on another device than input_ids: went on to fail deep in the model or the loss
    (lambda b: dict(b, labels=b["labels"].to("meta")), ValueError,
     r"batch\['labels'\] is on meta but batch\['input_ids'\] on cpu"),
])
def test_batch_entries_that_are_not_integer_tensors_are_refused_by_name(change, error, message):
    """What shard_batch takes in place of a (1, T) integer tensor is refused naming the key and what it expected."""
    with enable_context_parallel(tiny_model("llama")) as handle:
        with pytest.raises(error, match=message):
            handle.shard_batch(change(packed_batch()))


def test_output_attentions_warns_that_no_weights_come_back():
    """model(..., output_attentions=True) returned attentions=() without a word (the single-device integration and
    transformers' own fused attentions warn): the attention never makes the weights, nor could a rank, holding a
    shard of the queries and keys."""
    import warnings

    model = tiny_model("llama")
    with enable_context_parallel(model) as handle:
        local = handle.shard_batch(packed_batch())
        with pytest.warns(UserWarning, match=r"context-parallel attention does not return attention weights "
                                             r"\(output_attentions=True gives none\)"):
            model(**local, output_attentions=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**local, output_attentions=False)


def test_autocast_bf16_runs_the_attention_in_the_autocast_dtype():
    """Under torch.autocast(bf16) the call gets fp32 query/key (the rotary embedding's fp32 cos/sin) with a bf16
    value: fa4dist refused them ('q, k and v must share a dtype').  Now they run in bf16, as the model's own eager
    attention under the same autocast does (each document alone): the same loss and gradients to a few bf16 ulps,
    the sinks' included."""
    batch = packed_batch()
    results = []
    for cp in (False, True):
        model = tiny_model("gpt_oss").float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if cp:
                handle = enable_context_parallel(model)
                local = handle.shard_batch(batch)
                loss = handle.loss(model(**local).logits, local)
            else:
                ids, bounds = batch["input_ids"][0], torch.tensor((0,) + LENGTHS).cumsum(0).tolist()
                logits = torch.cat([model(input_ids=ids[None, a:b], use_cache=False).logits[0].float()
                                    for a, b in zip(bounds, bounds[1:])])
                loss = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], ignore_index=-100)
        loss.backward()
        if cp:
            handle.disable()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    rel = 8 * torch.finfo(torch.bfloat16).eps
    hf_tiny.assert_close_rel(got, want, rel, "loss")
    assert {f"model.layers.{i}.self_attn.sinks" for i in range(2)} <= got_grads.keys()
    for name, g in want_grads.items():
        hf_tiny.assert_close_rel(got_grads[name], g, rel, name)


def test_the_attention_call_takes_windows_softcap_and_sinks_and_refuses_the_rest():
    model = tiny_model("gpt_oss")
    with enable_context_parallel(model) as handle:
        plan = handle.shard_batch(packed_batch())[PLAN_KEY]
        assert handle.plan_window == (-1, -1)  # GPT-OSS interleaves global layers: the plan is costed causal
        module = model.model.layers[0].self_attn
        q = torch.randn(1, 4, sum(LENGTHS), 16, dtype=torch.float64)
        kv = torch.randn(1, 2, sum(LENGTHS), 16, dtype=torch.float64)
        mask = CheckedCausalMask("exhaustive", (5, 0))
        out, _ = _cp_attention(module, q, kv, kv, mask, scaling=0.25, sliding_window=6, softcap=2.0, s_aux=module.sinks,
                               **{PLAN_KEY: plan})
        assert out.shape == (1, sum(LENGTHS), 4, 16) and bool(out.isfinite().all())
        assert (0.25, (5, 0), 2.0) in handle._cores  # scaling, window, softcap
        for option, message in ((dict(sliding_window=16), "sliding window of 16 tokens but the layer's mask has a "
                                                          "sliding window of 6"),
                                (dict(sinks=torch.zeros(1, 4, sum(LENGTHS), 1)), "per-token"),
                                (dict(s_aux=torch.zeros(2, dtype=torch.float64)), r"shape \(4,\)")):
            with pytest.raises(UnsupportedMask, match=message):
                _cp_attention(module, q, kv, kv, mask, **option, **{PLAN_KEY: plan})
        module.is_causal = False
        with pytest.raises(UnsupportedMask, match="bidirectional"):
            _cp_attention(module, q, kv, kv, mask, **{PLAN_KEY: plan})
    mistral = tiny_model("mistral")
    with enable_context_parallel(mistral) as handle:
        assert handle.plan_window == (hf_tiny.WINDOW - 1, 0)  # every layer has the window: the plan is costed with it


def test_documents_from_flash_kwargs_or_position_ids_agree():
    gen = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in LENGTHS]
    flash = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs)
    model = tiny_model("llama")
    with enable_context_parallel(model) as handle:
        want = torch.tensor((0,) + LENGTHS).cumsum(0)
        assert torch.equal(handle.document_boundaries(flash), want)
        assert torch.equal(handle.document_boundaries(packed_batch()), want)
        local = handle.shard_batch(flash)
        assert "cu_seq_lens_q" not in local and local["input_ids"].shape == (1, sum(LENGTHS))
        bad = dict(flash, cu_seq_lens_k=flash["cu_seq_lens_k"].flip(0))
        with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
            handle.shard_batch(bad)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):  # a float one was truncated by .long(), silently
            bad = dict(flash, **{key: flash[key].double() + 0.5})
            with pytest.raises(TypeError, match=rf"batch\['{key}'\] must hold integers, got dtype torch.float64"):
                handle.shard_batch(bad)
        # cu_seq_lens that contradict position_ids (one document where the positions restart twice) ran the
        # documents as one, silently (the single-process attention refuses them: "disagrees")
        one = torch.tensor([0, sum(LENGTHS)], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 81\]\.\.\. disagrees with the documents of "
                                             r"position_ids .*\[0, 23, 64, 81\]"):
            handle.shard_batch(dict(flash, cu_seq_lens_q=one, cu_seq_lens_k=one))
        # positions that run on through the row leave the documents to cu_seq_lens (as in one process)
        running = dict(flash, position_ids=torch.arange(sum(LENGTHS))[None])
        assert torch.equal(handle.document_boundaries(running), want)


def _a_second_thread_on_the_handles_group(rank, world, key, holder, intruder):
    """cp_cases.intrusion on a fresh group of ranks 0 and 1: the handle's shard_batch, its attention module or
    tiled_cp_cross_entropy, one of them holding the group on one thread and another made from a second thread."""
    import cp_cases
    from cp_harness import fresh_group

    from fa4dist.context_parallel import make_plan

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    handle = enable_context_parallel(tiny_model("llama"), group=group, backend="reference", timeout=20.0)
    plan = make_plan(8, 2)
    local = [plan.shard(t, seq_dim=1, rank=rank) for t in cp_cases.global_inputs(0, 8, 1, 1, 8, torch.float64,
                                                                                  batch=1)[:3]]
    calls = {"shard_batch": lambda: handle.shard_batch(packed_batch()),
             "attention": lambda: handle.attention(None)(*local, plan=plan)}
    if "tiled_cp_cross_entropy" in (holder, intruder):
        calls["tiled_cp_cross_entropy"] = cp_cases.intruding_call("tiled_cp_cross_entropy", group, rank, 20.0)
    try:
        return cp_cases.intrusion(rank, key, group, calls[holder], calls[intruder])
    finally:
        handle.disable()


@pytest.mark.parametrize("holder, intruder", [("attention", "shard_batch"), ("shard_batch", "attention"),
                                              ("attention", "tiled_cp_cross_entropy")])
def test_a_batch_or_a_tiled_loss_from_a_second_thread_is_refused_at_once(pool, holder, intruder):
    """shard_batch's checksum exchange (an all-gather on the cp group) did not take the group's thread guard that
    the attention's calls take: a batch sharded on a data thread while the model ran on the group went ahead and
    paired with another call on some ranks (here: waited for a call the other rank never makes).  Now the second
    thread is refused at once, and the call holding the group raises when it ends, naming it."""
    import uuid

    (refused, held), theirs = pool.run(_a_second_thread_on_the_handles_group, key=f"hf-threads-{uuid.uuid4().hex}",
                                       holder=holder, intruder=intruder, timeout=90)[:2]
    kind, message, seconds = refused
    assert kind == "RuntimeError" and "one thread at a time" in message and seconds < 2, refused
    assert held is not None and held[0] == "RuntimeError" and "not trusted" in held[1], held
    assert theirs is None


def _one_rank_skips_shard_batch(rank, world):
    """Ranks 0 and 1 of a throw-away group: rank 0 shards a batch, rank 1 never does (its data ran out): rank 0's
    (error, seconds)."""
    import time

    from cp_harness import fresh_group

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    handle = enable_context_parallel(tiny_model("llama"), group=group, timeout=2.0)
    start = time.monotonic()
    try:
        if rank == 0:
            handle.shard_batch(packed_batch())
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    finally:
        handle.disable()
    return "no error", time.monotonic() - start


def test_shard_batch_waits_the_handles_timeout(pool):
    """shard_batch's checksum exchange was a plain all-gather: a rank whose peer never sharded its batch waited for
    the process group's own timeout (30 min by default; 2 min in this pool), not the handle's, and then failed with
    gloo's error naming nothing of fa4dist.  Now it raises CommError after the handle's timeout, naming the check."""
    got, seconds = pool.run(_one_rank_skips_shard_batch, timeout=30)[0]
    assert got.startswith("CommError: fa4dist shard_batch") and "timeout 2s" in got and "same batch" in got, got
    assert seconds < 10, seconds


def _forward_with_a_cache(rank, world, case):
    """model(**local) on ranks 0 and 1 of a throw-away group with a KV cache asked for (both ranks, or rank 1 only),
    or with use_cache left out: (error or the gathered logits, whether a cache came back, seconds it took)."""
    import time

    import torch.distributed as dist
    from cp_harness import fresh_group

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    model = tiny_model("llama")
    model.eval()
    handle = enable_context_parallel(model, group=group, timeout=10.0)
    local = handle.shard_batch(packed_batch())
    if case == "left_out":
        del local["use_cache"]  # the model's config says use_cache=True
    elif case == "both" or rank == 1:
        local["use_cache"] = True
    start = time.monotonic()
    try:
        with torch.no_grad():
            out = model(**local)
    except ValueError as err:
        return f"{type(err).__name__}: {err}", None, time.monotonic() - start
    finally:
        handle.disable()
    parts = [None, None]
    dist.all_gather_object(parts, out.logits, group=group)
    return local[PLAN_KEY].unshard(parts, seq_dim=1), out.past_key_values is not None, time.monotonic() - start


@pytest.mark.parametrize("case", ["both", "one_rank"])
def test_a_kv_cache_under_context_parallelism_is_refused_on_every_rank(pool, case):
    """use_cache=True used to fill each rank's cache with its shard's keys and values alone (a later decode step
    after disable() read them as the whole prompt's, silently); now every rank refuses it, at once."""
    import re

    results = pool.run(_forward_with_a_cache, case=case, timeout=30)[:2]
    for rank, (got, _, seconds) in enumerate(results):
        assert isinstance(got, str) and re.search(r"KV cache", got), (rank, got)
        assert seconds < 5, (rank, seconds, got)


def test_use_cache_left_out_runs_without_a_cache(pool):
    """A local batch without use_cache (the model's config defaults it to True) runs with no cache: the logits are
    the per-document oracle's and no cache comes back."""
    (logits, cached, _), _ = pool.run(_forward_with_a_cache, case="left_out", timeout=30)[:2]
    with torch.no_grad():
        want = per_document_logits(tiny_model("llama"), packed_batch())
    assert not cached
    hf_tiny.assert_close_rel(logits, want, REL, "logits")


def gapped_batch() -> dict:
    """packed_batch() whose second document's positions go on from the first's after a gap (0..22, 30..70, 0..16),
    as hand-made position_ids may: transformers' own mask reads three documents (a position that does not continue
    the one before by one starts one), flash-attention's rule (a return to the row's first position) two."""
    batch = packed_batch()
    a, b, c = LENGTHS
    batch["position_ids"] = torch.cat([torch.arange(a), torch.arange(30, 30 + b), torch.arange(c)])[None]
    return batch


def _gapped_cp_loss(rank, world, cp):
    """On ranks < cp: the summed loss shares and all-reduced gradients of gapped_batch() (rank 0 returns them)."""
    import torch.distributed as dist

    if rank >= cp:
        return None
    model = tiny_model("llama")
    with enable_context_parallel(model, group=GROUPS[cp]) as handle:
        local = handle.shard_batch(gapped_batch())
        loss = handle.loss(model(**local).logits, local)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=GROUPS[cp])
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=GROUPS[cp])
    return (float(total), grads) if rank == 0 else None


def test_a_gap_in_position_ids_gives_the_same_documents_at_cp_1_and_cp_2(pool):
    """position_ids with a gap were two documents under context parallelism (document_boundaries: transformers'
    rule) but one at cp = 1 wherever transformers built no document mask (use_cache=True; GPT-OSS always), where
    fa4dist's attention split rows only at returns to the first position: another loss at each cp size.  One rule
    now, transformers' own: the same loss and gradients at cp = 1 (with a cache or without) and cp = 2."""
    from fa4dist.integrations.hf import register

    name = register()
    batch = gapped_batch()
    model = tiny_model("llama")
    model.set_attn_implementation(name)
    targets = torch.cat([batch["labels"][0, 1:], torch.tensor([-100])])
    want = None
    for use_cache in (False, True):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=use_cache).logits
        loss = torch.nn.functional.cross_entropy(logits[0], targets, ignore_index=-100)
        loss.backward()
        got = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if want is None:
            want = got
        else:
            assert_rel_close(got[0], want[0], "cp = 1 with a cache")
    cp2_loss, cp2_grads = pool.run(_gapped_cp_loss, cp=2)[0]
    assert_rel_close(cp2_loss, want[0], "cp = 2")
    for n, g in want[1].items():
        hf_tiny.assert_close_rel(cp2_grads[n], g, REL, n)


def test_a_copy_of_the_model_keeps_its_temperature_tuning_under_context_parallelism():
    """A copy made while context parallelism is on (an EMA model, say) has the tuning flag off as the handle set it:
    its NoPE layers still get the tuning, from the global index (it was in the handle's list of modules only); a
    module whose own tuning is on again would scale by the shard's index, and is refused."""
    import copy

    model = tiny_model("llama4", **LLAMA4_TUNED)
    batch = packed_batch()
    with enable_context_parallel(model) as handle:
        local = handle.shard_batch(batch)
        want = model(**local).logits
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(**local).logits, want, rtol=0, atol=0)
        next(m for m in twin.modules() if getattr(m, "use_rope", True) == 0).attn_temperature_tuning = True
        with pytest.raises(UnsupportedMask, match="tuned its queries' temperature itself"):
            twin(**local)


@pytest.mark.parametrize("family", ["llama", "llama4"])
def test_the_tiled_loss_runs_without_a_cache_and_refuses_one(family):
    """The cache hook sat on the base model, which for Llama 4 is the task head itself: TiledCausalLMLoss calls the
    decoder stack directly, so there use_cache=True filled a cache with the shard's keys alone and use_cache left
    out (the config's True) built one, silently.  The hook is on the decoder stack now: refused, and left out runs
    without one, as through the model."""
    model = tiny_model(family)
    caches = []
    watch = decoder_of(model).register_forward_hook(lambda m, args, out: caches.append(out.past_key_values))
    with enable_context_parallel(model) as handle:
        local = handle.shard_batch(packed_batch())
        loss = TiledCausalLMLoss(model, handle, chunk_tokens=16)
        del local["use_cache"]
        loss(local)
        assert caches == [None]
        local["use_cache"] = True
        with pytest.raises(UnsupportedMask, match="KV cache"):
            loss(local)
    watch.remove()
