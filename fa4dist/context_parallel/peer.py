"""Copy-engine transfers between the processes of one host: the context-parallel transport that
``FA4DIST_CP_TRANSPORT=peer`` selects in place of the process group's own send/recv.

Why: between the GPUs of one host, torch's peer copies moved a ring step's keys 1.5-1.7x faster than NCCL's
send/recv and slowed a concurrent matmul half as much (bench/p2p.py, two H200s: NCCL's kernels take SMs from the
attention, a copy engine takes none).  It also replaces the host staging of several ranks sharing one GPU on gloo.

How a batch moves (:meth:`PeerLinks.post`), on two side streams per group (one sends, one receives, so that a
rank's sends never wait behind its own receives), each ordered after the caller's stream at the post:
- Each ordered pair of ranks (sender, receiver) has an *outbox* of two slots of ``CHUNK_BYTES`` (32 MiB) in the
  sender's memory, shared with the receiver through CUDA IPC when the pair first talks.
- A batch's messages (in (tag, posting) order, as the group's send/recv pair them) are laid back to back and cut
  into chunks of a slot's size (:func:`chunk_pieces`).  The j-th chunk between the pair uses slot j % 2.
- The sender waits until the receiver has read the slot's chunk j - 2, copies the chunk into the slot (a local
  device copy) and writes j into the receiver's READY word for (sender, slot).
- The receiver waits for that word to reach j, copies the chunk out of the sender's slot straight into its receive
  tensors (the copy engine, over NVLink between GPUs) and writes j into the sender's FREE word.  So a large batch
  streams through the two slots, the sender's copy of chunk j + 1 under the receiver's copy of chunk j, and the
  memory is two slots per pair of ranks that talk, whatever the batch size.  They live as long as the process:
  freeing memory a peer has mapped is undefined until every peer has closed its mapping, which would need a
  collective teardown (a later world's links are new ones).
- The words are written and waited for with the driver's stream memory operations (``cuStreamWriteValue32`` /
  ``cuStreamWaitValue32``): the stream's front end waits, no kernel and no SM.

Both sides derive the chunks, their numbers and slots from the message sizes alone, with no message of their own.

A wait that is never satisfied (a peer that died or made another call) cannot be cancelled on the GPU: a watchdog
thread then prints what was waited for, naming the peer and the batch, and aborts the process, as NCCL's watchdog
does on its timeout.  Several processes on one GPU work too (the GPU tests' staged ranks).  Not for CUDA graphs:
the chunk numbers are baked into each operation, so a replay would wait for numbers that have passed.
"""

from __future__ import annotations

import collections
import ctypes
import os
import socket
import sys
import threading
import time
from typing import Optional, Sequence

import torch

TRANSPORT_ENV = "FA4DIST_CP_TRANSPORT"
TRANSPORTS = ("group", "peer")

CHUNK_BYTES = 32 << 20  # a slot's size: two per pair of ranks that talk (read when a group's links are made)
_READY, _FREE = 0, 1  # the two kinds of words in a rank's flag array: [kind][peer][slot] int32


def requested_transport() -> str:
    """The transport this process asks for: ``FA4DIST_CP_TRANSPORT`` ("group": the process group's own send/recv,
    the default; "peer": copy-engine copies between the processes of one host, CUDA only).  Part of a call's
    agreed signature: ranks that read different values fail the agreement check together."""
    text = os.environ.get(TRANSPORT_ENV)
    if text is None or not text.strip():
        return "group"
    value = text.strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV} must be one of {', '.join(TRANSPORTS)} (the process group's own send/"
                         f"recv, or copy-engine copies between the processes of one host), got {text!r}")
    return value


