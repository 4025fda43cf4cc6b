"""Point-to-point transport for context parallelism: batched send/recv with a timeout that names what it waited
for, and CPU staging where the process group cannot move the tensors itself.

- CPU tensors on gloo and CUDA tensors on NCCL go directly (``torch.distributed.batch_isend_irecv``).
- CUDA tensors on a gloo group (several ranks sharing one GPU: NCCL refuses two ranks on one device, gloo cannot
  send device memory) are staged: copied to pinned host memory on a side stream, sent, received into pinned host
  memory and copied back on the consumer's stream when the wait completes.
- With ``FA4DIST_CP_TRANSPORT=peer`` (agreed per call; :meth:`Transport.use_peer_copies`) the context-parallel
  engine's batches of CUDA tensors go over copy-engine copies between the processes of one host instead
  (:mod:`.peer`).

Every wait is bounded by the transport's timeout (on NCCL the wait is a stream dependency and the process group's
own timeout applies); a failure raises :class:`CommError` naming the operation, the peer and the timeout.  After
one, the group is out of step for fa4dist: this rank refuses its later calls on it at once (:class:`GroupBroken`),
and so do the other ranks from their next agreement check on it (the failure is posted as this rank's row there).
A store exchange's wait that outlasts a quarter of the timeout (at most 10 s) is posted and polls: two ranks that
wait for each other in different exchanges (calls on different process groups, or in other orders) fail then,
naming both waits, instead of at the timeout (:meth:`Transport._wait_for_rows`).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import threading
import time
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from ..kernels.checkpointing import outside_selective_checkpoint


_STORE_SEQ: dict = {}  # key prefix -> exchanges made on it in the current world
_WORLD: list = [None, 0]  # the current world's default store, and its number in this process
_WRITTEN: set = set()  # this process's rows still in the store (world_generation takes them back)
# (world number, group name) -> the message of the first fa4dist exchange that failed on the group in this process
# (a CommError: a timeout, a transport error, ranks out of step); the group is refused from then on (GroupBroken)
_BROKEN: dict = {}


def world_generation() -> int:
    """The number of the current torch.distributed world in this process (each ``init_process_group`` makes a new
    one, with a new store).  Group names are unique within a world and the same on every rank, but start over with
    each world: what is kept per group name (exchange numbers, module numbers) is kept per world."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    if _WORLD[0] is not store:
        if _WORLD[0] is not None:
            # A new world on the same store (a re-init on torchrun's, or store=) starts its group names and exchange
            # numbers over, and would read the last exchange's rows this rank left there as its own.  Taken back
            # here, at this rank's first use of the new world (exchanges after the first then find none; a first
            # exchange can still meet a row another rank has not taken back yet: use a new store to re-init).
            for key in _WRITTEN:
                with contextlib.suppress(Exception):
                    store.delete_key(key)
        _WRITTEN.clear()
        _WORLD[0] = store
        _WORLD[1] += 1
        _STORE_SEQ.clear()
        _BROKEN.clear()
        _UNVERIFIED_NAMES.clear()
    return _WORLD[1]


def group_key(group) -> tuple:
    """The key of `group` (None: the default group) in this module's per-group records: the world's number and the
    group's name (the same on every rank, unique within a world; a new group, or a new world, starts clean)."""
    return world_generation(), (group if group is not None else dist.group.WORLD).group_name


