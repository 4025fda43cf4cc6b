"""The copy-engine transport (``FA4DIST_CP_TRANSPORT=peer``) on CUDA: several ranks sharing one GPU over gloo, as the
other staged-rank tests run (between GPUs the same copies cross NVLink).  The transport moves bytes only, so the
context-parallel results must be the fp64 oracle's and the bytes of the group's own transport; its batches must
arrive whole through many chunks, empty and strided messages; and a peer that never answers must end the waiting
process with a message, not hang it."""

import os
import subprocess
import sys

import pytest
import torch

from cp_cases import random_docs, run_case
from cp_harness import GROUPS, shared_pool
from test_cp_gpu import FP64_CASES

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


@pytest.mark.parametrize("strategy, kw", FP64_CASES)
def test_peer_copies_fp64_exact(pool, strategy, kw):
    for r in pool.run(run_case, strategy=strategy, device="cuda:0", transport="peer", **kw):
        if r is not None:
            assert max(r[n] for n in ("out", "dq", "dk", "dv")) < 1e-10, r


@pytest.mark.parametrize("strategy, kw", [
    ("ring", dict(seqlen=3001, heads=(4, 2), head_dim=128, batch=2)),
    ("ring", dict(seqlen=4096, heads=(8, 2), head_dim=64, ring_steps_per_launch=0)),
    ("ulysses", dict(seqlen=4096, heads=(8, 8), head_dim=128)),
    ("hybrid", dict(docs=random_docs(3, 10, 800, allow_empty=False), heads=(8, 2), head_dim=64, ulysses_degree=2,
                    plan_u=2)),
])
def test_peer_copies_give_the_bytes_of_the_group_transport(pool, strategy, kw):
    """bf16 with the fused kernels, deterministic: the same bytes on every rank as the gloo transport's."""
    runs = {transport: pool.run(run_case, cp=4, strategy=strategy, device="cuda:0", dtype=torch.bfloat16,
                                backend="auto", deterministic=True, transport=transport, **kw)
            for transport in ("group", "peer")}
    for rank, (a, b) in enumerate(zip(runs["group"], runs["peer"])):
        assert a["digest"] == b["digest"], (rank, a, b)
        assert max(a[n] for n in ("out", "dq", "dk", "dv")) < 0.1, a  # (a sanity bound: bf16 against fp64)


def batches_case(rank, world, rounds=14, seed=0):
    """Random batches over a fresh group of the 4 ranks on a Transport in peer mode, with 1 MiB slots: each round
    every rank sends 0-3 messages of random sizes (empty ones, and many chunks long) with random tags to random
    peers, receiving some into strided views; every byte is checked.  Returns the rounds and the largest message."""
    import random

    from cp_harness import fresh_group
    from fa4dist.context_parallel import peer
    from fa4dist.context_parallel.comm import Transport

    torch.cuda.set_device(0)
    t = Transport(fresh_group(range(world)), timeout=60.0, label="peer test")
    default, peer.CHUNK_BYTES = peer.CHUNK_BYTES, 1 << 20
    try:
        t.use_peer_copies(True)
    finally:
        peer.CHUNK_BYTES = default
    biggest = 0
    for r in range(rounds):
        rng = random.Random(seed * 1000 + r)  # the same plan on every rank
        plan = []  # (src, dst, tag, elements)
        for src in range(world):
            for _ in range(rng.randrange(4)):
                dst = rng.choice([d for d in range(world) if d != src])  # (messages to oneself: local copies)
                n = rng.choice([0, 7, 1000, 70_000, 300_000 * (r + 1)])
                plan.append((src, dst, rng.choice([30, 31, 7]), n))

        def payload(src, dst, tag, n, i):
            base = float(src * 1000 + dst * 100 + tag + r * 7 + i * 3)
            return torch.arange(n, device="cuda", dtype=torch.float32) % 251 + base

        sends, recvs, want = [], [], []
        for i, (src, dst, tag, n) in enumerate(plan):
            if src == rank:
                sends.append((payload(src, dst, tag, n, i), dst, tag))
            if dst == rank:
                strided = n > 0 and rng.random() < 0.5
                buf = torch.full((2 * n,) if strided else (n,), float("nan"), device="cuda")
                view = buf[::2] if strided else buf
                recvs.append((view, src, tag))
                want.append((view, payload(src, dst, tag, n, i)))
            if src == rank or dst == rank:
                biggest = max(biggest, 4 * n)
        # messages between two ranks with one tag pair in posting order: post them as the plan lists them
        t.post_tagged(sends, recvs, f"round {r}").wait()
        for got, expected in want:
            assert torch.equal(got, expected), f"round {r}: wrong bytes"
    torch.cuda.synchronize()
    return rounds, biggest


def test_peer_batches_arrive_whole(pool):
    for rounds, biggest in pool.run(batches_case, timeout=200):
        assert rounds == 14 and biggest > 8 << 20  # messages of many 1 MiB chunks


def test_a_peer_that_never_answers_ends_the_waiting_process_with_a_message(tmp_path):
    """Rank 1 sets up the links and leaves; rank 0 waits for its keys: the watchdog aborts rank 0 after the
    transport's timeout, naming the wait (not a hang)."""
    script = os.path.join(os.path.dirname(__file__), "peer_silent_case.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script],
                          capture_output=True, text=True, timeout=240, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "waited more than 5s for K/V of a test step (recv from rank 1) over the peer copies" in text, text
    assert "aborting this process" in text, text


def capture_case(rank, world):
    """A call under CUDA graph capture with peer copies: refused on every rank before anything is posted, and the
    group stays usable (the next call outside the capture gives the first call's bytes)."""
    from cp_cases import environment, global_inputs
    from fa4dist.context_parallel import make_plan
    from fa4dist.context_parallel.peer import TRANSPORT_ENV
    from fa4dist.modules import FA4ContextParallelAttention

    torch.cuda.set_device(0)
    with environment({TRANSPORT_ENV: "peer"}):
        module = FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
        plan = make_plan(256, 4)
        q, k, v, _ = global_inputs(0, 256, 4, 2, 16, torch.float32, batch=1)
        local = [plan.shard(t, rank=rank).cuda() for t in (q, k, v)]
        first = module(*local, plan=plan)
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        error = None
        try:
            with torch.cuda.graph(graph, stream=side):
                module(*local, plan=plan)
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"
        again = module(*local, plan=plan)
        return error, torch.equal(first, again)


def test_a_cuda_graph_capture_with_peer_copies_is_refused_alike(pool):
    for error, same in pool.run(capture_case, timeout=120):
        assert error is not None and error.startswith("ValueError") and \
            "FA4DIST_CP_TRANSPORT=peer cannot be captured in a CUDA graph" in error, error
        assert same
