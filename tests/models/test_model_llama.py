"""The Llama-style model, its loss and its data pipeline: packed documents equal separate runs, RoPE takes global
positions, the context-parallel model (2 gloo processes, ring and Ulysses) equals the single-process one in fp64
(loss and every gradient), and the FLOP accounting."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fa4dist.data import (
    EOS, IGNORE, ByteTokenizer, PackedTokenStream, Sample, SingleRankPlan, collect_documents,
    positions_from_cu_seqlens, shard_sample,
)
from fa4dist.models import PRESETS, FA4Llama, ModelConfig, cp_cross_entropy, get_config

TINY = get_config("tiny")


def _model(cfg=TINY, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    return FA4Llama(cfg, **kw).to(dtype)


def _docs_sample(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(0, 256, (total,), generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    labels = torch.roll(tokens, -1).clone()
    labels[cu[1:].long() - 1] = IGNORE
    return Sample(tokens, labels, positions_from_cu_seqlens(cu), cu)


def test_packed_documents_equal_separate_runs():
    model = _model()
    sample = _docs_sample([7, 13, 1, 20])
    packed = model(sample.tokens, sample.positions, SingleRankPlan(sample.cu_seqlens))
    cu = sample.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        alone = model(sample.tokens[a:b], torch.arange(b - a), SingleRankPlan(torch.tensor([0, b - a])))
        torch.testing.assert_close(packed[a:b], alone, rtol=0, atol=1e-12)


def test_rope_uses_the_given_positions():
    """Rotary embeddings see exactly the positions given: a common shift changes nothing (RoPE is relative), a
    different distance does (so the plan's positions, not local indices, are what counts)."""
    model = _model()
    tokens = torch.randint(0, 256, (16,))
    whole = model(tokens, torch.arange(16), SingleRankPlan(torch.tensor([0, 16])))
    pair = tokens[9:11]
    right = model(pair, torch.tensor([9, 10]), SingleRankPlan(torch.tensor([0, 2])))
    shifted = model(pair, torch.tensor([0, 1]), SingleRankPlan(torch.tensor([0, 2])))
    torch.testing.assert_close(right, shifted, rtol=0, atol=1e-10)
    head = model(tokens[:2], torch.arange(2), SingleRankPlan(torch.tensor([0, 2])))
    torch.testing.assert_close(whole[:2], head, rtol=0, atol=1e-12)  # causal: a prefix does not see the rest
    far = model(pair, torch.tensor([0, 5]), SingleRankPlan(torch.tensor([0, 2])))
    assert (far[1] - right[1]).abs().max() > 1e-6  # a different distance does


def test_loss_is_token_mean_and_shares_add_up():
    model = _model()
    sample = _docs_sample([30, 50])
    logits = model(sample.tokens, sample.positions, SingleRankPlan(sample.cu_seqlens))
    res = cp_cross_entropy(logits, sample.labels)
    ref = torch.nn.functional.cross_entropy(logits, sample.labels, ignore_index=IGNORE)
    torch.testing.assert_close(res.loss, ref)
    assert int(res.tokens) == sample.num_label_tokens == 78


def test_activation_checkpointing_same_gradients():
    sample = _docs_sample([40, 24])
    grads = []
    for ac in (False, True):
        model = _model()
        model.set_activation_checkpointing(ac)
        out = model(sample.tokens, sample.positions, SingleRankPlan(sample.cu_seqlens))
        cp_cross_entropy(out, sample.labels).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_config_checks_and_presets():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="model size"):
        get_config("huge")
    with pytest.raises(TypeError, match=r"model size must be a preset name \(one of .*\), got list"):
        get_config(["tiny"])
    sizes = {}
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            sizes[name] = FA4Llama(cfg).num_parameters()
    assert sizes["tiny"] < 1e6 and 80e6 < sizes["small"] < 130e6 and 0.9e9 < sizes["1b"] < 1.1e9


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(n_kv_heads=0), ValueError, "n_kv_heads must be >= 1, got 0"),
    (dict(n_heads=0), ValueError, "n_heads must be >= 1, got 0"),
    (dict(n_layers=-1), ValueError, "n_layers must be >= 0, got -1"),
    (dict(dim=0), ValueError, "dim must be >= 1, got 0"),
    (dict(head_dim=0), ValueError, "head_dim must be >= 1, got 0"),
    (dict(vocab_size=0), ValueError, "vocab_size must be >= 1, got 0"),
    (dict(ffn_dim=0), ValueError, "ffn_dim must be >= 1, got 0"),
    (dict(n_heads=4.0), TypeError, "n_heads must be an int, got float"),
    (dict(rope_theta=0.0), ValueError, "rope_theta must be finite and > 0"),
    (dict(norm_eps=-1e-5), ValueError, "norm_eps must be finite and >= 0"),
    (dict(init_std=float("nan")), ValueError, "init_std must be finite"),
    (dict(tie_embeddings="no"), TypeError, "tie_embeddings must be a bool, got str"),
    (dict(tie_embeddings=1), TypeError, "tie_embeddings must be a bool, got int"),
])
def test_config_refuses_bad_sizes_by_name(kwargs, error, message):
    """A zero, negative or non-int size, or a bad float, names the field (it was a ZeroDivisionError, a torch
    shape error, or a model silently built with no layers, no head dims or no MLP)."""
    with pytest.raises(error, match=message):
        get_config("tiny", **kwargs)


