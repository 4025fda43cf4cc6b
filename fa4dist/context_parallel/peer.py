"""Copy-engine transfers between the processes of one host: the context-parallel transport that
``FA4DIST_CP_TRANSPORT=peer`` selects in place of the process group's own send/recv.

Why: between the GPUs of one host, torch's peer copies moved a ring step's keys 1.5-1.7x faster than NCCL's
send/recv and slowed a concurrent matmul half as much (bench/p2p.py, two H200s: NCCL's kernels take SMs from the
attention, a copy engine takes none).  It also replaces the host staging of several ranks sharing one GPU on gloo.

How a batch moves (:meth:`PeerLinks.post`), all of it on one side stream per group, ordered after the caller's
stream at the post:
- Each ordered pair of ranks (sender, receiver) has a two-slot *outbox* in the sender's memory, shared with the
  receiver through CUDA IPC.  The k-th batch between them uses slot k % 2.
- The sender waits until the receiver has read the slot's batch k - 2, copies its messages into the slot (a local
  device copy) and writes k into the receiver's READY word for (sender, slot).
- The receiver waits for that word to reach k, copies the messages out of the sender's slot straight into its
  receive tensors (the copy engine, over NVLink between GPUs) and writes k into the sender's FREE word.
- The words are written and waited for with the driver's stream memory operations (``cuStreamWriteValue32`` /
  ``cuStreamWaitValue32``): the stream's front end waits, no kernel and no SM.

Both sides derive everything about a pair's batches from the message sizes alone (:class:`PairLedger`): the batch
number, the slot and the slot's capacity, which grows to the next power of two of a larger batch (the sender then
allocates a new outbox and publishes its IPC handle in the group's store; the receiver reads it there).  Messages
between two ranks pair by (tag, posting order), as the group's send/recv pair them.  Old outboxes are kept until
the process ends (growth is geometric: at most twice the last one).

A wait that is never satisfied (a peer that died or made another call) cannot be cancelled on the GPU: a watchdog
thread then prints what was waited for, naming the peer and the batch, and aborts the process, as NCCL's watchdog
does on its timeout.  Several processes on one GPU work too (the GPU tests' staged ranks).  Not for CUDA graphs:
the batch numbers are baked into each operation, so a replay would wait for numbers that have passed.
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

_ALIGN = 256  # bytes between a batch's messages in a slot (the copy engine's fast alignment)
_MIN_SLOT = 1 << 20  # the smallest slot capacity: small batches share one size class
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


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each message, total bytes) of a batch's messages placed back to back in a slot, each at a multiple
    of 256 bytes."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at += -(-int(n) // _ALIGN) * _ALIGN
    return offsets, at


class PairLedger:
    """What a sender and its receiver both derive from the sizes of the batches between them, alike on both sides
    without a message: the batch number (from 1), its slot, and the slot capacity with its generation (which grows
    to the next power of two, at least 1 MiB, when a batch does not fit)."""

    def __init__(self):
        self.batches = 0
        self.capacity = 0
        self.generation = 0

    def next(self, total: int) -> tuple[int, int, bool]:
        """(batch number, slot, whether the capacity grew) of the next batch, of `total` bytes."""
        self.batches += 1
        grew = total > self.capacity
        if grew:
            self.capacity = max(_MIN_SLOT, 1 << (int(total) - 1).bit_length())
            self.generation += 1
        return self.batches, self.batches % 2, grew


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

    def watch(self, event, deadline: float, message: str) -> None:
        with self._lock:
            self._pending.append((event, deadline, message))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fa4dist peer watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            with self._lock:
                entries = list(self._pending)
            now, done = time.monotonic(), set()
            for i, (event, deadline, message) in enumerate(entries):
                if event.query():
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

    def __init__(self, event, keep, unstage, what: str, peers: str):
        self._event, self._keep, self._unstage = event, keep, unstage
        self.what, self.peers = what, peers
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        torch.cuda.current_stream().wait_event(self._event)
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
        hosts = sorted({row[1] for row in rows})
        if len(hosts) > 1:
            raise RuntimeError(f"{TRANSPORT_ENV}=peer copies between the processes of one host, but the ranks of "
                               f"this group are on {len(hosts)} hosts; use the process group's transport "
                               f"({TRANSPORT_ENV}=group) across hosts")
        self._peer_flags = {r: self._flags if r == t.rank else self._open(bytes.fromhex(row[3]))
                            for r, row in enumerate(rows)}
        self._stream = torch.cuda.Stream(self.device)
        self._sent = collections.defaultdict(PairLedger)  # receiver -> ledger
        self._received = collections.defaultdict(PairLedger)  # sender -> ledger
        self._outbox: dict = {}  # receiver -> device pointer (two slots of the ledger's capacity)
        self._inbox: dict = {}  # sender -> its outbox for this rank, mapped here
        self._kept: list = []  # outboxes replaced by larger ones, and their peers' mappings (never freed)

    def _prepare(self, size: int) -> str:
        """Sets up this rank's side (driver, context, flag words); returns its row for the others: "ok", the host,
        the process id and the flag words' IPC handle."""
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
        return f"ok|{_host_id()}|{os.getpid()}|{self._export(self._flags).hex()}"

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

    def _outbox_key(self, sender: int, receiver: int, generation: int) -> str:
        return f"{self._prefix}outbox/{sender}-{receiver}/{generation}"

    def _grow_outbox(self, receiver: int, ledger: PairLedger) -> None:
        if receiver in self._outbox:
            self._kept.append(self._outbox[receiver])  # the receiver may still be reading it
        ptr = _call(self._cu, self._cu.cuMemAlloc(2 * ledger.capacity), "cuMemAlloc (an outbox)")
        self._outbox[receiver] = ptr
        self._store.set(self._outbox_key(self._t.rank, receiver, ledger.generation), self._export(ptr).hex())

    def _open_inbox(self, sender: int, ledger: PairLedger) -> None:
        t = self._t
        key = self._outbox_key(sender, t.rank, ledger.generation)
        try:
            self._store.wait([key], t.timeout_delta)
        except Exception as err:  # noqa: BLE001
            raise RuntimeError(f"waited {t.timeout:g}s for rank {sender}'s outbox of {ledger.capacity} bytes "
                               f"(did it make this call?): {err}") from err
        if sender in self._inbox:
            self._kept.append(self._inbox[sender])  # (copies from it may still be queued on the stream)
        self._inbox[sender] = self._open(bytes.fromhex(bytes(self._store.get(key)).decode()))

    # ---- a batch ----------------------------------------------------------------------------------------------

    def post(self, sends, recvs, what: str, peers: str) -> PeerPending:
        """Posts (tensor, group peer, tag) sends and receives to other ranks (module docstring).  Sends are read
        and receives written on the links' stream, ordered after the caller's stream at this call."""
        t = self._t
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{t.label}: {TRANSPORT_ENV}=peer cannot be captured in a CUDA graph (its batch "
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
        side = self._stream
        side.wait_stream(caller)
        s = side.cuda_stream
        cu_stream = self._cu.CUstream(s)
        me, size = t.rank, t.size
        for p, msgs in _by_peer(sends):
            ledger = self._sent[p]
            offsets, total = layout([x.numel() * x.element_size() for x in msgs])
            k, slot, grew = ledger.next(total)
            if grew:
                self._grow_outbox(p, ledger)
            if k > 2:  # the receiver has read this slot's previous batch
                self._wait_word(cu_stream, self._flags, _flag_offset(_FREE, p, slot, size), k - 2)
            base = int(self._outbox[p]) + slot * ledger.capacity if p in self._outbox else 0
            for x, off in zip(msgs, offsets):
                self._copy(cu_stream, base + off, x.data_ptr(), x.numel() * x.element_size())
            self._write_word(cu_stream, self._peer_flags[p], _flag_offset(_READY, me, slot, size), k)
            keep += msgs
        for q, msgs in _by_peer(staged):
            ledger = self._received[q]
            offsets, total = layout([x.numel() * x.element_size() for x in msgs])
            k, slot, grew = ledger.next(total)
            if grew:
                self._open_inbox(q, ledger)
            self._wait_word(cu_stream, self._flags, _flag_offset(_READY, q, slot, size), k)
            base = int(self._inbox[q]) + slot * ledger.capacity if q in self._inbox else 0
            for x, off in zip(msgs, offsets):
                self._copy(cu_stream, x.data_ptr(), base + off, x.numel() * x.element_size())
            self._write_word(cu_stream, self._peer_flags[q], _flag_offset(_FREE, me, slot, size), k)
            keep += msgs
        for x in keep:
            x.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
        _WATCHDOG.watch(event, time.monotonic() + t.timeout,
                        f"{t.label}: rank {me} of {size} waited more than {t.timeout:g}s for {what} ({peers}) over "
                        f"the peer copies ({TRANSPORT_ENV}=peer): a peer never posted its side (it stopped, or "
                        "made another call)")
        return PeerPending(event, keep, unstage, what, peers)


def _by_peer(messages):
    """[(peer, [tensor, ...]), ...] by peer, each peer's messages in (tag, posting) order: the order both sides of
    a pair agree on."""
    grouped = collections.defaultdict(list)
    for x, p, tag in messages:
        grouped[p].append((tag, len(grouped[p]), x))
    return [(p, [x for _, _, x in sorted(grouped[p], key=lambda e: (e[0], e[1]))]) for p in sorted(grouped)]
