"""Backends for the work-list and ring tests on the CPU, each the reference with one trait of a GPU backend: a shared
query side (as cute's, :class:`Sharing`), no ``lse_gradient`` (as sdpa's, :class:`TwoPass`: the
contract adds the lse's gradient through a second backward of each call) or a ``backward_items`` of its own (as
cute's launches, :class:`Listing`).  The caller registers them."""

from __future__ import annotations

import torch

from fa4dist.kernels.problem import accum_dtype
from fa4dist.kernels.worklist import attention_backward_items
from fa4dist.kernels.reference import ReferenceBackend


class SharedRows:
    """A shared query side: the dQ of the items it takes (rows starting on a multiple of 4) goes into one scratch of
    the queries' shape, added into the lists' dq at finish; ``dlse``: the lse's gradient its rows' calls take (as
    cute's preprocess takes it once for all launches); ``taken``: how many calls it served."""

    def __init__(self, q, dlse=None):
        self.scratch = torch.zeros(q.shape, dtype=accum_dtype(q.dtype))
        self.dlse = dlse
        self.taken = 0

    def takes(self, q_start, q_len):
        return q_len > 0 and q_start % 4 == 0

    def finish(self, dq):
        return dq.add_(self.scratch)


class Sharing(ReferenceBackend):
    """The reference with a shared query side; ``made``: the sides it made, in order."""

    name = "test_sharing"

    def __init__(self):
        self.made = []

    def shared_rows(self, dout, q, out, lse, *, softmax_scale, deterministic, dlse=None):
        self.made.append(SharedRows(q, dlse))
        return self.made[-1]

    def backward(self, problem, dout, q, k, v, out, lse, deterministic, dq=None, dk=None, dv=None,
                 accumulate=False, rows=None, q_start=0, dq_scale=None, dlse=None):
        if rows is None:
            return super().backward(problem, dout, q, k, v, out, lse, deterministic, dq_scale, dlse)
        assert dlse is None  # (the shared side has it)
        rows_dlse = None if rows.dlse is None else rows.dlse[..., q_start:q_start + q.shape[1]]
        gq, gk, gv = super().backward(problem, dout, q, k, v, out, lse, deterministic, dlse=rows_dlse)
        rows.scratch[:, q_start:q_start + q.shape[1]] += gq
        rows.taken += 1
        dk.add_(gk)
        dv.add_(gv)


class TwoPass(ReferenceBackend):
    """The reference without ``lse_gradient``: its backward takes no dlse; ``calls``: how many backward passes ran."""

    name = "test_two_pass"
    lse_gradient = False

    def __init__(self):
        self.calls = 0

    def backward(self, problem, dout, q, k, v, out, lse, deterministic, dq_scale=None):
        self.calls += 1
        return super().backward(problem, dout, q, k, v, out, lse, deterministic, dq_scale)


class Listing(ReferenceBackend):
    """The reference with a ``backward_items`` of its own, which runs the list on the reference (as cute runs it in
    launches); ``douts``: the dout each list it ran got."""

    name = "test_listing"

    def __init__(self):
        self.douts = []

    def backward_items(self, dout, q, k, v, out, lse, items, dq, dk, dv, *, softmax_scale, softcap, deterministic,
                       shared=None, fresh_dkv=False, dlse=None):
        assert shared is None  # (it has no shared query side)
        self.douts.append(dout)
        return attention_backward_items(dout, q, k, v, out, lse, items, dq, dk, dv, softmax_scale=softmax_scale,
                                        softcap=softcap, deterministic=deterministic, backend="reference",
                                        fresh_dkv=fresh_dkv, dlse=dlse)

