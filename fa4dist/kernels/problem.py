"""Validation of attention inputs: the one place where shapes, dtypes, devices and packed-sequence metadata are
checked and described.

Every backend and every context-parallel strategy receives an :class:`AttentionProblem` built here, so they never
re-derive sizes or re-check arguments themselves.
"""

from __future__ import annotations

import math
import numbers
import sys
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from .mask import OFFSET_LIMIT, Mask, check_window, is_int  # noqa: F401  (re-exported: the contract's checks)

Offset = Union[int, Sequence[int], torch.Tensor]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def lse_shape_of(q_shape: Sequence[int]) -> tuple[int, ...]:
    """The lse's shape for queries (or an out) of ``q_shape``: packed ``(total_q, heads, d)`` -> ``(heads, total_q)``,
    else ``(batch, seqlen_q, heads, d)`` -> ``(batch, heads, seqlen_q)``."""
    if len(q_shape) == 3:
        return (q_shape[1], q_shape[0])
    return (q_shape[0], q_shape[2], q_shape[1])


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The contract's accumulation dtype for inputs of ``dtype``: fp64 for fp64, else fp32 (lse, a running out,
    fp32 gradient buffers, and the sums the reference and the cp engines form)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class AttentionProblem:
    """Sizes and mask description of one attention call (forward or backward).

    Dense layout: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k, heads_kv, head_dim[_v]).
    Packed layout: q (total_q, heads_q, head_dim) and k/v (total_k, heads_kv, ...), with segment ``b`` of q
    attending to segment ``b`` of k (``cu_seqlens_*``).  ``q_offsets``/``k_offsets`` hold the global position of
    each sequence's (or segment's) first query/key, one entry per batch element or segment.  ``mask`` (causal and
    sliding window, canonical), ``softcap`` and ``has_sinks`` are the score options every backend either computes
    or refuses (sinks are merged by the contract, see :mod:`fa4dist.kernels.merge`).
    """

    batch: int  # number of sequences (dense) or segments (packed)
    seqlen_q: int  # dense: sequence length; packed: longest segment
    seqlen_k: int
    total_q: int  # number of query tokens in all sequences together
    total_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    mask: Mask  # causal and sliding window, canonical (see fa4dist.kernels.mask)
    softmax_scale: float
    q_offsets: tuple[int, ...]
    k_offsets: tuple[int, ...]
    cu_seqlens_q: Optional[tuple[int, ...]] = None  # host copies; None for the dense layout
    cu_seqlens_k: Optional[tuple[int, ...]] = None
    # cp_invariant numerics (fa4dist.kernels.invariant): a row's (a key's) result may depend on nothing but its
    # own operands; only backends that guarantee that take such a call.
    cp_invariant: bool = False
    softcap: Optional[float] = None  # scores are softcap * tanh(scale * q.k / softcap)
    has_sinks: bool = False  # a learnable logit per query head joins every row's softmax (merged by the contract)
    # The caller's cu_seqlens tensors (device tensors for fused kernels); None for the dense layout.
    cu_seqlens_q_tensor: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    cu_seqlens_k_tensor: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def window(self) -> tuple[int, int]:
        return self.mask.window

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def uniform_offsets(self) -> bool:
        return len(set(self.q_offsets)) <= 1 and len(set(self.k_offsets)) <= 1

    def out_shape(self) -> tuple[int, ...]:
        if self.varlen:
            return (self.total_q, self.heads_q, self.head_dim_v)
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    def lse_shape(self) -> tuple[int, ...]:
        return lse_shape_of(self.out_shape())

    def device_cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens_q, cu_seqlens_k) as fused kernels read them: contiguous int32 on the inputs' device (the
        caller's tensors when they already are; a CPU or strided one is copied, never read in place)."""
        return tuple(t.to(self.device).contiguous() for t in (self.cu_seqlens_q_tensor, self.cu_seqlens_k_tensor))

    def segments(self):
        """Yields (index, q_start, q_len, k_start, k_len, q_offset, k_offset) per sequence/segment.

        For the dense layout the starts index the batch dimension's sequences (q_start = b)."""
        for b in range(self.batch):
            if self.varlen:
                qs, qe = self.cu_seqlens_q[b], self.cu_seqlens_q[b + 1]
                ks, ke = self.cu_seqlens_k[b], self.cu_seqlens_k[b + 1]
                yield b, qs, qe - qs, ks, ke - ks, self.q_offsets[b], self.k_offsets[b]
            else:
                yield b, b, self.seqlen_q, b, self.seqlen_k, self.q_offsets[b], self.k_offsets[b]


