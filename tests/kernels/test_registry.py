"""fa4dist.kernels.registry: a backend is checked when it registers (its interface, its name), and its answers when
a call picks it, so a malformed one is an error that names it instead of an AttributeError inside every later call."""

import pytest
import torch

from fa4dist.kernels import attention_forward, register_backend, registry
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