def test_training_flops_formula():
    model = _model(dtype=torch.float32)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    n_mm = model.num_parameters(matmul_only=True)
    pairs = 10 * 11 / 2 + 20 * 21 / 2
    c = TINY
    want = 6 * n_mm * 30 + 12 * c.n_layers * c.n_heads * c.resolved_head_dim * pairs
    assert model.training_flops([cu]) == pytest.approx(want)




@pytest.mark.parametrize("window, chunk", [(None, None), (4, None), (None, 6), (4, 6), (7, 6), (1, None)])
def test_training_flops_count_the_pairs_each_layer_mask_leaves_visible(window, chunk):
    """P, the visible pairs of a windowed or chunked layer, is the count of the contract's mask (fa4dist.kernels.mask:
    causal and a window of W tokens, within each document's chunks of C tokens), brute-forced here."""
    from fa4dist.kernels.mask import Mask, visible
    from fa4dist.models import causal_training_flops

    samples = [[0, 1, 5, 17, 30], [0, 6, 12, 13]]
    mask = Mask.canonical(True, (-1, -1) if window is None else (window - 1, 0))
    pairs = 0
    for cu in samples:
        for a, b in zip(cu, cu[1:]):
            for start in range(a, b, chunk or max(b - a, 1)):
                pos = torch.arange(start, min(start + (chunk or b - a), b))
                pairs += int(visible(pos, pos, mask).sum())
    got = causal_training_flops(0, 2, 1, 1, samples, layer_masks=[(window, chunk), (None, None)])
    full = sum((b - a) * (b - a + 1) // 2 for cu in samples for a, b in zip(cu, cu[1:]))
    assert got == 12 * (pairs + full), (got, pairs, full)


def test_training_flops_takes_cu_seqlens_as_make_plan_does():
    """A list of boundaries (as make_plan takes them) was a TypeError from list subtraction; one sample's tensor
    instead of a list of them an IndexError from its 0-d elements; decreasing boundaries counted negative tokens."""
    model = _model(dtype=torch.float32)
    want = model.training_flops([torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 7])])
    assert model.training_flops([[0, 10, 30], (0, 7)]) == want
    assert model.training_flops([torch.tensor([0, 10, 30]), [0, 7]]) == want
    for bad in (torch.tensor([0, 10, 30]), [0, 10, 30]):
        with pytest.raises(TypeError, match=r"cu_seqlens_list must be a list of samples' cu_seqlens .*\[cu_seqlens\]"):
            model.training_flops(bad)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        model.training_flops([[0, 30, 10]])


# ---------------------------------------------------------------------------------------------------------------
# data


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len("héllo".encode()) + 2
    assert tok.decode(ids) == "héllo"