# ---------------------------------------------------------------------------------------------------------------
# argument checks


def check_strided(name: str, t: torch.Tensor) -> None:
    """A tensor with strided memory: a sparse, nested or MKL-DNN one has none for the kernels (or the memory checks)
    to read, and failed deep inside, naming nothing."""
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout)
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} one (packed variable-length "
                        "sequences are a (total_tokens, heads, head_dim) tensor with cu_seqlens_q / cu_seqlens_k)")


def _check_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    return t


# Host copies of cu_seqlens tensors: (id, data_ptr, version, numel, dtype) -> (weak reference to the tensor, its
# values, the token counts they were checked against, a CPU tensor's copy); see _host_cu_seqlens.
_CU_SEQLENS_CACHE: dict = {}
# int32_cu_seqlens' results: the key of the source tensor and the device -> (weak reference to the source, the int32
# tensor (None: the source itself) and its version, the values, a CPU source's copy).  A few entries: the q and k
# tensors of a forward pass or two, which every layer converts.
_INT32_CACHE: dict = {}
_INT32_CACHE_SIZE = 4


def _version_key(cu: torch.Tensor) -> Optional[tuple]:
    """A tensor's identity and version, or None for one made under ``torch.inference_mode`` (it has no version
    counter: its values can change unseen).  A key alone can outlive its tensor: a new tensor may get a freed
    one's id and address, so the caches also keep a weak reference and compare it."""
    if cu.is_inference():
        return None
    return id(cu), cu.data_ptr(), cu._version, cu.numel(), cu.dtype


def _snapshot(cu: torch.Tensor) -> Optional[torch.Tensor]:
    """A copy of a CPU tensor's values, to compare it with later; None for a device tensor.  The version counter
    misses some writes (through a NumPy array sharing the memory, ``.data``, collectives such as
    ``dist.broadcast``): a CPU buffer refilled so would keep its old documents.  Comparing a CPU tensor costs about
    a microsecond; a device tensor's comparison would be a device sync, which the cache is there to avoid (so a
    device buffer must be refilled where torch counts it, or be a new tensor)."""
    return cu.clone() if cu.device.type == "cpu" else None


def _unchanged(cu: torch.Tensor, snapshot: Optional[torch.Tensor]) -> bool:
    return snapshot is None or torch.equal(cu, snapshot)


def _remember_values(cu: torch.Tensor, values: tuple[int, ...]) -> tuple:
    """Caches the host values of ``cu`` (just read, or known from the tensor it was converted from)."""
    entry = (weakref.ref(cu), values, set(), _snapshot(cu))
    key = _version_key(cu)
    if key is not None:
        if len(_CU_SEQLENS_CACHE) > 256:
            _CU_SEQLENS_CACHE.clear()
        _CU_SEQLENS_CACHE[key] = entry
    return entry


def check_integer_dtype(name: str, t: torch.Tensor) -> None:
    """Refuses a tensor that does not hold integers (a conversion would truncate floats and read bools as 0/1)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")


_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def comparable_integers(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor as torch's comparisons and reductions take it: uint16/uint32/uint64 (uint16 is the usual
    on-disk token format; torch's CPU kernels of <, aminmax, ... lack these dtypes) as int64, others as they are.
    uint64 values of 2^63 and up come out negative: a range check still refuses them."""
    return t.long() if t.dtype in _WIDE_UNSIGNED else t