def chunk_pieces(nbytes: Sequence[int], chunk: int) -> list[list[tuple[int, int, int, int]]]:
    """A batch's messages of ``nbytes`` bytes laid back to back and cut into chunks of ``chunk`` bytes: per chunk,
    its pieces (message index, byte offset in the message, bytes, byte offset in the slot).  Empty messages take no
    piece; an empty batch has no chunk."""
    chunks: list = []
    at = 0  # the batch's byte position
    for i, n in enumerate(nbytes):
        done = 0
        while done < n:
            index, into = divmod(at, chunk)
            if index == len(chunks):
                chunks.append([])
            take = min(n - done, chunk - into)
            chunks[index].append((i, done, take, into))
            done += take
            at += take
    return chunks


class Handshakes:
    """A rank's side of the protocol as stream operations, with no device: per pair, the chunk numbers so far (the
    same on both sides, from the message sizes alone).  Operations, in stream order:

    - ``("wait", rank, offset, value)``: wait until the int32 word at ``offset`` of ``rank``'s flag array (always
      this rank's own) is at least ``value``;
    - ``("copy", dst, src, nbytes)``, where a place is ``("outbox", sender, receiver, byte)`` (a byte of the
      sender's outbox for the receiver) or ``("message", index, byte)`` (a byte of the batch's index-th message
      between the pair, in (tag, posting) order);
    - ``("write", rank, offset, value)``: write ``value`` into the word at ``offset`` of ``rank``'s flag array.

    :class:`PeerLinks` issues them with the driver; the CPU tests run them on a simulated machine."""

    def __init__(self, rank: int, size: int, chunk: int):
        self.rank, self.size, self.chunk = rank, size, chunk
        self.sent = collections.Counter()  # receiver -> chunks sent to it so far
        self.received = collections.Counter()  # sender -> chunks received from it so far

    def send(self, receiver: int, nbytes: Sequence[int]) -> list:
        """The operations that send a batch of messages of ``nbytes`` bytes to ``receiver``."""
        ops, chunk, me = [], self.chunk, self.rank
        for piece in chunk_pieces(nbytes, chunk):
            self.sent[receiver] += 1
            j = self.sent[receiver]
            slot = j % 2
            if j > 2:  # the receiver has read this slot's previous chunk
                ops.append(("wait", me, _flag_offset(_FREE, receiver, slot, self.size), j - 2))
            ops += [("copy", ("outbox", me, receiver, slot * chunk + into), ("message", i, at), n)
                    for i, at, n, into in piece]
            ops.append(("write", receiver, _flag_offset(_READY, me, slot, self.size), j))
        return ops

    def receive(self, sender: int, nbytes: Sequence[int]) -> list:
        """The operations that receive a batch of messages of ``nbytes`` bytes from ``sender``."""
        ops, chunk, me = [], self.chunk, self.rank
        for piece in chunk_pieces(nbytes, chunk):
            self.received[sender] += 1
            j = self.received[sender]
            slot = j % 2
            ops.append(("wait", me, _flag_offset(_READY, sender, slot, self.size), j))
            ops += [("copy", ("message", i, at), ("outbox", sender, me, slot * chunk + into), n)
                    for i, at, n, into in piece]
            ops.append(("write", sender, _flag_offset(_FREE, me, slot, self.size), j))
        return ops


def _flag_offset(kind: int, peer: int, slot: int, size: int) -> int:
    return ((kind * size + peer) * 2 + slot) * 4


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise RuntimeError(f"{TRANSPORT_ENV}=peer needs the CUDA driver's Python bindings (pip install "
                           f"cuda-bindings, or fa4dist's [cute] extra): {err}") from err
    return driver


def _call(cu, result, what: str):
    """The values a cuda.bindings call returned after its status, or a RuntimeError naming the call and the error."""
    status, rest = result[0], result[1:]
    if status != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(status)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


