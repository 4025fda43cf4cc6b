"""The copy-engine transport's host-side rules (``fa4dist/context_parallel/peer.py``): the knob, the cutting of a
batch into slot-sized chunks (which both sides of a pair derive from the message sizes alone), and the order in
which the two sides take a pair's messages.  Its transfers need CUDA: tests/cp/test_peer_gpu.py."""

import random

import pytest
import torch

from fa4dist.context_parallel import peer


@pytest.mark.parametrize("value, want", [(None, "group"), ("", "group"), ("group", "group"), (" Peer ", "peer")])
def test_requested_transport(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(peer.TRANSPORT_ENV, raising=False)
    else:
        monkeypatch.setenv(peer.TRANSPORT_ENV, value)
    assert peer.requested_transport() == want


@pytest.mark.parametrize("value", ["nccl", "nvlink", "1"])
def test_an_unknown_transport_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(peer.TRANSPORT_ENV, value)
    with pytest.raises(ValueError, match=f"FA4DIST_CP_TRANSPORT must be one of group, peer .*got '{value}'"):
        peer.requested_transport()


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_every_byte_once_within_a_slot(seed):
    """The chunks of a batch: back to back, every message byte in exactly one piece, in order; each chunk's pieces
    tile its slot from 0 without gaps and never past the chunk size; an empty batch has no chunk."""
    rng = random.Random(seed)
    chunk = rng.choice([256, 1000, 4096])
    sizes = [rng.choice([0, 1, 255, 256, 4095, 4096, 10_000]) for _ in range(rng.randrange(6))]
    chunks = peer.chunk_pieces(sizes, chunk)
    assert len(chunks) == -(-sum(sizes) // chunk)
    seen = {i: 0 for i in range(len(sizes))}
    for c, pieces in enumerate(chunks):
        into = 0
        for i, at, n, slot_at in pieces:
            assert n > 0 and slot_at == into and at == seen[i]
            seen[i] += n
            into += n
        assert into <= chunk and (into == chunk or c == len(chunks) - 1)
    assert [seen[i] for i in range(len(sizes))] == sizes
    assert peer.chunk_pieces([0, 0], chunk) == []


def test_a_pairs_messages_go_in_tag_then_posting_order():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    grouped = peer._by_peer([(a, 2, 31), (b, 1, 30), (c, 2, 30), (d, 2, 31)])
    assert [p for p, _ in grouped] == [1, 2]
    assert [float(x) for x in grouped[1][1]] == [2.0, 0.0, 3.0]  # tag 30 first, then tag 31 in posting order
    assert [float(x) for x in grouped[0][1]] == [1.0]
