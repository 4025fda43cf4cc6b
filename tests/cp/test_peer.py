"""The copy-engine transport's host-side rules (``fa4dist/context_parallel/peer.py``): the knob, the cutting of a
batch into slot-sized chunks (which both sides of a pair derive from the message sizes alone), and the order in
which the two sides take a pair's messages.  Its transfers need CUDA: tests/cp/test_peer_gpu.py."""

import collections
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


class Machine:
    """Ranks running :class:`peer.Handshakes` operations on simulated streams: flag words, outboxes and message
    buffers as Python objects; any stream whose next operation can run may run it (a seeded random choice), as
    the GPUs' streams progress independently.  ``streams=1`` puts a rank's sends and receives on one stream."""

    def __init__(self, size: int, chunk: int, streams: int, seed: int):
        self.size, self.chunk, self.streams = size, chunk, streams
        self.rng = random.Random(seed)
        self.hand = [peer.Handshakes(r, size, chunk) for r in range(size)]
        self.flags = [collections.defaultdict(int) for _ in range(size)]
        self.boxes = collections.defaultdict(lambda: bytearray(2 * chunk))  # (sender, receiver) -> outbox
        self.queues = [[collections.deque() for _ in range(streams)] for _ in range(size)]
        self.done_posts = [[0] * streams for _ in range(size)]  # per stream: posts whose operations all ran

    def post(self, index: int, batch, payload) -> dict:
        """Every rank posts ``batch`` ((sender, receiver, tag, nbytes), ...): enqueues its operations, each stream
        first waiting for the rank's posts before this one (the caller's stream waited for them, as a ring step
        waits for its keys before it posts the next).  Returns the receive buffers by (receiver, message index)."""
        received = {}
        for r in range(self.size):
            sends = collections.defaultdict(list)
            recvs = collections.defaultdict(list)
            for i, (src, dst, tag, n) in enumerate(batch):
                if src == r:
                    sends[dst].append((tag, i, payload[i]))
                if dst == r:
                    buf = bytearray(n)
                    received[(r, i)] = buf
                    recvs[src].append((tag, i, buf))
            for s in range(self.streams):
                self.queues[r][s].append(("join", index))
            for p in sorted(sends):
                msgs = [m for _, _, m in sorted(sends[p])]
                for op in self.hand[r].send(p, [len(m) for m in msgs]):
                    self.queues[r][0].append(("op", op, msgs, p))
            for q in sorted(recvs):
                msgs = [m for _, _, m in sorted(recvs[q])]
                for op in self.hand[r].receive(q, [len(m) for m in msgs]):
                    self.queues[r][self.streams - 1].append(("op", op, msgs, q))
            for s in range(self.streams):
                self.queues[r][s].append(("end", index))
        return received

    def _place(self, place, msgs):
        if place[0] == "message":
            return msgs[place[1]], place[2]
        _, sender, receiver, at = place
        return self.boxes[(sender, receiver)], at

    def _ready(self, r, item) -> bool:
        if item[0] == "join":  # every stream of the rank finished the earlier posts
            return all(done >= item[1] for done in self.done_posts[r])
        if item[0] == "op" and item[1][0] == "wait":
            _, owner, offset, value = item[1]
            return self.flags[owner][offset] >= value
        return True

    def run(self) -> bool:
        """Runs until every queue is empty (True) or no stream can move (False: a deadlock)."""
        while True:
            movable = [(r, s) for r in range(self.size) for s in range(self.streams)
                       if self.queues[r][s] and self._ready(r, self.queues[r][s][0])]
            if not movable:
                return not any(q for qs in self.queues for q in qs)
            r, s = self.rng.choice(movable)
            item = self.queues[r][s].popleft()
            if item[0] == "end":
                self.done_posts[r][s] = item[1] + 1
            elif item[0] == "op":
                op, msgs = item[1], item[2]
                if op[0] == "write":
                    self.flags[op[1]][op[2]] = op[3]
                elif op[0] == "copy":
                    (dst, d), (src, a), n = self._place(op[1], msgs), self._place(op[2], msgs), op[3]
                    dst[d:d + n] = src[a:a + n]


def _random_posts(rng, size, posts, chunk):
    out = []
    for _ in range(posts):
        batch = []
        for src in range(size):
            for _ in range(rng.randrange(4)):
                dst = rng.choice([d for d in range(size) if d != src])
                batch.append((src, dst, rng.choice([30, 31]), rng.choice([0, 1, chunk - 1, chunk, 3 * chunk + 5])))
        out.append(batch)
    return out


@pytest.mark.parametrize("seed", range(25))
def test_the_protocol_delivers_every_byte_and_never_deadlocks(seed):
    """Random batches (empty, one-byte and many-chunk messages, several per pair, all-to-all) between 2-5 ranks
    through two slots per pair: every stream drains and every receiver holds its sender's bytes, whatever order
    the streams progress in (a slot overwritten before it was read would leave the later chunk's bytes)."""
    rng = random.Random(seed)
    size, chunk = rng.randint(2, 5), rng.choice([8, 64])
    machine = Machine(size, chunk, streams=2, seed=seed)
    for index, batch in enumerate(_random_posts(rng, size, 8, chunk)):
        payload = [bytes(rng.randrange(256) for _ in range(n)) for *_, n in batch]
        received = machine.post(index, batch, payload)
        assert machine.run(), f"deadlock at post {index}"
        for (r, i), buf in received.items():
            assert bytes(buf) == payload[i], (index, r, i)


def test_sends_and_receives_on_one_stream_deadlock():
    """Why a rank sends and receives on two streams: two ranks exchanging batches of more than two chunks each way
    on one stream each both wait, in their send half, for a read that the other's receive half would make only
    after its own sends."""
    machine = Machine(2, 8, streams=1, seed=0)
    payload = [bytes(range(40)), bytes(range(40, 80))]
    machine.post(0, [(0, 1, 30, 40), (1, 0, 30, 40)], payload)
    assert not machine.run()
    machine = Machine(2, 8, streams=2, seed=0)
    received = machine.post(0, [(0, 1, 30, 40), (1, 0, 30, 40)], payload)
    assert machine.run() and bytes(received[(1, 0)]) == payload[0] and bytes(received[(0, 1)]) == payload[1]