def test_packed_windows_have_document_structure(tmp_path):
    (tmp_path / "a.md").write_text("alpha " * 20)
    (tmp_path / "b.py").write_text("print('beta')\n" * 5)
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    docs = collect_documents([tmp_path])
    assert len(docs) == 2
    stream = PackedTokenStream(docs, seqlen=64, seed=3)
    for i in range(stream.num_windows):
        s = stream.window(i)
        cu = s.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 64 and s.tokens.shape == s.labels.shape == s.positions.shape == (64,)
        for a, b in zip(cu[:-1], cu[1:]):
            assert s.positions[a:b].tolist() == list(range(b - a))
        # inside a document the label is the next token; never across a boundary
        for j in range(63):
            if j + 1 not in cu:
                assert s.labels[j] == s.tokens[j + 1]
        for b in cu[1:-1]:
            assert s.labels[b - 1] == IGNORE
    # the window order is seeded and a pure function of the index
    assert torch.equal(stream.window(5).tokens, PackedTokenStream(docs, 64, seed=3).window(5).tokens)
    stream_mode = PackedTokenStream(docs, seqlen=64, packing="stream").window(0)
    assert stream_mode.cu_seqlens.tolist() == [0, 64] and (stream_mode.labels != IGNORE).all()
    assert EOS in stream.tokens.tolist()


def test_default_corpus_is_this_repository():
    docs = collect_documents()
    assert any("FA4ContextParallelAttention" in d for d in docs)


# ---------------------------------------------------------------------------------------------------------------
# context parallel (2 processes, gloo)


def _cp_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sample = _docs_sample([37, 63, 1, 149, 50], seed=1)  # 300 tokens, uneven documents
        ref = _model()
        ref_res = cp_cross_entropy(ref(sample.tokens, sample.positions, SingleRankPlan(sample.cu_seqlens)),
                                   sample.labels)
        ref_res.loss.backward()
        results = {}
        # checkpointed: the backward recomputes the attention's forward on its own thread, inside its own call
        # (context parallelism refuses a second thread's call on the group, not that nesting)
        for strategy, checkpointed in (("ring", False), ("ulysses", False), ("ring", True)):
            model = _model(cp_group=dist.group.WORLD, strategy=strategy)
            model.set_activation_checkpointing(checkpointed)
            plan = model.make_plan(sample.cu_seqlens)
            local = shard_sample(sample, plan, model.cp_rank)
            assert torch.equal(local.positions, plan.positions(model.cp_rank))
            res = cp_cross_entropy(model(local.tokens, local.positions, plan), local.labels, dist.group.WORLD)
            res.loss.backward()
            total = res.loss.detach().clone()
            dist.all_reduce(total)
            gerr = 0.0
            for p, q in zip(model.parameters(), ref.parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)
                gerr = max(gerr, float((g - q.grad).abs().max()))
            results[strategy + " checkpointed" * checkpointed] = (float(total), gerr, int(res.tokens))
        if rank == 0:
            queue.put((float(ref_res.loss), int(ref_res.tokens), results))
    except Exception as err:  # pragma: no cover - reported to the test
        queue.put(repr(err))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_context_parallel_model_equals_single_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_cp_worker, args=(2, port, queue), nprocs=2, start_method="spawn")
    got = queue.get(timeout=10)
    assert not isinstance(got, str), got
    ref_loss, ref_tokens, results = got
    for strategy, (loss, gerr, tokens) in results.items():
        assert tokens == ref_tokens
        assert loss == pytest.approx(ref_loss, abs=1e-12), strategy
        assert gerr < 1e-12, (strategy, gerr)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(balancer="nope"), ValueError, "balancer must be one of"),
    (dict(num_chunks=-3), ValueError, "num_chunks must be >= 1"),
    (dict(num_chunks="4"), TypeError, "num_chunks must be an int"),
])
def test_model_make_plan_checks_its_arguments_at_cp_1(kwargs, error, message):
    with pytest.raises(error, match=message):
        _model(dtype=torch.float32).make_plan(torch.tensor([0, 5, 16], dtype=torch.int32), **kwargs)