def _host_id() -> str:
    """This machine, as the processes of one host agree on it (the boot id, else the host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class _Watchdog:
    """One daemon thread per process that checks the posted batches' completion events; one still pending after
    its deadline is a peer that will never answer: the message is printed and the process aborted (a stream
    waiting on a word cannot be released from the host)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None

    def watch(self, events, deadline: float, message: str) -> None:
        with self._lock:
            self._pending.append((events, deadline, message))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fa4dist peer watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            with self._lock:
                entries = list(self._pending)
            now, done = time.monotonic(), set()
            for i, (events, deadline, message) in enumerate(entries):
                if all(event.query() for event in events):
                    done.add(i)
                elif now > deadline:
                    sys.stderr.write(f"\n[fa4dist] {message}; aborting this process (a stream waiting for a peer "
                                     "cannot be released)\n")
                    sys.stderr.flush()
                    os.abort()
            with self._lock:
                kept = [e for i, e in enumerate(entries) if i not in done]
                self._pending = collections.deque(kept + list(self._pending)[len(entries):])


_WATCHDOG = _Watchdog()
_LINKS: dict = {}  # group key (comm.group_key) -> PeerLinks


def existing_links(transport) -> "Optional[PeerLinks]":
    """The peer links of `transport`'s group if this process set them up already, else None."""
    return _LINKS.get(transport.key)


def links_for(transport) -> "PeerLinks":
    """The peer links of `transport`'s group, set up on first use (collectively: every rank of the group calls this
    in the same call, after the agreement check)."""
    links = _LINKS.get(transport.key)
    if links is None:
        for old in [k for k in _LINKS if k[0] != transport.key[0]]:  # an earlier world's groups
            del _LINKS[old]
        links = _LINKS[transport.key] = PeerLinks(transport)
    return links


class PeerPending:
    """A batch in flight on the peer links; :meth:`wait` orders the caller's stream after it (no host wait)."""

    def __init__(self, events, keep, unstage):
        self._events, self._keep, self._unstage = events, keep, unstage
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for event in self._events:
            torch.cuda.current_stream().wait_event(event)
        for dst, tmp in self._unstage:
            dst.copy_(tmp)
        self._keep = self._unstage = None
        self.done = True


