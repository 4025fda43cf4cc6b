"""The agreement check's disagreement path: when the cheap per-call fingerprints of the ranks differ, every rank
exchanges its full call signature (or its own refusal of the call) and raises the same message, naming the fields
and the ranks that differ, or the rank that rejected its inputs.  Used by context-parallel attention
(:meth:`fa4dist.context_parallel.core.ContextParallel.agree`) and by the model's collective helpers
(fa4dist.models.loss, fa4dist.models.invariant_grads)."""

from __future__ import annotations

import hashlib
import json
from typing import Optional

LABEL = "fa4dist context parallel"
_FRAME = 4096  # bytes of one rank's frame in the agreement check's exchange (Transport.all_gather_bytes)


_FIELD_HINTS = {"module": " (which attention module was called: each rank numbers its modules on the group in the "
                          "order it created them, copy.deepcopy included, so the ranks called different modules, or "
                          "created them in different orders; a module or model created or deep-copied on some "
                          "ranks only shifts the numbers of every later one: make such copies on every rank, or "
                          "copy a state_dict)",
                "direction": " (a rank made a new forward call while others ran a backward: its loss did not "
                             "depend on every attention output the others' did, or it skipped a backward)"}


def _frame(rank: int, state: dict, sig: Optional[dict], call: int) -> tuple:
    """The JSON payload of one rank in an agreement exchange and the text it carries (``state``: what the rank knows
    so far, see raise_disagreement; its text is a rejection's error or a disagreement's message, never both): the
    text is cut (to at most 2000 characters, and then as far as needed) so that the encoded payload fits the
    payload bytes of a frame whatever its characters (quotes, newlines and non-ASCII grow when encoded).  A rank whose
    payload did not fit would raise before the exchange, leaving the others to wait for the timeout."""
    key = "error" if state["error"] else "message"
    size = _FRAME - 8  # a frame less its 8-byte length header (Transport.all_gather_bytes)

    def encode(t):
        return json.dumps(dict(state, rank=rank, sig=sig, call=call, **{key: t})).encode()

    text = state[key] and state[key][:2000]
    payload = encode(text)
    if len(payload) <= size or not text:
        return payload, text
    lo, hi = 0, len(text)  # the longest prefix that fits (cut between characters: the JSON stays valid)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(text[:mid])) <= size:
            lo = mid
        else:
            hi = mid - 1
    return encode(text[:lo]), text[:lo]


def _signature_diffs(gathered: list, what: str, calls: str) -> Optional[str]:
    """A message naming the call numbers or signature fields in which the gathered ranks differ, else None."""
    numbers = [g.get("call") for g in gathered]
    sigs = [g["sig"] or {} for g in gathered]
    diffs = []
    if any(c != numbers[0] for c in numbers):
        diffs.append(f"call number (a rank made an extra or a missing {calls}): " + ", ".join(
            f"rank {g['rank']} {c}" for g, c in zip(gathered, numbers)))
    for field in sigs[0]:
        values = [s.get(field) for s in sigs]
        if any(v != values[0] for v in values):
            diffs.append(f"{field}{_FIELD_HINTS.get(field, '')}: " + ", ".join(
                f"rank {g['rank']} {s.get(field)!r}" for g, s in zip(gathered, sigs)))
    return f"ranks disagree on {what}: " + "; ".join(diffs) if diffs else None


def _merge_knowledge(gathered: list, what: str, calls: str) -> dict:
    """What a rank knows after one stage of raise_disagreement, from the frames of that stage's ranks (in rank order):
    the first rejection among them (its rank and text) with the number of ranks that rejected (the frames' counts
    add up: on a grid each frame of the second stage speaks for its own Ulysses group), or else the first message
    found at an earlier stage, or else the signatures' differences seen here."""
    rejections = [g for g in gathered if g["count"]]
    if rejections:
        first = rejections[0]
        return dict(who=first["who"], error=first["error"], count=sum(g["count"] for g in rejections), message=None)
    earlier = [g["message"] for g in gathered if g["message"]]
    message = earlier[0] if earlier else _signature_diffs(gathered, what, calls)
    return dict(who=None, error=None, count=0, message=message)


def _disagreement_text(state: dict) -> Optional[str]:
    if state["count"]:
        more = state["count"] - 1
        return f"rank {state['who']} rejected its inputs: {state['error']}" + (
            f" (and {more} more rank(s) too)" if more else "")
    return state["message"]


def signature_digest(sig: Optional[dict]) -> int:
    """56 bits of a call's signature (JSON-able), for a cheap first comparison across ranks (0 for none)."""
    if sig is None:
        return 0
    return int.from_bytes(hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).digest()[:7], "little")


def raise_disagreement(stages: list, rank: int, what: str, call: int, sig: Optional[dict],
                       error: Optional[Exception] = None, label: str = LABEL, calls: str = "attention call") -> None:
    """Raises the same error on every rank once a cheap check has found that the ranks' calls differ (every rank
    of ``stages``, Transports in order, must call it): the ranks exchange their full signatures and errors and the
    message names the fields and ranks that differ, or the rank that rejected its inputs and how many did (with that
    rank's own error type when it was a TypeError or ValueError).

    Over a 2-D grid (the Ulysses then the ring group) what each rank knows is passed on from stage to stage, and a
    last exchange over the first stage's group hands every rank the message of that group's first member: those
    members form one group of the second stage, so they agree, and every rank raises the same message."""
    local = None if error is None else f"{type(error).__name__}: {error}"
    state = dict(who=rank, error=local, count=int(local is not None), message=None)
    sent = None
    rounds = list(stages) + ([stages[0]] if len(stages) > 1 else [])
    for index, stage in enumerate(rounds):
        payload, text = _frame(rank, state, sig, call)
        sent = text if sent is None else sent
        frames = stage.all_gather_bytes(payload, f"the signatures of {what} {call}", _FRAME)
        gathered = [json.loads(b) for b in frames]
        if index == len(stages):  # the last exchange: take what the group's first member knows
            first = gathered[0]
            state = {key: first[key] for key in ("who", "error", "count", "message")}
        else:
            state = _merge_knowledge(gathered, f"{what} {call}", calls)
    message = _disagreement_text(state) or f"ranks disagree on {what} {call} (found in another group of the mesh)"
    if local is not None and sent in message and isinstance(error, (TypeError, ValueError)):
        raise type(error)(f"{label}: {message}") from error  # its own error (other ranks' may follow it)
    raise ValueError(f"{label}: {message}") from error