def test_a_cp_1_model_refuses_a_plan_of_more_ranks():
    """A cp = 2 plan's shard given to a model without a cp group ran its local segments alone (no other rank's
    keys): a silent wrong answer."""
    from fa4dist.context_parallel import make_plan

    sample = _docs_sample([20, 30, 14])
    plan = make_plan(sample.cu_seqlens, 2)
    local = shard_sample(sample, plan, 0)
    with pytest.raises(ValueError, match="the plan is for cp_size=2 but there is no process group"):
        _model()(local.tokens, local.positions, plan)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(strategy="rnig"), ValueError, "strategy must be one of"),
    (dict(ulysses_degree=0), ValueError, "ulysses_degree must be a positive int or None, got 0"),
    (dict(backend="bogus"), ValueError, "backend must be 'auto' or one of"),
    (dict(backend="reference", ulysess_degree=2), TypeError, "unexpected keyword argument 'ulysess_degree'"),
])
def test_a_cp_1_attention_checks_the_options_a_cp_group_takes(kwargs, error, message):
    """Without a cp group (or on one of one rank) the model's attention took a misspelt strategy, a ulysses_degree
    of 0 or a misspelt option silently, and a bad backend name only in the first forward: the same code failed
    once given a cp group. They are checked as a cp group's attention checks them, at construction."""
    from fa4dist.models.attention import make_attention

    with pytest.raises(error, match=message):
        make_attention(None, **kwargs)
    if "ulysess_degree" not in kwargs:
        with pytest.raises(error, match=message):
            FA4Llama(TINY, None, **kwargs)
    make_attention(None, strategy="ulysses", ulysses_degree=1, backend="reference", timeout=5.0)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("tokens, error, message", [
    (torch.tensor([1, 2, TINY.vocab_size, 3]), ValueError,
     r"tokens must be ids in \[0, vocab_size=320\), got ids from 1 to 320"),
    (torch.tensor([1, -1, 2, 3]), ValueError, r"tokens must be ids in \[0, vocab_size=320\), got ids from -1 to 3"),
    (torch.tensor([1.0, 2.0, 3.0, 4.0]), TypeError, "tokens must hold integers, got dtype torch.float32"),
])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(invariant, tokens, error, message):
    """An id past the vocabulary was an IndexError deep inside the embedding (a device-side assert on CUDA)."""
    model = _model()
    if invariant:
        model.set_invariant_grads(True)
    with pytest.raises(error, match=message):
        model(tokens, torch.arange(4), SingleRankPlan([0, 4]))


@pytest.mark.parametrize("positions", [torch.arange(4.0), torch.arange(4.0).to(torch.float64) + 0.5,
                                       torch.tensor([True, False, True, True])])
def test_non_integer_positions_are_refused_by_name(positions):
    """Float positions were taken silently: rotary embeddings at fractional positions."""
    with pytest.raises(TypeError, match=f"positions must hold integers, got dtype {positions.dtype}"):
        _model()(torch.tensor([1, 2, 3, 4]), positions, SingleRankPlan([0, 4]))


def test_narrow_integer_token_ids_are_taken():
    """int8/uint8/int16 ids passed the id check, then failed deep in the embedding (it takes int32/int64 only);
    uint16/uint32/uint64 ids (uint16: the usual on-disk token format) failed inside the id check itself, with torch's
    NotImplementedError '"aminmax_cpu" not implemented for 'UInt16''."""
    model = _model()
    tokens = torch.tensor([3, 250, 7, 0, 255])
    want = model(tokens, torch.arange(5), SingleRankPlan([0, 5]))
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.uint16, torch.uint32, torch.uint64):
        got = model(tokens.to(dtype), torch.arange(5), SingleRankPlan([0, 5]))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    model.set_invariant_grads(True)
    model(tokens.to(torch.uint8), torch.arange(5), SingleRankPlan([0, 5])).sum().backward()
    model.invariant_grads.finish()
    assert model.embed_tokens.weight.grad[tokens].abs().sum() > 0


def test_a_model_without_layers_makes_plans():
    """n_layers=0 is a valid config (embedding, norm, head); its cp_size and make_plan were an IndexError (they asked
    the first layer for the attention core)."""
    model = _model(TINY.with_(n_layers=0))
    assert model.cp_size == 1 and model.cp_rank == 0
    plan = model.make_plan(torch.tensor([0, 3, 8], dtype=torch.int32))
    assert model(torch.arange(8), torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]), plan).shape == (8, TINY.vocab_size)