def _check_cu_seqlens_layout(name: str, cu, narrowing: bool = False) -> None:
    """cu_seqlens' type and shape (no values read); ``narrowing``: any integer dtype, to be converted to int32."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an {'integer' if narrowing else 'int32'} torch.Tensor, got "
                        f"{type(cu).__name__}")
    check_strided(name, cu)
    if narrowing:
        check_integer_dtype(name, cu)
    elif cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (batch + 1), got shape {tuple(cu.shape)}")
    if cu.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values: the sequence boundaries must be read "
                         "(pass a cpu or cuda tensor)")


INT32_MAX = 2**31 - 1


def int32_cu_seqlens(name: str, cu, device=None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """cu_seqlens given in any integer dtype (transformers' collators make int32 or int64; the kernels read int32)
    as an int32 tensor on ``device`` (``cu`` itself when it already is one), with its values, read to the host once
    (one device sync for a device tensor).  A non-integer dtype is refused, and so is a value outside
    [0, 2**31 - 1], before the narrowing conversion would truncate or wrap it silently.  The other checks of the
    values (from 0, non-decreasing, the token count) are :func:`validate_inputs`' on the int32 tensor.

    The result is remembered per source tensor, version and device, so the layers of a model that all convert the
    same tensor share one int32 tensor and one read (and :func:`validate_inputs` reads the int32 tensor's values
    from here, not from the device); an in-place change of the source makes it read again."""
    _check_cu_seqlens_layout(name, cu, narrowing=True)
    device = cu.device if device is None else torch.device(device)
    key = _version_key(cu)
    key = None if key is None else key + (device,)
    hit = _INT32_CACHE.get(key) if key is not None else None
    if hit is not None and hit[0]() is cu and (hit[1] is None or hit[1]._version == hit[2]) and \
            _unchanged(cu, hit[4]):
        return (cu if hit[1] is None else hit[1]), hit[3]
    values = tuple(int(x) for x in cu.tolist())
    outside = [x for x in values if not 0 <= x <= INT32_MAX]
    if outside:
        raise ValueError(f"{name} must hold token counts in [0, 2**31 - 1] (the kernels read int32), got "
                         f"{outside[0]}")
    out = cu.to(device=device, dtype=torch.int32)
    if key is not None:
        while len(_INT32_CACHE) >= _INT32_CACHE_SIZE:
            _INT32_CACHE.pop(next(iter(_INT32_CACHE)))
        # the entry goes with the source tensor (the int32 copy, perhaps on a GPU, does not outlive it)
        source = weakref.ref(cu, lambda _, key=key: _INT32_CACHE.pop(key, None))
        _INT32_CACHE[key] = (source, None if out is cu else out, out._version, values, _snapshot(cu))
        _remember_values(out, values)  # the kernels' check of the int32 tensor reads no values again
    return out, values


def check_cu_seqlens_values(name: str, values: Sequence[int]) -> None:
    """Document boundaries (host values): from 0, non-decreasing."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {list(values)[:16]}")


def cu_seqlens_values(name: str, cu) -> tuple[int, ...]:
    """The values of a cu_seqlens tensor of any integer dtype, read to the host (one device sync for a device
    tensor) and checked: 1-D, at least 2 entries, from 0, non-decreasing."""
    _check_cu_seqlens_layout(name, cu, narrowing=True)
    values = tuple(int(x) for x in cu.tolist())
    check_cu_seqlens_values(name, values)
    return values


def _host_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> tuple[int, ...]:
    """Checks a cu_seqlens tensor and returns its host copy.

    The check of a device tensor needs one copy to the host; it is remembered per (tensor, version) so a caller
    that reuses the same cu_seqlens tensor every step (a ring, a training loop) pays it once.  The entry holds a
    weak reference to the tensor: a new tensor that happens to get a freed one's id and address is not it.  A
    tensor made under ``torch.inference_mode`` has no version counter (its values can change unseen): it is read
    every time; a CPU tensor is compared with the remembered copy (:func:`_snapshot`: some writes bump no version).
    The values of an int32 tensor made by :func:`int32_cu_seqlens` are known without a read."""
    _check_cu_seqlens_layout(name, cu)
    key = _version_key(cu)
    entry = _CU_SEQLENS_CACHE.get(key) if key is not None else None
    if entry is None or entry[0]() is not cu or not _unchanged(cu, entry[3]):
        entry = _remember_values(cu, tuple(int(x) for x in cu.tolist()))
    values, checked = entry[1], entry[2]
    if total in checked:
        return values
    check_cu_seqlens_values(name, values)
    if values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} disagrees with the token count {total} of the packed tensor")
    checked.add(total)
    return values