class PeerLinks:
    """One process group's copy-engine links: the flag words, the outboxes and the side stream (module docstring)."""

    def __init__(self, transport):
        from .comm import _store_channel

        t = self._t = transport
        store, prefix = _store_channel(t.group)
        self._store, self._prefix = store, prefix.replace("fa4dist/agree/", "fa4dist/peer/")
        size = t.size
        key = f"{self._prefix}flags/{t.rank}"
        try:  # this rank's half; a failure is posted in its place, so that no rank waits for it
            mine = self._prepare(size)
        except Exception as err:
            store.set(key, f"error|{type(err).__name__}: {err}")
            raise
        store.set(key, mine)
        keys = [f"{self._prefix}flags/{r}" for r in range(size)]
        try:
            store.wait(keys, t.timeout_delta)
        except Exception as err:  # noqa: BLE001 - the store's own timeout types, by version
            raise RuntimeError(f"rank {t.rank} of {size} waited {t.timeout:g}s for every rank's peer-copy flags "
                               f"({TRANSPORT_ENV}=peer: did every rank set it?): {err}") from err
        texts = [bytes(v).decode() for v in store.multi_get(keys)]
        for r, text in enumerate(texts):
            if text.startswith("error|"):
                raise RuntimeError(f"rank {r} of the group could not prepare peer copies: {text[6:]}")
        rows = [text.split("|", 3) for text in texts]
        if len({row[2] for row in rows}) > 1:
            raise RuntimeError(f"the ranks of the group use different chunk sizes: {[int(r[2]) for r in rows]}")
        hosts = sorted({row[1] for row in rows})
        if len(hosts) > 1:
            raise RuntimeError(f"{TRANSPORT_ENV}=peer copies between the processes of one host, but the ranks of "
                               f"this group are on {len(hosts)} hosts; use the process group's transport "
                               f"({TRANSPORT_ENV}=group) across hosts")
        self._peer_flags = {r: self._flags if r == t.rank else self._open(bytes.fromhex(row[3]))
                            for r, row in enumerate(rows)}
        self._send_stream, self._recv_stream = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self._handshakes = Handshakes(t.rank, size, self.chunk)
        self._outbox: dict = {}  # receiver -> device pointer (two slots of self.chunk bytes)
        self._inbox: dict = {}  # sender -> its outbox for this rank, mapped here

    def _prepare(self, size: int) -> str:
        """Sets up this rank's side (driver, context, flag words); returns its row for the others: "ok", the host,
        the chunk size and the flag words' IPC handle."""
        if not torch.cuda.is_available():
            raise RuntimeError(f"{TRANSPORT_ENV}=peer needs CUDA")
        cu = self._cu = _driver()
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.init()
        _call(cu, cu.cuInit(0), "cuInit")
        dev = _call(cu, cu.cuDeviceGet(self.device.index), "cuDeviceGet")
        self._ctx = _call(cu, cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._use_context()
        nbytes = _flag_offset(2, 0, 0, size) + 4  # (the last word: this rank's own check of the stream memops)
        self._flags = _call(cu, cu.cuMemAlloc(nbytes), "cuMemAlloc (flag words)")
        _call(cu, cu.cuMemsetD32(self._flags, 0, nbytes // 4), "cuMemsetD32")
        torch.cuda.synchronize(self.device)  # (zero before any peer can write a word)
        check = torch.cuda.Stream(self.device)
        try:  # the driver's stream memory operations work here (they fail with an error where they do not)
            self._write_word(cu.CUstream(check.cuda_stream), self._flags, nbytes - 4, 1)
            self._wait_word(cu.CUstream(check.cuda_stream), self._flags, nbytes - 4, 1)
            check.synchronize()
        except RuntimeError as err:
            raise RuntimeError(f"{TRANSPORT_ENV}=peer needs the driver's stream memory operations on "
                               f"{torch.cuda.get_device_name(self.device)}: {err}") from err
        self.chunk = int(CHUNK_BYTES)
        return f"ok|{_host_id()}|{self.chunk}|{self._export(self._flags).hex()}"

    # ---- driver helpers ---------------------------------------------------------------------------------------

    def _use_context(self) -> None:
        _call(self._cu, self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def _export(self, ptr) -> bytes:
        handle = _call(self._cu, self._cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
        return ctypes.string_at(handle.getPtr(), 64)

    def _open(self, raw: bytes):
        cu = self._cu
        handle = cu.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), raw, 64)
        return _call(cu, cu.cuIpcOpenMemHandle(handle, int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)),
                     "cuIpcOpenMemHandle (a peer's buffer)")

    def _wait_word(self, stream, ptr, offset: int, value: int) -> None:
        cu = self._cu
        at_least = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)  # (cyclic: (int32)(word - value) >= 0)
        _call(cu, cu.cuStreamWaitValue32(stream, cu.CUdeviceptr(int(ptr) + offset), cu.cuuint32_t(value), at_least),
              "cuStreamWaitValue32")

    def _write_word(self, stream, ptr, offset: int, value: int) -> None:
        cu = self._cu
        _call(cu, cu.cuStreamWriteValue32(stream, cu.CUdeviceptr(int(ptr) + offset), cu.cuuint32_t(value),
                                          int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)),
              "cuStreamWriteValue32")

    def _copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            cu = self._cu
            _call(cu, cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, stream), "cuMemcpyAsync")

    def _outbox_key(self, sender: int, receiver: int) -> str:
        return f"{self._prefix}outbox/{sender}-{receiver}"

    def _outbox_for(self, receiver: int):
        """This rank's outbox for `receiver`, made (and published) on the pair's first batch."""
        if receiver not in self._outbox:
            ptr = _call(self._cu, self._cu.cuMemAlloc(2 * self.chunk), "cuMemAlloc (an outbox)")
            self._outbox[receiver] = ptr
            self._store.set(self._outbox_key(self._t.rank, receiver), self._export(ptr).hex())
        return self._outbox[receiver]

    def _inbox_for(self, sender: int):
        """`sender`'s outbox for this rank, mapped here on the pair's first batch (its handle from the store)."""
        if sender not in self._inbox:
            t = self._t
            key = self._outbox_key(sender, t.rank)
            try:
                self._store.wait([key], t.timeout_delta)
            except Exception as err:  # noqa: BLE001
                raise RuntimeError(f"waited {t.timeout:g}s for rank {sender}'s outbox (did it make this call?): "
                                   f"{err}") from err
            self._inbox[sender] = self._open(bytes.fromhex(bytes(self._store.get(key)).decode()))
        return self._inbox[sender]

    def _issue(self, stream, ops, msgs) -> None:
        """Issues :class:`Handshakes` operations on ``stream``; ``msgs``: the batch's tensors with one peer."""
        def address(place) -> int:
            if place[0] == "message":
                return msgs[place[1]].data_ptr() + place[2]
            _, sender, receiver, at = place
            box = self._outbox_for(receiver) if sender == self._t.rank else self._inbox_for(sender)
            return int(box) + at

        for op in ops:
            if op[0] == "wait":
                self._wait_word(stream, self._peer_flags[op[1]], op[2], op[3])
            elif op[0] == "write":
                self._write_word(stream, self._peer_flags[op[1]], op[2], op[3])
            else:
                self._copy(stream, address(op[1]), address(op[2]), op[3])

    # ---- a batch ----------------------------------------------------------------------------------------------

    def post(self, sends, recvs, what: str, peers: str) -> PeerPending:
        """Posts (tensor, group peer, tag) sends and receives to other ranks (module docstring).  Sends are read on
        the links' send stream and receives written on their receive stream, both ordered after the caller's stream
        at this call."""
        t = self._t
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{t.label}: {TRANSPORT_ENV}=peer cannot be captured in a CUDA graph (its chunk "
                               f"numbers would be replayed); use {TRANSPORT_ENV}=group there")
        for tensor, _, _ in list(sends) + list(recvs):
            if tensor.device != self.device:
                raise ValueError(f"{t.label}: {what}: a tensor on {tensor.device}, but this group's peer links are "
                                 f"on {self.device} (the current device when they were set up)")
        self._use_context()
        caller = torch.cuda.current_stream(self.device)
        keep, unstage = [], []
        sends = [(x if x.is_contiguous() else x.contiguous(), p, tag) for x, p, tag in sends]  # (caller's stream)
        staged = []
        for x, p, tag in recvs:
            if x.is_contiguous():
                staged.append((x, p, tag))
            else:
                tmp = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                unstage.append((x, tmp))
                staged.append((tmp, p, tag))
        send, recv = self._send_stream, self._recv_stream
        send.wait_stream(caller)
        recv.wait_stream(caller)
        on_send, on_recv = self._cu.CUstream(send.cuda_stream), self._cu.CUstream(recv.cuda_stream)
        for p, msgs in _by_peer(sends):
            self._issue(on_send, self._handshakes.send(p, [x.numel() * x.element_size() for x in msgs]), msgs)
            for x in msgs:
                x.record_stream(send)
            keep += msgs
        for q, msgs in _by_peer(staged):
            self._issue(on_recv, self._handshakes.receive(q, [x.numel() * x.element_size() for x in msgs]), msgs)
            for x in msgs:
                x.record_stream(recv)
            keep += msgs
        events = [torch.cuda.Event(), torch.cuda.Event()]
        events[0].record(send)
        events[1].record(recv)
        _WATCHDOG.watch(events, time.monotonic() + t.timeout,
                        f"{t.label}: rank {t.rank} of {t.size} waited more than {t.timeout:g}s for {what} "
                        f"({peers}) over the peer copies ({TRANSPORT_ENV}=peer): a peer never posted its side (it "
                        "stopped, or made another call)")
        return PeerPending(events, keep, unstage)


def _by_peer(messages):
    """[(peer, [tensor, ...]), ...] by peer, each peer's messages in (tag, posting) order: the order both sides of
    a pair agree on."""
    grouped = collections.defaultdict(list)
    for x, p, tag in messages:
        grouped[p].append((tag, len(grouped[p]), x))
    return [(p, [x for _, _, x in sorted(grouped[p], key=lambda e: (e[0], e[1]))]) for p in sorted(grouped)]