@pytest.mark.parametrize("config", [None, "tiny", {"dim": 64}])
def test_a_config_that_is_not_one_is_refused_by_name(config):
    """A preset name or a dict given as the config was an AttributeError ('str' object has no attribute
    'vocab_size')."""
    with pytest.raises(TypeError, match=r"config must be a fa4dist.models.ModelConfig \(get_config\('tiny'\) for a "
                                        r"preset\), got (NoneType|str|dict)"):
        FA4Llama(config)


def test_a_single_sequence_plan_is_refused_by_name():
    """make_plan(10, 1) (one (batch, seqlen) sequence) given to the model, whose stream is packed, was refused by the
    attention as "q must be 4-D", naming an argument the caller never gave."""
    from fa4dist.context_parallel import make_plan

    with pytest.raises(ValueError, match=r"plan must be a packed-document plan .* single-sequence plan of 10 tokens"):
        _model()(torch.arange(10), torch.arange(10), make_plan(10, 1))


@pytest.mark.parametrize("plan", [[0, 5], torch.tensor([0, 5], dtype=torch.int32)])
def test_a_plan_that_is_not_one_is_refused_by_name(plan):
    """cu_seqlens given where the plan goes was an AttributeError ('list' object has no attribute
    'local_cu_seqlens') from inside the attention."""
    with pytest.raises(TypeError, match="plan must be a sharding plan .* got (list|torch.Tensor)"):
        _model()(torch.arange(5), torch.arange(5), plan)


def test_row_invariant_mlp_rows_do_not_depend_on_their_place_in_the_call_or_the_thread_count():
    """torch's CPU SiLU computes the last elements of a tensor (and of each thread's share) with a scalar formula
    that rounds differently from its vector one (~4% of values, 1 ulp): a row-invariant MLP's row then depended on
    how many rows the call had and on torch.get_num_threads(). Rows (and their input gradients) of calls of 1..30
    rows and of the whole 301 rows at 1 and 2 threads must be the same bytes."""
    from fa4dist.models.llama import MLP

    torch.manual_seed(0)
    mlp = MLP(get_config("tiny", ffn_dim=100))  # 100 columns: row counts leave vector tails of every length
    for m in mlp.modules():
        if hasattr(m, "row_invariant"):
            m.row_invariant = True
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(301, 64, generator=gen), torch.randn(301, 64, generator=gen)

    def rows(n):
        leaf = x[:n].clone().requires_grad_()
        out = mlp(leaf)
        out.backward(dy[:n])
        return out.detach(), leaf.grad

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole, dx = rows(301)
        prefixes = [rows(n) for n in range(1, 31)]
        torch.set_num_threads(2)
        whole2, dx2 = rows(301)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole.view(torch.int32), whole2.view(torch.int32))
    assert torch.equal(dx.view(torch.int32), dx2.view(torch.int32))
    for n, (out, grad) in enumerate(prefixes, start=1):
        assert torch.equal(out.view(torch.int32), whole[:n].view(torch.int32)), n
        assert torch.equal(grad.view(torch.int32), dx[:n].view(torch.int32)), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_invariant_silu_has_silus_derivative_where_exp_overflows(dtype):
    """The row-invariant SiLU was x / (1 + exp(-x)) under autograd: where exp(-x) overflows (x below about -88 in
    fp32/bf16, -709 in fp64) its derivative was inf / inf = NaN, which NaN'd every weight gradient of a row-invariant
    or invariant-gradient step with one such gate activation. Value and derivative must be F.silu's (fp64), finite."""
    from fa4dist.models.llama import silu

    x = torch.tensor([-1e4, -1000.0, -750.0, -100.0, -89.0, -80.0, -3.0, 0.0, 2.5, 90.0, 1e4], dtype=dtype)
    leaf = x.clone().requires_grad_()
    silu(leaf, row_invariant=True).backward(torch.ones_like(x))
    want = x.double().requires_grad_()
    y = torch.nn.functional.silu(want)
    y.backward(torch.ones_like(y))
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert torch.isfinite(leaf.grad).all(), leaf.grad
    torch.testing.assert_close(silu(x, row_invariant=True).double(), y.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(leaf.grad.double(), want.grad, rtol=tol, atol=tol)


def _one_rank_refuses_its_model_inputs(rank, world, case):
    """FA4Llama over a throw-away group of ranks 0 and 1 (attention timeout 20 s), rank 1's arguments refused by the
    model's own checks: (error type, message, seconds) per rank."""
    import time

    from cp_harness import fresh_group

    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    model = _model(TINY, cp_group=group, attention_factory=lambda: FA4ContextParallelAttention(
        group, backend="reference", timeout=20.0))
    sample = _docs_sample([10, 30], seed=2)
    plan = model.make_plan(sample.cu_seqlens)
    local = shard_sample(sample, plan, model.cp_rank)
    tokens, positions = local.tokens, local.positions
    if rank == 1 and case == "token id":
        tokens = tokens.clone()
        tokens[0] = TINY.vocab_size
    elif rank == 1 and case == "float positions":
        positions = positions.double()
    elif rank == 1 and case == "lengths":
        positions = positions[:-1]
    start = time.monotonic()
    try:
        model(tokens, positions, plan)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), time.monotonic() - start
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, error, message", [
    ("token id", "ValueError", f"tokens must be ids in \\[0, vocab_size={TINY.vocab_size}\\)"),
    ("float positions", "TypeError", "positions must hold integers, got dtype torch.float64"),
    ("lengths", "ValueError", "tokens and positions must be 1-D of one length"),
])
def test_a_rank_whose_model_inputs_are_refused_does_not_leave_the_others_waiting(case, error, message):
    """FA4Llama refused its arguments on the rank that had them wrong, before its first attention call: the other cp
    ranks waited in that call's agreement check for the attention's timeout (300 s by default; FA4Llama takes no
    timeout) and raised a CommError naming nothing.  Now the refusal goes through the agreement check: every rank
    raises at once, the others naming rank 1 and its error, rank 1 its own."""
    import re

    from cp_harness import shared_pool

    (kind0, text0, seconds0), (kind1, text1, seconds1) = shared_pool(4).run(
        _one_rank_refuses_its_model_inputs, case=case, timeout=60)[:2]
    assert kind1 == error and re.match(message, text1), (kind1, text1)
    assert kind0 == "ValueError" and f"rank 1 rejected its inputs: {error}: " in text0, (kind0, text0)
    assert re.search(message, text0) and max(seconds0, seconds1) < 5, (text0, seconds0, seconds1)