def _offsets(name: str, value: Offset, count: int) -> tuple[int, ...]:
    one = is_int(value)  # one offset for the batch (the usual call): checked once, not once per sequence
    values = _offset_values(name, value, 1 if one else count)
    for x in values:
        if not -OFFSET_LIMIT <= x < OFFSET_LIMIT:
            raise ValueError(f"{name} must be a token position in [-2**62, 2**62), got {x}")
    return values * count if one else values


def _offset_values(name: str, value: Offset, count: int) -> tuple[int, ...]:
    if is_int(value):
        return (int(value),) * count
    if isinstance(value, torch.Tensor):
        check_integer_dtype(name, value)
        if value.is_meta:
            raise ValueError(f"{name} is on the meta device, which holds no values (pass a cpu or cuda tensor)")
        if value.dim() == 0:
            return (int(value),) * count
        if value.dim() != 1:
            raise ValueError(f"{name} must be 0-D or 1-D (one entry per sequence/segment), got shape "
                             f"{tuple(value.shape)}")
        values = tuple(int(x) for x in value.tolist())
    elif is_ndarray(value):  # as a tensor, as NumPy integers are taken as ints
        check_integer_ndarray(name, value)
        if value.ndim == 0:
            return (int(value),) * count
        if value.ndim != 1:
            raise ValueError(f"{name} must be 0-D or 1-D (one entry per sequence/segment), got shape {value.shape}")
        values = tuple(int(x) for x in value.tolist())
    elif isinstance(value, (list, tuple)):
        if not all(is_int(x) for x in value):
            raise TypeError(f"{name} must hold ints, got {value!r}")
        values = tuple(int(x) for x in value)
    else:
        raise TypeError(f"{name} must be an int or a sequence / tensor / NumPy array of ints, got {type_name(value)}")
    if len(values) != count:
        raise ValueError(f"{name} must have one entry per sequence/segment ({count}), got {len(values)}")
    return values


def is_ndarray(x) -> bool:
    """Whether x is a NumPy array (without importing NumPy: not imported, x is none)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def check_integer_ndarray(name: str, a) -> None:
    """A NumPy array taken as integer values (as a tensor is): an integer dtype, not a masked array."""
    if sys.modules["numpy"].ma.isMaskedArray(a):
        raise TypeError(f"{name} must be a plain integer array, got a NumPy masked array (its masked entries have no "
                        "value)")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got NumPy dtype {a.dtype}")


def _is_real(value) -> bool:
    """A real number scalar that is not a bool: int, float, and numbers.Real types alike (numpy's float32 and ints,
    fractions), never numpy's bool (not a numbers.Real) nor a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_float(value) -> float:
    """float(value) of a real number; +-inf for an int past the float range (float() would raise OverflowError),
    so that the caller's finiteness check names the argument."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _finite(x) -> bool:
    """math.isfinite(x) written with comparisons, which torch.compile can trace on a symbolic float (it hands a
    float argument whose value changed between calls over as a SymFloat; math.isfinite breaks its graph)."""
    return x == x and -math.inf < x < math.inf


def _shown(value, as_float: float):
    """The value for an error message: as given, unless an int too large to print usefully."""
    if isinstance(value, numbers.Integral) and not math.isfinite(as_float):
        return f"an int of {len(str(abs(int(value))))} digits"
    return value


# The scores of float16 / bfloat16 / float32 inputs are computed in float32 (the reference and the kernels alike):
# a scale or a cap outside float32's normal range becomes inf or 0 (or a denormal, flushed on the GPU) there, and
# scores inf * 0, inf - inf or 0 / 0 = NaN.
_FP32_NORMAL = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def _check_fp32_range(name: str, value, as_float: float, dtype: Optional[torch.dtype], signed: bool) -> None:
    """``value`` (a finite, non-zero float ``as_float``) within float32's normal range, in magnitude where it may be
    ``signed``, for inputs of ``dtype`` (None: not known yet; float64 inputs are computed in float64)."""
    if dtype is None or dtype == torch.float64 or _FP32_NORMAL[0] <= abs(as_float) <= _FP32_NORMAL[1]:
        return
    raise ValueError(f"{name} must be within float32's range{' in magnitude' if signed else ''} "
                     f"[{_FP32_NORMAL[0]:.3g}, {_FP32_NORMAL[1]:.3g}] for {dtype} inputs (their scores are computed "
                     f"in float32), got {_shown(value, as_float)}")


def check_softmax_scale(softmax_scale, head_dim: int, dtype: Optional[torch.dtype] = None) -> float:
    """``softmax_scale``: None (1 / sqrt(head_dim)) or a finite, non-zero float; with the inputs' ``dtype`` (not
    float64), also within float32's normal range in magnitude, in which their scores are computed."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    scale = _as_float(softmax_scale)
    if not _finite(scale) or scale == 0.0:
        raise ValueError(f"softmax_scale must be finite and non-zero, got {_shown(softmax_scale, scale)}")
    _check_fp32_range("softmax_scale", softmax_scale, scale, dtype, signed=True)
    return scale