def group_alive(group) -> bool:
    """Whether `group` (None: the default group) is a process group of the current world, not one destroyed (by
    ``destroy_process_group``, of it or of the whole world)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_rank(group)  # (a destroyed group keeps its size, but is no longer registered)
    except (ValueError, RuntimeError):
        return False
    return True


def _store_channel(group) -> tuple:
    """(the default process group's store, the key prefix of `group`: its name, unique per group and the same on
    every rank, since groups are created collectively in one order).  Names start over with each
    ``init_process_group``, so the exchanges' numbers do too: a group of the new world that reuses an old group's
    name (with other ranks, which made other exchanges on it) must not wait for a number only some ranks reach."""
    from torch.distributed import distributed_c10d

    name = (group if group is not None else dist.group.WORLD).group_name
    world_generation()  # a new world: its exchanges are numbered from 1
    return distributed_c10d._get_default_store(), f"fa4dist/agree/{name}/"


class _Use:
    """The thread running a call on a process group (its id and name, and the call), how deeply (a backward may
    recompute a checkpointed forward inside itself), and the first other thread refused meanwhile (its name, and
    the call it tried: the label and what)."""

    def __init__(self, ident: int, thread: str, call: str):
        self.ident, self.thread, self.call, self.depth, self.intruder = ident, thread, call, 0, None


_USE_LOCK = threading.Lock()
_IN_USE: dict = {}  # (world number, group name) -> _Use
# the threads that made fa4dist calls on process groups in this process (the Thread objects, not their idents: a
# later thread may reuse a finished one's ident, and was read as a caller, which switched deadlock detection off)
_CALLERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def sole_caller() -> bool:
    """Whether this thread is the only one of the process that makes, or may make, fa4dist calls on process groups:
    every other live thread is a daemon that never made one (torch's and the data loaders' helper threads).  Only
    then does a wait of this thread mean the process posts nothing else meanwhile (Transport._wait_for_rows)."""
    me = threading.get_ident()
    return all(t.ident == me or (t.daemon and t not in _CALLERS) for t in threading.enumerate())


@contextlib.contextmanager
def exclusive(groups: Sequence, what: str, label: str):
    """Runs one call's exchanges on ``groups`` as the only thread of this process using them.

    The ranks pair their calls on a group by order (agreement checks by number, transfers by tag, collectives by
    their sequence): two threads' calls at once pair up differently on different ranks, which computes a wrong
    result from another call's data or waits out the timeout.  The attention, the losses' label counts,
    ``reduce_value`` and the Hugging Face handle's batch check take it, so one thread's attention and another's
    loss exclude each other too.  A second thread is refused at once; the running
    call raises when it ends (the other ranks may have paired it with the refused thread's call), unless it raised
    already.  A group on which an exchange failed earlier is refused first (:func:`check_usable`).  Per call, not
    from a forward to its backward: autograd may run the backward on a thread of its own.

    The call runs outside selective activation checkpointing's policy
    (:func:`fa4dist.kernels.checkpointing.outside_selective_checkpoint`): its exchanges run again, all of them, in a
    checkpoint's recompute."""
    ident, me = threading.get_ident(), threading.current_thread().name  # (names need not be unique)
    keys = [group_key(g) for g in groups]
    check_usable(keys, what, label)
    with _USE_LOCK:
        busy = [(key, _IN_USE[key]) for key in keys if key in _IN_USE and _IN_USE[key].ident != ident]
        for _, use in busy:
            use.intruder = use.intruder or (me, f"{label}: {what}")
        if not busy:
            _CALLERS.add(threading.current_thread())
            for key in keys:
                _IN_USE.setdefault(key, _Use(ident, me, f"{label}: {what}")).depth += 1
    if busy:
        (_, name), use = busy[0]
        raise RuntimeError(
            f"{label}: {what} on process group {name!r} was called from thread {me!r} while thread {use.thread!r} "
            f"is running another call on that group ({use.call}); calls on a group must come from one thread at a "
            "time, in the same order on every rank (two threads' calls pair up differently on different ranks: a "
            "wrong result or a hang).  Make them from one thread, or give each thread a process group of its own")
    intruders = []
    try:
        with outside_selective_checkpoint():
            yield
    finally:
        with _USE_LOCK:
            for key in keys:
                use = _IN_USE[key]
                use.depth -= 1
                if use.intruder:
                    intruders.append((key[1], use.intruder))
                if not use.depth:
                    del _IN_USE[key]
    if intruders:  # (only after a call that returned: its own error, if any, went up instead)
        name, (other, call) = intruders[0]
        raise RuntimeError(
            f"{label}: thread {other!r} made a call on process group {name!r} ({call}) while {what} ran on thread "
            f"{me!r}; the other ranks may have paired this call with that thread's, so its result is not trusted "
            "(make the calls on a group from one thread at a time)")


def deepcopy_sharing(obj, memo: dict, shared: Sequence[str]):
    """``copy.deepcopy`` of ``obj`` whose attributes named in ``shared`` (process groups and what wraps them, which
    cannot be copied) are the original's: a deep copy of a model (a frozen reference, EMA weights) communicates
    over the same groups.  For use in a class's ``__deepcopy__``."""
    import copy

    new = type(obj).__new__(type(obj))  # (not copy.copy: it goes through __getstate__, which may refuse groups)
    memo[id(obj)] = new
    for name, value in vars(obj).items():
        setattr(new, name, value if name in shared else copy.deepcopy(value, memo))
    return new


def refuse_pickling(obj, what: str, names: Sequence[str], remedy: str) -> dict:
    """``__getstate__`` of ``obj``, whose attributes named in ``names`` may hold process groups: pickle,
    ``torch.save(model)`` and multiprocessing are refused with a TypeError naming ``what`` and the remedy (save the
    ``state_dict()``; ``remedy``: how to set the object up again where it is loaded), where pickle's own error named
    neither.  A process group is this process's live connection to its world, which another process (or a later
    world) cannot take over.  Without groups (None) the state is ``obj.__dict__``."""
    held = [name for name in names if getattr(obj, name, None) is not None]
    if held:
        verb = "belongs" if len(held) == 1 else "belong"
        raise TypeError(
            f"{what} on a process group cannot be pickled (pickle, torch.save(model), multiprocessing): its "
            f"{' and '.join(held)} {verb} to this process's torch.distributed world.  Save the weights instead "
            f"(torch.save(model.state_dict())) and {remedy} where you load them (copy.deepcopy works: the copy "
            "shares the groups)")
    return obj.__dict__


class CommError(RuntimeError):
    """A context-parallel transfer failed or timed out; the message names what was being waited for."""


class GroupBroken(CommError):
    """A call on a process group on which an earlier fa4dist exchange failed on this rank (a CommError): refused at
    once, naming that failure."""


def mark_broken(key: tuple, message: str, where: str = "this rank") -> None:
    """Records the failure of an exchange on the group of `key` (:func:`group_key`), on `where`; the first one is
    kept."""
    _BROKEN.setdefault(key, (where, message))


def is_broken(key: tuple) -> bool:
    """Whether an fa4dist exchange on the group of `key` (:func:`group_key`) failed in this process."""
    return key in _BROKEN


@contextlib.contextmanager
def abandoned_on_failure(transport: "Transport", posted: list, what: str):
    """Runs work that posts transfers on ``transport`` into ``posted`` (Pending); an error that stops it (a kernel's
    refusal, out of memory, an interrupt, a failed exchange of another group) while any of them is in flight
    records the group as out of step, naming that error and ``what`` stopped: the peers' messages stay unanswered,
    and a later call's would pair with them (on every rank alike when the error is, as a backend's refusal of a
    shape: no rank times out).  Later calls on the group are refused at once (:class:`GroupBroken`), on the other
    ranks from their next agreement check.  A failed exchange of this group has recorded itself (the first
    message stays)."""
    try:
        yield
    except BaseException as err:
        if any(not p.done for p in posted) and not is_broken(transport.key):
            t = transport
            t.failed(f"{t.label}: rank {t.rank} of {t.size} stopped {what} in flight: {type(err).__name__}: {err}")
        raise


def check_usable(keys: Sequence[tuple], what: str, label: str) -> None:
    """Raises :class:`GroupBroken` if an earlier fa4dist exchange failed on one of the groups of `keys` in this
    process.  After a failed exchange the ranks are out of step on the group: the ranks that timed out stopped in
    one call while the others went on (or never came), their exchanges' numbers differ and gloo may have closed the
    connections, so a later call waits out another timeout, or pairs with another rank's earlier unanswered exchange
    (its messages read as this call's).  Only a new group starts over."""
    for key in keys:
        if key in _BROKEN:
            raise GroupBroken(_refusal(label, what, key[1], *_BROKEN[key]))


def _refusal(label: str, what: str, name: str, where: str, first: str) -> str:
    if len(first) > 1500:
        first = first[:1500] + " [...]"
    return (f"{label}: {what} on process group {name!r} refused: an earlier fa4dist exchange on this group failed on "
            f"{where}, so its ranks are out of step (a later exchange would wait out another timeout or pair with "
            "another call's messages).  Destroy the group (torch.distributed.destroy_process_group(group)) and make "
            "a new one on every rank (torch.distributed.new_group), or restart the job (for the default group: a "
            "new init_process_group on the same rendezvous store, as torchrun's, starts the group names over and "
            f"would find this failure's records there again).  The earlier failure: {first}")


# what a timeout's message adds: the knob, for a rank that was only busy elsewhere for longer
_TIMEOUT_HINT = (" A rank busy elsewhere for longer, e.g. saving a checkpoint alone, needs a larger timeout= (the "
                 "module's, the call's, or enable_context_parallel's)")

# the value a rank whose exchange on a group failed posts as its rows of the group's store exchanges that another
# rank may still be waiting for or make next (Transport.failed), followed by the failure's message
_POISON = "out of step:"

# A rank's wait in a store exchange that did not complete in its blocking part (_blocking_part) is posted under
# _WAITS + its global rank (the exchange, the group, what it waits for and its missing ranks); it then polls every
# _POLL seconds and reads the missing ranks' posts every _READ_POSTS_EVERY (Transport._wait_for_rows).  A call a rank
# refused on its own, before any exchange, is posted there too (post_refusal).
_WAITS = "fa4dist/waits/"
_BLOCKING_WAIT = 10.0
_POLL = 0.05
_COLLECTIVE_WAITS = itertools.count()  # numbers the slow waits of collectives in this process (Transport._collective)
_READ_POSTS_EVERY = 1.0


def _blocking_part(timeout: float) -> float:
    """Seconds of an exchange's wait spent in one blocking store wait (the fast path; its expiry logs a c10d
    warning): 10 s, or a quarter of a shorter timeout, so that a deadlock is named well before the timeout."""
    return min(_BLOCKING_WAIT, 0.25 * timeout)


def _post(store, global_rank: int, post: dict) -> None:
    try:
        store.set(f"{_WAITS}{global_rank}", json.dumps(post))
    except Exception:  # noqa: BLE001  (best effort: the posts only speed up or explain a failure)
        pass


_REFUSAL_POSTED = [False]  # whether this process's last post is a refusal (post_refusal)


def _unpost(store, global_rank: int) -> None:
    try:
        store.delete_key(f"{_WAITS}{global_rank}")
    except Exception:  # noqa: BLE001
        pass


def _read_post(store, global_rank: int):
    try:
        key = f"{_WAITS}{global_rank}"
        return json.loads(bytes(store.get(key)).decode()) if store.check([key]) else None
    except Exception:  # noqa: BLE001  (a post deleted between the check and the read: nothing posted)
        return None


def _waits_for(store, post, me: int, exchange: str) -> bool:
    """Whether a missing rank's post shows it waiting, with no other thread of its process that could post (its
    ``sole``), in another exchange than ``me``'s (``exchange``) for a row that global rank ``me`` has not posted
    there (``me``, blocked here with no other thread of its own, never will)."""
    if not post or not post.get("exchange") or not post.get("sole"):
        return False
    row = post.get("missing", {}).get(str(me))
    return post["exchange"] != exchange and row is not None and not store.check([f"{post['exchange']}/{row}"])


# A rank that makes calls on a group without the agreement checks (verify=False) posts the group's name under
# _UNVERIFIED + its global rank, once per group and world (post_unverified): a rank that checks, left waiting for it
# in an agreement check, names the mismatch at its timeout instead of "posted nothing".
_UNVERIFIED = "fa4dist/unverified/"
_UNVERIFIED_NAMES: set = set()  # this process's groups posted under _UNVERIFIED in the current world


def post_unverified(group) -> None:
    """Posts, once per group and world, that this rank calls on `group` with verify=False (best effort)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    _, name = group_key(group)  # (a new world starts the names over: world_generation clears them)
    if name in _UNVERIFIED_NAMES:
        return
    from torch.distributed import distributed_c10d

    _UNVERIFIED_NAMES.add(name)
    key = f"{_UNVERIFIED}{dist.get_rank()}"
    with contextlib.suppress(Exception):
        distributed_c10d._get_default_store().set(key, json.dumps(sorted(_UNVERIFIED_NAMES)))
        _WRITTEN.add(key)


def _unverified_on(store, global_rank: int, group_name: str) -> bool:
    """Whether `global_rank` posted that it calls on group `group_name` with verify=False."""
    key = f"{_UNVERIFIED}{global_rank}"
    try:
        return store.check([key]) and group_name in json.loads(bytes(store.get(key)).decode())
    except Exception:  # noqa: BLE001
        return False


def _describe_post(post, unverified: bool = False) -> str:
    if not post and unverified:
        return ("posted nothing, and calls on this group with verify=False: it skips the agreement checks this rank "
                "waits in (every rank must pass the same verify)")
    if not post:
        return "posted nothing (it is not waiting in an fa4dist exchange: busy elsewhere, or it never made the call)"
    if post.get("refused"):
        when = f" at {post['at']} UTC" if post.get("at") else ""
        return (f"refused a call on its own{when} and has made no exchange since (a refusal its caller handled, or "
                f"its call never came): {post['refused']}")
    return f"waits in {post.get('what')} on process group {post.get('group')!r}"


def post_refusal(message: str) -> None:
    """Posts that this rank refused a call on its own, without an exchange its group's ranks could read (its process
    group itself was refused): another rank that waits for it names it when its wait times out.  Not a failure of
    the others' call: this rank may still make that call.  The post stands until this rank's next exchange
    completes (a refusal its caller handled must not explain a later wait)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d

    world_generation()
    _post(distributed_c10d._get_default_store(), dist.get_rank(),
          dict(refused=message[:500], at=time.strftime("%H:%M:%S", time.gmtime())))
    _REFUSAL_POSTED[0] = True


