"""The copy-engine transport's host-side rules (``fa4dist/context_parallel/peer.py``): the knob, the placement of a
batch's messages in a slot, what both sides of a pair derive from the batch sizes, and the order in which the two
sides take a pair's messages.  Its transfers need CUDA: tests/cp/test_peer_gpu.py."""

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


def test_messages_sit_back_to_back_at_256_byte_multiples():
    offsets, total = peer.layout([0, 1, 256, 257, 1000])
    assert offsets == [0, 0, 256, 512, 1024]
    assert total == 2048
    assert peer.layout([]) == ([], 0)


def test_a_pair_ledger_numbers_slots_and_grows_only_when_a_batch_does_not_fit():
    rng = random.Random(0)
    ledger, capacity, generation = peer.PairLedger(), 0, 0
    for k in range(1, 200):
        total = rng.choice([0, 1, 5000, 1 << 20, (1 << 20) + 1, rng.randrange(1 << 24)])
        batch, slot, grew = ledger.next(total)
        assert (batch, slot) == (k, k % 2)
        assert grew == (total > capacity)
        if grew:
            generation += 1
            assert ledger.capacity >= max(total, 1 << 20) and ledger.capacity & (ledger.capacity - 1) == 0
            assert ledger.capacity < 2 * max(total, 1 << 20)  # the next power of two, no more
            capacity = ledger.capacity
        assert (ledger.capacity, ledger.generation) == (capacity, generation)
        assert total <= ledger.capacity


def test_a_pairs_messages_go_in_tag_then_posting_order():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    grouped = peer._by_peer([(a, 2, 31), (b, 1, 30), (c, 2, 30), (d, 2, 31)])
    assert [p for p, _ in grouped] == [1, 2]
    assert [float(x) for x in grouped[1][1]] == [2.0, 0.0, 3.0]  # tag 30 first, then tag 31 in posting order
    assert [float(x) for x in grouped[0][1]] == [1.0]
