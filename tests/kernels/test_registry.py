"""fa4dist.kernels.registry: a backend is checked when it registers (its interface, its name), and its answers when
a call picks it, so a malformed one is an error that names it instead of an AttributeError inside every later call."""

import pytest
import torch

from fa4dist.kernels import attention_backward, attention_forward, register_backend, registry
from fa4dist.kernels.reference import ReferenceBackend


class _Copy(ReferenceBackend):
    """The reference under another name (a well-formed backend)."""

    def __init__(self, name="test_copy", priority=-1):
        self.name, self.priority = name, priority


@pytest.fixture
def backends(monkeypatch):
    """The registry's table, restored after the test."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    return registry._BACKENDS


def _without(attr):
    backend = _Copy()
    setattr(backend, attr, None)  # an instance attribute hides the method / class attribute
    return backend


@pytest.mark.parametrize("backend, error, match", [
    ("reference", TypeError, "register_backend takes a backend object .* got str"),
    (None, TypeError, "register_backend takes a backend object .* got NoneType"),
    (_Copy(name=""), ValueError, "backend name must be a non-empty string other than 'auto' .*got ''"),
    (_Copy(name=5), TypeError, "backend name must be a string, got int"),
    (_Copy(name="auto"), ValueError, "backend name must be a non-empty string other than 'auto' .*got 'auto'"),
    (_Copy(priority="high"), TypeError, "backend 'test_copy': priority must be an int .*got str"),
    (_Copy(priority=True), TypeError, "backend 'test_copy': priority must be an int .*got bool"),
    (_without("fused_epilogue"), TypeError, "backend 'test_copy': fused_epilogue must be a bool, got NoneType"),
    (_without("available"), TypeError, "backend 'test_copy': available must be a method"),
    (_without("supports"), TypeError, "backend 'test_copy': supports must be a method"),
    (_without("forward"), TypeError, "backend 'test_copy': forward must be a method"),
    (_without("backward"), TypeError, "backend 'test_copy': backward must be a method"),
    (_Copy(name="reference"), ValueError, "'reference' is the registry's fallback"),
])
def test_malformed_backends_are_refused_when_they_register(backends, backend, error, match):
    """Before: register_backend stored anything, and the next "auto" call of every user of the library failed
    inside the registry (an AttributeError on a missing method, a TypeError sorting a str priority)."""
    before = dict(backends)
    with pytest.raises(error, match=match):
        register_backend(backend)
    assert backends == before
    q = torch.randn(1, 4, 2, 8)
    assert attention_forward(q, q, q)[0].shape == q.shape


def test_a_well_formed_backend_registers_and_replaces_its_own_name(backends):
    q = torch.randn(1, 4, 2, 8)
    want = attention_forward(q, q, q, backend="reference")
    for _ in range(2):  # registering the same name again replaces it (a reloaded module)
        register_backend(_Copy())
        got = attention_forward(q, q, q, backend="test_copy")
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    register_backend(backends["reference"])  # the reference itself may register again


class _Answers(_Copy):
    def __init__(self, answer):
        super().__init__(priority=1000)
        self.answer = answer

    def supports(self, problem, direction):
        return self.answer


@pytest.mark.parametrize("answer", ["no", False, 0])
def test_a_supports_answer_that_is_not_none_or_unsupported_is_named(backends, answer):
    """Before: a named call failed with AttributeError ("'str' object has no attribute 'fallback'"), and "auto"
    skipped the backend silently (False, a reason string) as if it had declined."""
    register_backend(_Answers(answer))
    q = torch.randn(1, 4, 2, 8)
    for name in ("test_copy", "auto"):
        with pytest.raises(TypeError, match="backend 'test_copy': supports.. must return None or Unsupported"):
            attention_forward(q, q, q, backend=name)


class _Returns(_Copy):
    """The reference with its forward / backward results changed by ``change(direction, results)``."""

    def __init__(self, change):
        super().__init__()
        self.change = change

    def forward(self, problem, q, k, v):
        return self.change("forward", super().forward(problem, q, k, v))

    def backward(self, problem, dout, q, k, v, out, lse, deterministic, dq_scale=None):
        return self.change("backward", super().backward(problem, dout, q, k, v, out, lse, deterministic, dq_scale))


@pytest.mark.parametrize("direction, change, error, match", [
    # one column of lse broadcast into every row of the lse= buffer, silently
    ("forward", lambda r: (r[0], r[1][..., :1]), ValueError, r"forward returned lse of shape \(1, 4, 1\) on cpu, "
                                                             r"expected \(1, 4, 8\)"),
    ("forward", lambda r: None, TypeError, r"forward must return \(out, lse\), got NoneType"),  # was: cannot unpack
    # one key/value head's gradient added into both heads of the dk, dv buffers, silently
    ("backward", lambda r: (r[0], r[1][:, :, :1], r[2][:, :, :1]), ValueError,
     r"backward returned dk of shape \(1, 8, 1, 8\) on cpu, expected \(1, 8, 2, 8\)"),
    ("backward", lambda r: r[:2], TypeError, r"backward must return \(dq, dk, dv\), got 2 results"),  # dv dropped
])
def test_a_backends_results_of_the_wrong_shape_or_count_are_named(backends, direction, change, error, match):
    """The contract copies, adds or merges a backend's fresh results into the caller's buffers: a result of a shape
    that broadcasts into them was taken silently (lse= and dk= / dv= above: wrong values, no error), a missing one
    was dropped by the zip of (dq, dk, dv), and None failed with 'cannot unpack non-iterable NoneType object'.
    Now each is an error naming the backend, the result and the shape expected, before any buffer is written."""
    register_backend(_Returns(lambda d, r: change(r) if d == direction else r))
    q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
    out, lse = attention_forward(q, k, k, backend="reference")
    buffers = [torch.zeros_like(out), torch.zeros_like(lse), torch.zeros_like(k), torch.zeros_like(k)]
    with pytest.raises(error, match=f"backend 'test_copy': {match}"):
        if direction == "forward":
            attention_forward(q, k, k, out=buffers[0], lse=buffers[1], backend="test_copy")
        else:
            attention_backward(out, q, k, k, out, lse, dq=buffers[0], dk=buffers[2], dv=buffers[3], accumulate=True,
                               backend="test_copy")
    assert not any(b.any() for b in buffers)