# What torch.compile prints where it meets an entry point excluded from tracing (with fullgraph=True it stops there;
# without, the call runs eagerly behind one graph break). torch_ops.py says which calls trace as ops.
EAGER_ONLY = ("fa4dist runs this call eagerly, outside the compiled graph (one graph break, so fullgraph=True cannot "
              "include it); fa4dist/kernels/torch_ops.py lists the calls that trace as ops")


def type_name(value) -> str:
    """The name of value's type for an error message, with its module where it is not a builtin (numpy's bool
    calls itself "bool")."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_optional_bool(name: str, value) -> Optional[bool]:
    """A mode flag: True, False or None (the default that follows a global setting), never a truthy stand-in."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type_name(value)}")
    return value


def check_bool(name: str, value) -> bool:
    """A flag: True or False, never a truthy stand-in ("False" is a non-empty string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)}")
    return value


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
    """A count or an index: an integer (a Python int, or NumPy's; not a bool, a float or a tensor) of at least
    ``minimum``, returned as a Python int."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value



SEED_RANGE = (-2**63, 2**64)  # what torch.manual_seed and a Generator's manual_seed take


def check_seed(name: str, value) -> int:
    """A random seed: an int in torch's range, returned as a Python int (past it manual_seed raised "Overflow when
    unpacking long long", naming nothing)."""
    value = check_int(name, value)
    if not SEED_RANGE[0] <= value < SEED_RANGE[1]:
        raise ValueError(f"{name} must be in [-2**63, 2**64) (torch's seeds), got {value}")
    return value

def check_timeout(timeout, name: str = "timeout") -> float:
    """A wait's limit: a positive, finite number of seconds (a bool, NaN, 0 or a negative one is refused)."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {timeout!r}")
    return float(timeout)


def check_mask(causal, window) -> Mask:
    """The canonical :class:`~fa4dist.kernels.mask.Mask` of ``causal`` and ``window``, or a clear error."""
    check_bool("causal", causal)
    # (Mask checks the window as given: no separate check_window pass, which cost host time on every call)
    return Mask.canonical(causal, (-1, -1) if window is None else window)


def check_softcap(softcap, dtype: Optional[torch.dtype] = None, name: str = "softcap") -> Optional[float]:
    """``softcap`` (the argument ``name``): None (no capping) or a finite float > 0; with the inputs' ``dtype`` (not
    float64), also within float32's normal range, in which their scores are computed."""
    if softcap is None:
        return None
    if not _is_real(softcap):
        raise TypeError(f"{name} must be a float > 0 or None, got {type(softcap).__name__}")
    cap = _as_float(softcap)
    if not (_finite(cap) and cap > 0):
        raise ValueError(f"{name} must be finite and > 0, or None for no capping (flash-attn's 0.0 is None here), "
                         f"got {_shown(softcap, cap)}")
    _check_fp32_range(name, softcap, cap, dtype, signed=False)
    return cap