def _clear_refusal() -> None:
    """Takes back this rank's posted refusal once it has made an exchange (it went on after refusing)."""
    if _REFUSAL_POSTED[0]:
        _REFUSAL_POSTED[0] = False
        from torch.distributed import distributed_c10d

        with contextlib.suppress(Exception):  # (best effort: a post only explains a failure)
            _unpost(distributed_c10d._get_default_store(), dist.get_rank())


@contextlib.contextmanager
def refusals_posted():
    """Posts an exception raised inside (:func:`post_refusal`) before it propagates: for a rank's own checks outside
    any exchange (a module's constructor, plan or shard), so that the ranks left waiting for it name it."""
    try:
        yield
    except Exception as err:
        post_refusal(f"{type(err).__name__}: {err}")
        raise


def member_size_rank(group, name: str = "group") -> tuple[int, int]:
    """(size, this process's rank) of a process group (None: the default group).  A group this process is not a
    member of is refused: ``torch.distributed.new_group`` gives non-members a placeholder whose size and rank are
    -1, which would otherwise pass for a group until something used it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name} was given but torch.distributed is not initialized (init_process_group first)")
    if not (group is None or isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER):
        # (a DeviceMesh failed deep in torch.distributed as 'not registered', other objects on a missing attribute)
        mesh = " (a DeviceMesh: pass mesh.get_group(), or mesh= where the call takes a mesh)" if hasattr(
            group, "get_group") else ""
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup (or None), got {type(group).__name__}"
                        f"{mesh}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or rank < 0:
        raise ValueError(f"{name} is a process group that this rank (global rank {dist.get_rank()}) is not a member "
                         "of; pass the group this rank belongs to")
    return size, rank


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


class Pending:
    """Transfers in flight; :meth:`wait` completes them (and copies staged receives to their device tensors)."""

    def __init__(self, transport: "Transport", works, staged_recvs, keep_alive, what: str, peers: str):
        self._t, self._works, self._staged, self._keep = transport, works, staged_recvs, keep_alive
        self.what, self.peers = what, peers
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        t = self._t
        for work in self._works:
            try:
                if t.host_wait:
                    work.wait(t.timeout_delta)
                else:
                    work.wait()
            except RuntimeError as err:
                raise t.failed(
                    f"{t.label}: rank {t.rank} of {t.size} failed waiting for {self.what} ({self.peers}; timeout "
                    f"{t.timeout:g}s): {err}"
                ) from err
        for device_tensor, host in self._staged:
            device_tensor.copy_(host, non_blocking=True)
        self._works = self._staged = self._keep = None
        self.done = True


def _peers_text(sends, recvs) -> str:
    """The peers of a batch's remote messages, as its errors name them ("send to rank 1, recv from rank 3")."""
    send_peers = sorted({p for _, p, _ in sends})
    recv_peers = sorted({p for _, p, _ in recvs})
    return ", ".join([f"send to rank {p}" for p in send_peers] + [f"recv from rank {p}" for p in recv_peers])