def _token_count_plans(rank, world):
    """On ranks 0 and 1 (cp = 2): the cp = 2 model's logits from model.make_plan(16), a token count, against the
    single-process model's of one 16-token document (this rank's shard), or the error."""
    from cp_harness import GROUPS

    if rank >= 2:
        return None
    tokens = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(5))
    whole = _model()(tokens, torch.arange(16), SingleRankPlan([0, 16]))
    model = _model(cp_group=GROUPS[2], backend="reference")
    plan = model.make_plan(16)
    try:
        local = model(plan.shard(tokens, 0, rank), plan.positions(rank), plan)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return float((local - plan.shard(whole, 0, rank)).abs().max())


@pytest.mark.timeout(120)
def test_a_token_count_is_one_document_at_every_cp_size():
    """model.make_plan(n) (a token count, as make_plan takes one) was one n-token document at cp 1 and a
    single-sequence plan at cp > 1, whose (batch, seqlen, ...) layout the model's packed stream is not: the forward
    failed in the attention with 'q must be 4-D (batch, local_seqlen, heads, head_dim) for this single-sequence plan'.
    It is one document at every cp size."""
    from cp_harness import shared_pool

    model = _model()
    assert model.make_plan(16).cu_seqlens.tolist() == [0, 16]
    for err in shared_pool(4).run(_token_count_plans)[:2]:
        assert isinstance(err, float) and err < 1e-12, err


def test_tokens_of_another_count_than_the_plan_gives_are_named():
    """The attention's own check named q, an argument the model's caller never passed."""
    from fa4dist.data import SingleRankPlan

    model = FA4Llama(get_config("tiny"))
    with pytest.raises(ValueError, match="tokens holds 6 tokens but the plan gives this rank 8"):
        model(torch.zeros(6, dtype=torch.long), torch.arange(6), SingleRankPlan(torch.tensor([0, 8])))