def check_sinks(sinks, heads_q: int, device: torch.device) -> bool:
    """``sinks``: None or a float tensor (heads_q,) on the inputs' device, one logit per query head."""
    if sinks is None:
        return False
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape ({heads_q},) or None, got {type(sinks).__name__}")
    check_strided("sinks", sinks)
    if sinks.dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must be float16, bfloat16, float32 or float64, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},): one logit per query head, got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on the inputs' device {device}, got {sinks.device}")
    return True


def check_layout(q, k, v, *, causal=False, window=(-1, -1), softcap=None, sinks=None, softmax_scale=None,
                 cu_seqlens_q=None, cu_seqlens_k=None):
    """The checks of :func:`validate_inputs` that read no tensor's values (types, dtypes, devices, shapes, the
    mask options): (mask, softcap, softmax_scale, has_sinks). torch.compile's trace runs them on fake tensors."""
    q, k, v = (_check_tensor(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    mask = check_mask(causal, window)
    softcap = check_softcap(softcap, q.dtype)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (packed layout) or not at all")
    varlen = cu_seqlens_q is not None
    ndim = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
        if t.shape[-1] == 0 or t.shape[-2] == 0:
            raise ValueError(f"{name} must have at least one head and a non-empty head dim, got {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree on all but the head dim, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got q {q.shape[-1]}, k {k.shape[-1]}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"the number of query heads ({heads_q}) must be a multiple of the number of key/value heads ({heads_kv})"
        )
    scale = check_softmax_scale(softmax_scale, q.shape[-1], q.dtype)
    has_sinks = check_sinks(sinks, heads_q, q.device)
    if varlen:
        _check_cu_seqlens_layout("cu_seqlens_q", cu_seqlens_q)
        _check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k)
    elif q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must share the batch size, got {q.shape[0]} and {k.shape[0]}")
    return mask, softcap, scale, has_sinks


def require_values(problem: AttentionProblem) -> None:
    """A call that computes needs tensors with values: meta tensors describe a problem (backends' ``supports``
    queries take them) but cannot be computed on (the reference's non-finite checks would fail deep inside)."""
    if problem.device.type == "meta":
        raise ValueError("q, k and v are on the meta device, which holds no values: attention runs on cpu or cuda "
                         "tensors (torch.compile traces fa4dist with fake tensors of those devices)")


def validate_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window=(-1, -1),
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    q_offset: Offset = 0,
    k_offset: Offset = 0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    cp_invariant: bool = False,
) -> AttentionProblem:
    """Checks q, k, v and the mask arguments; returns the problem description or raises a clear error."""
    mask, softcap, scale, has_sinks = check_layout(q, k, v, causal=causal, window=window, softcap=softcap,
                                                   sinks=sinks, softmax_scale=softmax_scale,
                                                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    varlen = cu_seqlens_q is not None
    if varlen:
        cq = _host_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        ck = _host_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        if len(cq) != len(ck):
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length (segments + 1), got {len(cq)} and {len(ck)}"
            )
        batch = len(cq) - 1
        seqlen_q = max(b - a for a, b in zip(cq, cq[1:]))
        seqlen_k = max(b - a for a, b in zip(ck, ck[1:]))
        total_q, total_k = q.shape[0], k.shape[0]
    else:
        cq = ck = None
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        total_q, total_k = batch * seqlen_q, batch * seqlen_k
    return AttentionProblem(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        total_q=total_q,
        total_k=total_k,
        heads_q=q.shape[-2],
        heads_kv=k.shape[-2],
        head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        dtype=q.dtype,
        device=q.device,
        mask=mask,
        softmax_scale=scale,
        q_offsets=_offsets("q_offset", q_offset, batch),
        k_offsets=_offsets("k_offset", k_offset, batch),
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        cu_seqlens_q_tensor=cu_seqlens_q,
        cu_seqlens_k_tensor=cu_seqlens_k,
        cp_invariant=check_bool("cp_invariant", cp_invariant),
        softcap=softcap,
        has_sinks=has_sinks,
    )