class Transport:
    """Send/recv on one process group; peers are given as ranks *within* the group."""

    def __init__(self, group, timeout: float = 300.0, label: str = "fa4dist context parallel"):
        self.group = group
        self.size, self.rank = member_size_rank(group, "the process group of context parallelism")
        self.backend = str(dist.get_backend(group)).lower()
        self.timeout = float(timeout)
        self.timeout_delta = datetime.timedelta(seconds=self.timeout)
        self.label = label
        self.host_wait = self.backend != "nccl"  # NCCL waits are stream dependencies; its watchdog times out
        self.key = group_key(group)  # the group's records (a failed exchange: check_usable)
        self._global = [_global_rank(group, r) for r in range(self.size)]
        self._side_stream = None
        self._ready = False
        self.peer_links = None  # copy-engine links (peer.PeerLinks), while the agreed call asks for them

    def use_peer_copies(self, enabled: bool) -> None:
        """Moves this group's point-to-point batches over copy-engine peer copies (``FA4DIST_CP_TRANSPORT=peer``,
        :mod:`.peer`) or back to the group's own send/recv.  Every rank of the group calls it alike, after the
        agreement check of a call that carries the choice; the links are set up on the first use (collectively)."""
        if not enabled:
            self.peer_links = None
            return
        from .peer import existing_links, links_for

        what = "the peer-copy links' setup"
        self.usable(what)
        self.peer_links = existing_links(self)
        if self.peer_links is not None:
            return
        error = None
        try:
            links = links_for(self)
        except RuntimeError as err:  # (CommError included) every rank must hear of it, not wait for this one
            error = err
        rows = self.host_gather_ints([int(error is not None)], what)
        if error is not None:
            raise self.failed(f"{self.label}: rank {self.rank} of {self.size} could not set up peer copies "
                              f"(FA4DIST_CP_TRANSPORT=peer): {error}") from error
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            raise self.failed(f"{self.label}: rank(s) {failed} of this group could not set up peer copies "
                              "(FA4DIST_CP_TRANSPORT=peer); their errors name why", f"rank {failed[0]}")
        self.peer_links = links

    def failed(self, message: str, where: str = "this rank", waiting: bool = False) -> CommError:
        """The CommError of a failed exchange (`message`, the failure seen on `where`), the group recorded as out
        of step (check_usable).  The failure is also posted (best effort) as this rank's row of the group's next
        store exchange, and of the one it was ``waiting`` for: a rank that never came to that call, or stopped
        after its agreement check, reads it in its next agreement check and is refused at once, instead of
        pairing with this rank's unanswered row and waiting out its timeout in the transfers.  (Not over a
        completed exchange's row: another rank may still be reading it.)"""
        mark_broken(self.key, message, where)
        try:
            store, prefix = _store_channel(self.group)
            seq = _STORE_SEQ.get(prefix, 0)
            for n in (seq, seq + 1) if waiting and seq else (seq + 1,):
                store.set(f"{prefix}{n}/{self.rank}", _POISON + message)
                _WRITTEN.add(f"{prefix}{n}/{self.rank}")
        except Exception:  # noqa: BLE001  (the store may be gone too: the failure itself is what to raise)
            pass
        return CommError(message)

    def usable(self, what: str) -> None:
        """Refuses an exchange on a group on which an earlier one failed (for callers outside ``exclusive``)."""
        check_usable([self.key], what, self.label)

    # -------------------------------------------------------------------------------------------------------------

    def staged(self, t: torch.Tensor) -> bool:
        return t.is_cuda and self.backend == "gloo"

    def comm_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host copies of device tensors, complete when this returns."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        hosts = []
        with torch.cuda.stream(side):
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(side)
                hosts.append(h)
        side.synchronize()
        return hosts

    def post(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        what: str,
        tag: int = 0,
    ) -> Pending:
        """Posts sends of (tensor, group peer) and receives into (tensor, group peer); returns the pending batch.

        A peer equal to this rank is a local copy."""
        return self.post_tagged([(t, p, tag) for t, p in sends], [(t, p, tag) for t, p in recvs], what)

    def post_tagged(self, sends, recvs, what: str) -> Pending:
        """:meth:`post` with a tag per message: (tensor, group peer, tag).  Messages between two ranks match by tag
        (gloo) or by posting order (NCCL); both sides post in the same order."""
        self.usable(what)
        ops, staged, keep = [], [], []
        local_sends = {(p, tag): t for t, p, tag in sends if p == self.rank}
        send_list = [(t, p, tag) for t, p, tag in sends if p != self.rank]
        if self.peer_links is not None:
            return self._post_peer(local_sends, send_list, recvs, what)
        stage_sends = [t for t, _, _ in send_list if self.staged(t)]
        hosts = iter(self._to_host(stage_sends)) if stage_sends else iter(())
        for t, p, tag in send_list:
            buf = next(hosts) if self.staged(t) else t
            keep.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, self._global[p], self.group, tag))
        for t, p, tag in recvs:
            if p == self.rank:
                t.copy_(local_sends[(p, tag)])
                continue
            buf = t
            if self.staged(t):
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                staged.append((t, buf))
            ops.append(dist.P2POp(dist.irecv, buf, self._global[p], self.group, tag))
        peers = _peers_text(send_list, [m for m in recvs if m[1] != self.rank])
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as err:
            raise self.failed(f"{self.label}: rank {self.rank} could not post {what} ({peers}): {err}") from err
        return Pending(self, works, staged, keep, what, peers or "local")

    def _post_peer(self, local_sends, send_list, recvs, what: str):
        remote = []
        for t, p, tag in recvs:
            if p == self.rank:
                t.copy_(local_sends[(p, tag)])
            else:
                remote.append((t, p, tag))
        peers = _peers_text(send_list, remote)
        if not send_list and not remote:
            return Pending(self, [], [], [], what, "local")
        try:
            return self.peer_links.post(send_list, remote, what, peers)
        except RuntimeError as err:
            raise self.failed(f"{self.label}: rank {self.rank} could not post {what} ({peers}) over peer copies: "
                              f"{err}") from err

    def ready(self) -> None:
        """Call on every rank of the group before its first point-to-point batch: NCCL needs every rank in the first
        operation of a group, and a sparse ring schedule's first batch need not involve all (one tiny all-reduce,
        once; nothing on gloo)."""
        if self._ready:
            return
        self.usable("the first use of the group")
        if self.backend == "nccl":
            self._collective(dist.all_reduce(torch.zeros(1, device=self.comm_device()), group=self.group,
                                             async_op=True), "the first use of the group")
        self._ready = True

    # -------------------------------------------------------------------------------------------------------------

    def all_gather_bytes(self, payload: bytes, what: str, size: int = 4096) -> list[bytes]:
        """Every rank's payload (at most `size` bytes), in rank order: one all-gather of fixed-size buffers."""
        if len(payload) > size - 8:
            raise ValueError(f"all_gather_bytes: payload of {len(payload)} bytes exceeds {size - 8}")
        self.usable(what)
        device = self.comm_device()
        framed = len(payload).to_bytes(8, "little") + payload
        data = torch.zeros(size, dtype=torch.uint8)
        data[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
        data = data.to(device)
        gathered = [torch.empty_like(data) for _ in range(self.size)]
        self._collective(dist.all_gather(gathered, data, group=self.group, async_op=True), what)
        out = []
        for g in torch.stack(gathered).cpu():
            raw = bytes(g.tolist())
            n = int.from_bytes(raw[:8], "little")
            out.append(raw[8:8 + n])
        return out

    def host_gather_ints(self, values: Sequence[int], what: str) -> list[list[int]]:
        """Every rank's ints (the same count on every rank), in rank order, through the process group's store
        (the rendezvous TCPStore): host-side only, so it neither waits for the GPU nor stalls its stream, unlike a
        collective whose result is read back.  Exchanges on one group are numbered, and a rank deletes its key of
        exchange n - 1 once every rank has posted exchange n (so each has read n - 1).  Rows of different lengths
        (ranks whose exchange n is another kind of exchange: out of step) raise CommError naming the exchange."""
        self.usable(what)
        store, prefix = _store_channel(self.group)
        seq = _STORE_SEQ[prefix] = _STORE_SEQ.get(prefix, 0) + 1
        keys = [f"{prefix}{seq}/{r}" for r in range(self.size)]
        store.set(keys[self.rank], ",".join(str(int(x)) for x in values))
        _WRITTEN.add(keys[self.rank])
        self._wait_for_rows(store, keys, what)
        posted = store.multi_get(keys)
        self._raise_if_poisoned(keys, posted, what)
        texts = [bytes(v).decode() for v in posted]
        rows = [[int(x) for x in t.split(",")] if t else [] for t in texts]
        if any(len(r) != len(values) for r in rows):  # (read as this exchange's, a short row was an IndexError)
            counts = ", ".join(f"rank {r} {len(row)}" for r, row in enumerate(rows))
            raise self.failed(
                f"{self.label}: rank {self.rank} of {self.size}: the ranks are out of step in {what}: it takes "
                f"{len(values)} values from every rank, got {counts} (their exchange number {seq} on the group is "
                "another exchange, of an earlier call that failed or another kind of call)")
        if seq > 1:
            store.delete_key(f"{prefix}{seq - 1}/{self.rank}")
            _WRITTEN.discard(f"{prefix}{seq - 1}/{self.rank}")
        return rows

    def _wait_for_rows(self, store, keys: list, what: str) -> None:
        """Waits until every rank of the group has posted its row of a store exchange (``keys``, in group rank
        order), for at most the timeout.  A wait longer than :func:`_blocking_part` of the timeout is posted
        (:func:`_post`) and goes on by polling (a blocking store wait that times out logs a warning), reading the
        missing ranks' posts each second.  A missing rank that waits, in another exchange, for a row this rank has
        not posted there is waiting for this rank as this rank waits for it, if neither process has another thread
        that could post meanwhile (:func:`sole_caller`, posted too): a deadlock (the ranks called on different
        process groups, or made their calls in different orders).  This rank then fails naming both waits, and
        posts its failure as its row of the other rank's exchange, which fails it too (the poisoned rows of
        :meth:`failed`).  A timeout names what the missing ranks posted last (a wait elsewhere, or a call they
        refused on their own)."""
        deadline = time.monotonic() + self.timeout
        _clear_refusal()  # (this rank made its part of an exchange: a refusal it posted before was handled)
        try:
            store.wait(keys, datetime.timedelta(seconds=_blocking_part(self.timeout)))
            return
        except Exception as timed_out:  # noqa: BLE001  (the store raises its own timeout types, by version)
            err: Exception = timed_out
        me = self._global[self.rank]
        exchange = keys[0].rsplit("/", 1)[0]  # the exchange's key prefix: its group's and its number
        posted, next_read = False, 0.0
        try:
            while not store.check(keys):
                now = time.monotonic()
                if now >= next_read:
                    missing = [r for r in range(self.size) if not store.check([keys[r]])]
                    present = [k for r, k in enumerate(keys) if r not in missing]
                    self._raise_if_poisoned(present, store.multi_get(present) if present else [], what)
                    sole = sole_caller()
                    _post(store, me, dict(exchange=exchange, group=self.group_name, what=what, sole=sole,
                                          missing={str(self._global[r]): r for r in missing}))
                    posted = True
                    posts = {self._global[r]: _read_post(store, self._global[r]) for r in missing}
                    if sole:
                        self._raise_on_cycle(store, posts, exchange, what, waiting=True)
                    next_read = now + _READ_POSTS_EVERY
                if now >= deadline:
                    notes = "; ".join(
                        f"global rank {rank} {_describe_post(post, _unverified_on(store, rank, self.group_name))}"
                        for rank, post in posts.items())
                    raise self.failed(
                        f"{self.label}: rank {self.rank} of {self.size} failed waiting for {what} from all ranks of "
                        f"its group (timeout {self.timeout:g}s; did every rank call it?{_TIMEOUT_HINT})"
                        + (f" (what the missing ranks posted last: {notes})" if notes else ""), waiting=True
                    ) from err
                time.sleep(_POLL)
        finally:
            if posted:
                _unpost(store, me)

    def _raise_on_cycle(self, store, posts: dict, exchange: str, what: str, waiting: bool) -> None:
        """Raises where a peer's post (``posts``: global rank -> its post) shows it waiting, in another exchange, for
        a row of this rank, which waits for it in ``exchange`` (``what``): each waits for the other (the ranks made
        their calls on different process groups, or in different orders).  This rank's failure is also posted as
        its row of the peer's exchange, which fails the peer too."""
        me = self._global[self.rank]
        for rank, post in posts.items():
            if _waits_for(store, post, me, exchange):
                message = (f"{self.label}: rank {self.rank} of {self.size} (global rank {me}) waits for global rank "
                           f"{rank} in {what} on process group {self.group_name!r}, while rank {rank} waits for this "
                           f"rank in {post.get('what')} on process group {post.get('group')!r}: the ranks made "
                           "different calls (on different process groups, or in different orders), which would wait "
                           "for each other until the timeout")
                with contextlib.suppress(Exception):  # (best effort: its own poll finds the cycle too)
                    store.set(f"{post['exchange']}/{post['missing'][str(me)]}", _POISON + message)
                raise self.failed(message, waiting=waiting)

    def _raise_if_poisoned(self, keys: list, values: list, what: str) -> None:
        """Raises (GroupBroken, naming it) when one of the rows read (``values`` of ``keys``) is a rank's failure
        (:meth:`failed`)."""
        for key, value in zip(keys, values):
            r, text = int(key.rsplit("/", 1)[1]), bytes(value).decode()
            if text.startswith(_POISON):  # rank r's exchange on the group failed (Transport.failed)
                self.failed(text[len(_POISON):], f"rank {r} of the group")  # (recorded, and passed on)
                self.usable(what)  # (raises GroupBroken naming it)

    @property
    def group_name(self) -> str:
        return (self.group if self.group is not None else dist.group.WORLD).group_name

    def all_gather_ints(self, values: Sequence[int], what: str) -> list[list[int]]:
        """Every rank's int64 values (the same count on every rank), in rank order: one small all-gather."""
        self.usable(what)
        device = self.comm_device()
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        self._collective(dist.all_gather(gathered, mine, group=self.group, async_op=True), what)
        return torch.stack(gathered).cpu().tolist()

    def _collective(self, work, what: str) -> None:
        """Waits for a collective (``work``) for at most the timeout.  On gloo, a wait longer than
        :func:`_blocking_part` of the timeout is posted and goes on by polling, as a store exchange's
        (:meth:`_wait_for_rows`): a rank that waits, in a store exchange, for a row this rank has not posted there
        (this rank, blocked here with no other thread that could post, never will) is waiting for this rank as
        this rank waits for it in the collective (a backward that runs a FixedPointGrads exchange on one rank and
        an attention call on another); this rank then fails naming both, and posts its failure as its row there,
        which fails that rank too.  (A timed-out gloo wait leaves the operation running: a later wait completes
        it, as checked on torch 2.13.  NCCL's timed-out wait may abort its communicator, so there it stays one wait
        of the whole timeout.)"""
        _clear_refusal()  # (as _wait_for_rows)
        start = time.monotonic()
        try:
            if self.backend != "gloo":
                work.wait(self.timeout_delta)
                return
            try:
                work.wait(datetime.timedelta(seconds=_blocking_part(self.timeout)))
                return
            except RuntimeError:
                pass
            self._poll_collective(work, what, start + self.timeout)
            work.wait()
        except CommError:
            raise
        except RuntimeError as err:
            raise self.failed(
                f"{self.label}: rank {self.rank} of {self.size} failed waiting for {what} from all ranks of its "
                f"group (timeout {self.timeout:g}s; did every rank call it?{_TIMEOUT_HINT}): {err}"
            ) from err

    def _poll_collective(self, work, what: str, deadline: float) -> None:
        """_collective's slow path on gloo: polls until ``work`` completes, posting this rank's wait and reading its
        peers' posts each second; raises on a deadlock (as :meth:`_wait_for_rows` names one) or at ``deadline``."""
        store = _store_channel(self.group)[0]
        me = self._global[self.rank]
        # A name of this wait alone: no rank posts rows there, so a peer waiting for this rank reads it as a wait
        # elsewhere, and a peer that finds the cycle first posts its failure there (read below) as its row.
        exchange = f"fa4dist/collective/{self.group_name}/{me}/{next(_COLLECTIVE_WAITS)}"
        peers = {str(g): r for r, g in enumerate(self._global) if r != self.rank}
        rows = [f"{exchange}/{r}" for r in peers.values()]
        posted, next_read = False, 0.0
        try:
            while not work.is_completed():
                now = time.monotonic()
                if now >= next_read:
                    failed = [k for k in rows if store.check([k])]
                    self._raise_if_poisoned(failed, store.multi_get(failed) if failed else [], what)
                    sole = sole_caller()
                    _post(store, me, dict(exchange=exchange, group=self.group_name, what=what, sole=sole,
                                          missing=peers))
                    posted = True
                    if sole:  # (its failure posted as its row of the group's next store exchange)
                        self._raise_on_cycle(store, {int(g): _read_post(store, int(g)) for g in peers}, exchange,
                                             what, waiting=False)
                    next_read = now + _READ_POSTS_EVERY
                if now >= deadline:
                    raise RuntimeError("timed out")
                time.sleep(_POLL)
        finally:
            if posted:
                _unpost(store, me)
            for key in rows:  # (a peer's failure posted here: read, or too late to matter)
                with contextlib.suppress(Exception):
                    store.delete_key(key)