def check_buffer(
    name: str,
    t: Optional[torch.Tensor],
    shape: tuple[int, ...],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """Checks a caller-provided output or input buffer (out, lse, dout, dq, ...)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(dict.fromkeys(str(d) for d in dtypes))
        raise TypeError(f"{name} must have dtype {allowed}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


# ---------------------------------------------------------------------------------------------------------------
# memory of the buffers a call writes


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte address of t's elements (torch strides are non-negative)."""
    first = t.data_ptr()
    if t.is_contiguous():
        return first, first + t.nbytes
    return first, first + t.element_size() * (1 + sum(st * (n - 1) for st, n in zip(t.stride(), t.shape)))


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its byte span (then two spans that intersect share an element)."""
    first, end = _byte_span(t)
    return end - first == t.numel() * t.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some byte of an element of ``a`` is a byte of an element of ``b``: exact (interleaved views of one
    buffer that share no element do not), and cheap unless they are strided views whose byte ranges intersect
    (two tensors of one device whose byte ranges intersect share an allocation)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if _dense(a) and _dense(b):  # each is every byte of its span, and the spans intersect
        return True
    # strided views (interleaved slices of one buffer, say): mark a's bytes on a scratch of the spans, look at b's
    base, end = min(a0, b0), max(a1, b1)
    marks = torch.zeros(end - base, dtype=torch.uint8, device=a.device)

    def bytes_of(t):
        size = t.element_size()
        return marks.as_strided(tuple(t.shape) + (size,), tuple(st * size for st in t.stride()) + (1,),
                                t.data_ptr() - base)

    bytes_of(a).fill_(1)
    return bool(bytes_of(b).any())


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded view's stride of 0, or non-zero strides that map
    several indices to one address, as ``as_strided`` can make).  O(dims) for every layout whose strides nest (each
    larger than the span of the smaller ones: contiguous tensors, slices, transposes, permutations); an exact count
    of the distinct offsets only for the others."""
    if t.is_contiguous() or t.numel() <= 1:
        return False
    reach = 0  # the largest offset the smaller strides reach
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach or stride == 0:
            break
        reach += stride * (size - 1)
    else:
        return False
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, size in zip(t.stride(), t.shape):
        offsets = (offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride).flatten()
    return offsets.unique().numel() != t.numel()


def check_written(written: dict, read: dict) -> None:
    """The buffers a call writes (``name -> tensor or None``) against themselves, each other and the tensors it
    reads: a written element must have memory of its own, and nothing the call reads or writes elsewhere may
    share it (an out over v would overwrite values other rows still read: a fused kernel races on them, a work
    list's later items read what the earlier ones wrote)."""
    given = [(n, t) for n, t in written.items() if isinstance(t, torch.Tensor)]
    for name, t in given:
        # torch refuses these writes only when they happen, after the call wrote the buffers before them; and a
        # fused kernel's writes are invisible to autograd where the reference's in-place ops are recorded
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but the call writes it in place, outside autograd: pass a "
                             f"buffer that does not (.detach()), or call under torch.no_grad() (fa4dist.attention "
                             "is the differentiable form)")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{name} is an inference tensor (made under torch.inference_mode()), which torch "
                             "writes in place only inside inference mode: pass a normal tensor, or call inside it")
        if overlaps_itself(t):
            how = "a stride of 0: an expanded or broadcast tensor" if any(
                st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)) else "strides that overlap"
            raise ValueError(f"{name} is written by the call, but some of its elements share memory ({how}, shape "
                             f"{tuple(t.shape)}, stride {t.stride()}); pass a buffer with memory of its own per "
                             f"element (.clone())")
    if not given:
        return
    # one byte range per tensor: a pair whose ranges are apart (the usual case) costs two comparisons
    given = [(n, t, _byte_span(t)) for n, t in given]
    others = [(n, t, _byte_span(t)) for n, t in read.items() if isinstance(t, torch.Tensor)]
    for i, (name, t, (t0, t1)) in enumerate(given):
        for other, u, (u0, u1) in given[:i] + others:
            if t0 < u1 and u0 < t1 and shares_memory(t, u):
                raise ValueError(f"{name} shares memory with {other}: a buffer the call writes must not overlap "
                                 f"its inputs or another written buffer (pass {name}= of its own memory)")
