"""Host side shared by the CuTe DSL forward and backward: one compile cache, ahead-of-time export, fake arguments,
offset tensors and the kernels' own input checks.

A compiled variant is keyed by a frozen config dataclass (plain Python values only) that knows how to build its
kernel object (``cfg.build()``) and the fake arguments that describe its runtime signature (``cfg.fake_args()``).
Everything that touches cutlass is imported lazily, so ``import fa4dist`` works without it.

Environment variables read here (README, "Our Hopper kernels"):

- ``FA4DIST_CUTE_CACHE_DIR``: the folder of the on-disk compile cache (default ``$XDG_CACHE_HOME/fa4dist/cute`` or
  ``~/.cache/fa4dist/cute``); ``0``, ``off``, ``false``, ``no`` or empty turn it off, ``1``, ``on``, ``true`` or
  ``yes`` name the default.  An unwritable folder is logged once, naming the variable (:func:`disk_cache_dir`).
- ``FA4DIST_CUTE_AOT_DIR``: a folder (``~`` expanded, as the cache's) of ahead-of-time objects (:func:`export_aot`)
  loaded before the cache; a variant missing from it compiles on first use, and a path that is not a folder is
  logged once (:func:`aot_dir`).
- ``FA4DIST_CUTE_SMS``: a positive int, at most that many CTAs in the persistent grids (:func:`sm_count`; read once
  per process); anything else raises naming it.  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (MPS's own) scales the SM
  count the same way.
- ``FA4DIST_CUTE_COMPILE_LOG``: development: a file each compile appends its config's repr to (what an AOT folder
  was missing); a file that cannot be appended to raises naming it.
- ``FA4DIST_FWD_OVERRIDE`` / ``FA4DIST_BWD_OVERRIDE`` (read by forward.py / backward.py at import): development
  hooks, ``field=value,...`` of FwdConfig / BwdConfig fields (ints >= 0, finite floats >= 0, booleans as
  1/true/yes/on or 0/false/no/off), :func:`parse_overrides`; an unknown field or a value its field does not take
  raises naming the variable and the field.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import math
import os
import tempfile
import threading

import torch

from ..problem import check_softcap as contract_softcap

INT32_MAX = 2**31 - 1
TORCH_DTYPES = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
AOT_ENV = "FA4DIST_CUTE_AOT_DIR"  # optional folder of ahead-of-time compiled variants (see export_aot)
# the on-disk cache of compiled variants (disk_cache_dir): a folder, or 0 / off / empty to turn it off
CACHE_ENV = "FA4DIST_CUTE_CACHE_DIR"
LOG_ENV = "FA4DIST_CUTE_COMPILE_LOG"  # development: a file that each compile appends its config's repr to


def cutlass_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}[name]


def dtype_name(dtype) -> str:
    return DTYPE_NAMES.get(dtype, dtype)


def aligned(t: torch.Tensor, elems: int | None = None) -> bool:
    """TMA can read/write ``t``: contiguous last dim, 16-byte aligned base and strides (dims of extent 1 aside)."""
    elems = elems or 16 // t.element_size()
    if t.stride(-1) != 1:
        return False
    if any(s % elems for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        return False
    return t.data_ptr() % 16 == 0


def cutlass_importable() -> bool:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:
        return False
    return True


_SM_COUNT: list = []
H100_H200_SMS = 132  # what a compile without a GPU (CI, AOT export on a CPU box) sizes persistent grids for
SMS_ENV = "FA4DIST_CUTE_SMS"


MPS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def sm_count() -> int:
    """The SMs this process's kernels can hold at once: the current CUDA device's streaming multiprocessors
    (without a GPU, the H100 / H200 count), that share of them under an MPS client limit
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), or fewer with FA4DIST_CUTE_SMS=N, which leaves SMs to kernels that run
    alongside ours (communication overlapped with attention). It sizes the persistent grids (the dynamic walk
    tolerates a CTA that waits for a busy SM: it claims fewer tiles; the static walk, a measurement knob, delays
    that CTA's whole share) and bounds the deterministic orders whose waits need CTAs resident together
    (backward.make_configs, check_resident): counting SMs the process cannot use could hang those."""
    if not _SM_COUNT:
        n = H100_H200_SMS
        if torch.cuda.is_available():
            n = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        try:
            share = float(os.environ.get(MPS_ENV, "100"))
        except ValueError:
            share = 100.0  # (not ours to judge: the MPS client reads it)
        if 0 < share < 100:
            n = max(1, int(n * share / 100))
        value = os.environ.get(SMS_ENV, "").strip()
        if value:
            if not (value.isascii() and value.isdigit()) or int(value) < 1:  # ("²".isdigit(), but int() refuses it)
                raise ValueError(f"{SMS_ENV} must be a positive number of SMs, got {value!r}")
            n = min(n, int(value))
        _SM_COUNT.append(int(n))
    return _SM_COUNT[0]


CARVE_ALIGN_WORDS = 4  # carved views start on 16-byte boundaries: the kernels' flat tensors assume 16 (fake_flat)


def carve(device, parts):
    """Flat views into one fresh allocation, one per ``(numel, dtype)`` in ``parts`` (a tuple; None for a part that
    is None), each starting on a 16-byte boundary (torch's allocations start on 512): a call's scratch for the host
    price of one ``torch.empty`` (~7.5 us each on CUDA, bench/RESULTS.md) and one split. Contents uninitialized."""
    total, sizes, where = _carve_layout(parts)
    pieces = torch.empty(total, dtype=torch.float32, device=device).split_with_sizes(sizes)
    return [None if i is None else pieces[i] if dtype == torch.float32 else pieces[i].view(dtype)
            for i, dtype in where]


@functools.lru_cache(maxsize=256)
def _carve_layout(parts) -> tuple:
    """(words, piece sizes, (piece index or None, dtype) per part) of a carve: a call's layout is remembered (a
    short call's host time counts)."""
    sizes, where = [], []
    for part in parts:
        if part is None:
            where.append((None, None))
            continue
        numel, dtype = part
        words, rest = divmod(numel * dtype.itemsize, 4)
        if rest:
            raise ValueError(f"carve takes whole 4-byte words, got {numel} x {dtype}")
        if sizes and sizes[-1] % CARVE_ALIGN_WORDS:  # (a piece of padding before this part, none after the last)
            sizes.append(-sizes[-1] % CARVE_ALIGN_WORDS)
        where.append((len(sizes), dtype))
        sizes.append(words)
    return sum(sizes), sizes, tuple(where)


def tile_counter(needed: bool, device, reusable: bool = False):
    """A zeroed (1,) int32 tile counter for a persistent launch that claims its tiles (tile_scheduler.TileClaims),
    else None: fresh per launch (an allocation and a fill: launches on several streams, or in a CUDA graph, never
    share one), or with ``reusable`` (a kernel whose last claim sets the counter back to 0:
    TileClaims.reset_after_last) the current stream's own counter, which launches in that stream's order hand on at
    zero; a stream being captured gets a fresh one (a graph replays on any stream).  Off CUDA (bench/host_python.py's
    no-op launches on CPU tensors) always a fresh one."""
    if not needed:
        return None
    if reusable and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        stream = torch.cuda.current_stream(device)
        key = (stream.device.index, stream.cuda_stream)
        counter = _STREAM_COUNTERS.get(key)
        if counter is None:
            counter = _STREAM_COUNTERS[key] = _stream_counter(stream)
        return counter
    return torch.zeros(1, dtype=torch.int32, device=device)


# (device index, stream handle) -> that stream's reusable tile counter (tile_counter), never freed
_STREAM_COUNTERS: dict = {}


def _stream_counter(stream):
    """A zeroed (1,) int32 counter for ``stream``, allocated and filled by a helper thread on its own stream:
    torch.compile's CUDA graphs warm up with the calling thread's allocations routed into their pool, and refuse a
    block of the pool that outlives the warm-up (the routing is per thread, so a side stream alone is not enough);
    ``stream`` waits for the fill."""
    made = {}

    def allocate():
        try:
            side = torch.cuda.Stream(stream.device)
            with torch.cuda.stream(side):
                made["counter"] = torch.zeros(1, dtype=torch.int32, device=stream.device)
            made["side"] = side
        except BaseException as err:  # (re-raised on the calling thread, as its cause)
            made["error"] = err

    helper = threading.Thread(target=allocate, name="fa4dist-tile-counter")
    helper.start()
    helper.join()
    if "counter" not in made:
        raise RuntimeError(f"could not allocate the tile counter of stream {stream}") from made.get("error")
    stream.wait_stream(made["side"])
    return made["counter"]


def check_qkv(q, k, v, head_dims, *, cu_seqlens_q=None, cu_seqlens_k=None, what="kernel"):
    """(ok, reason) for the q/k/v properties every CuTe kernel needs (shared by forward and backward).

    The contract (fa4dist.kernels.problem) validated the call already; these are the kernels' own limits."""
    if q.dtype not in TORCH_DTYPES:
        return False, f"dtype {q.dtype} not supported (bf16/fp16 only)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return False, "q, k, v must share a dtype"
    d = q.shape[-1]
    if d not in head_dims:
        return False, f"head dim {d} not supported by the cute sm90 {what} (supported: {head_dims})"
    if k.shape[-1] != d or v.shape[-1] != d:
        return False, "q, k, v head dims must match"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False, "tensors must be on a CUDA device"
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        return False, "heads_q must be a multiple of heads_kv"
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        return False, "cu_seqlens_q and cu_seqlens_k must be given together"
    if q.dim() != (3 if varlen else 4):
        return False, "q must be (b, s, h, d) or packed (t, h, d)"
    for t in (q, k):
        if t.numel() and max(s * n for s, n in zip(t.stride(), t.shape)) >= INT32_MAX:
            return False, "tensor too large for 32-bit indexing"
    return True, ""


def parse_count(s: str) -> int:
    """A size or count override value: an int >= 0 (0: the field's off or default); int() took -128 and "1_0"."""
    value = s.strip()
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"not an int >= 0: {s!r}")
    return int(value)


def parse_threshold(s: str) -> float:
    """A threshold override value: a finite float >= 0 (nan compares false with every value: no threshold at all)."""
    value = float(s)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"not a finite float >= 0: {s!r}")
    return value


def parse_positive(s: str) -> int:
    """A tile size, stage count or CTAs per SM: an int >= 1 (0 has no "off" meaning there; it failed deep in the
    launch)."""
    value = parse_count(s)
    if value < 1:
        raise ValueError(f"not an int >= 1: {s!r}")
    return value


_EXPECTED = {parse_count: "an int >= 0", parse_positive: "an int >= 1", parse_threshold: "a finite float >= 0"}


def parse_overrides(text: str, fields: dict, source: str) -> dict:
    """``"stmatrix_ds=1,tile_m=128"`` -> {field: value}, each value parsed by ``fields[field]``; an unknown name or
    a value its field does not take is an error naming ``source``, the field and the value."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if key not in fields:
            raise ValueError(f"{source}: unknown field {key!r} (known: {sorted(fields)})")
        try:
            out[key] = fields[key](val)
        except ValueError:  # int("abc") named neither the variable nor the field
            expected = _EXPECTED.get(fields[key], "a boolean (1, true, yes, on / 0, false, no, off)")
            raise ValueError(f"{source}: field {key!r} must be {expected}, got {val!r}") from None
    return out


def env_overrides(var: str, fields: dict) -> dict:
    """parse_overrides of environment variable ``var`` (development hook for tests and benches)."""
    return parse_overrides(os.environ.get(var, ""), fields, var)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(s: str) -> bool:
    """A boolean override value; anything else raises (``maybe`` was read as False, silently)."""
    value = s.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"not a boolean: {s!r}")
    return value in _TRUE


# ----------------------------------------------------------------------------
# offsets
# ----------------------------------------------------------------------------

_OFFSET_CACHE: dict = {}


def offsets_tensor(values, device) -> torch.Tensor:
    """int32 device tensor of per-sequence offsets, cached by value (one H2D copy per distinct tuple)."""
    key = (tuple(int(x) for x in values), str(device))
    t = _OFFSET_CACHE.get(key)
    if t is None:
        if len(_OFFSET_CACHE) > 64:
            _OFFSET_CACHE.clear()
        t = torch.tensor(key[0], dtype=torch.int32, device=device)
        _OFFSET_CACHE[key] = t
    return t


def check_window_left(window_left, causal: bool) -> int:
    """The kernels' sliding-window lower edge: -1 (none) or 0 <= window_left < 2^30, with the causal mask (the
    backend folds a window's right edge into the diagonal first)."""
    window_left = int(window_left)
    if window_left < -1 or window_left >= 2**30:
        raise ValueError(f"window_left must be -1 (no window) or in [0, 2^30), got {window_left}")
    if window_left >= 0 and not causal:
        raise ValueError("window_left needs causal=True: the kernels take a window as a band below the diagonal")
    return window_left


def check_softcap(softcap) -> float:
    """0.0 (off) or the positive cap of soft-capped scores: the contract's check (kernels/problem.py), in the
    kernels' form."""
    return contract_softcap(softcap) or 0.0


def score_scale(softmax_scale: float, softcap: float) -> float:
    """The kernels' runtime score scale: softmax_scale * log2(e) for the exponential, or with soft-capping
    softmax_scale / softcap for the tanh (the exponential's c * log2(e) is then compiled in; cute/softmax.py)."""
    if softcap > 0:
        return float(softmax_scale) / softcap
    return float(softmax_scale) * math.log2(math.e)


def score_scale_fits(softmax_scale: float, softcap: float) -> bool:
    """Whether score_scale is a normal float32 number: with soft-capping the ratio softmax_scale / softcap can
    leave float32's range though both are inside it (a kernel would then compute inf * 0 = NaN for a zero score
    where the scores, scaled then capped, are 0), and softmax_scale * log2(e) can pass float32's largest."""
    value = abs(score_scale(softmax_scale, softcap))
    return FLOAT32_TINY <= value <= FLOAT32_MAX


FLOAT32_TINY = 2.0 ** -126
FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127


def is_uniform_offset(x) -> bool:
    return not isinstance(x, (torch.Tensor, list, tuple))


def segment_offsets(x, n: int, device) -> torch.Tensor:
    """One int32 offset per sequence / segment on ``device``: from an int, a sequence, or a tensor (a tensor with
    one element is broadcast; no host synchronisation)."""
    if isinstance(x, torch.Tensor):
        t = x.to(device=device, dtype=torch.int32).reshape(-1)
        if t.numel() == 1 and n != 1:
            t = t.expand(n)
        return t.contiguous()
    if isinstance(x, (list, tuple)):
        return offsets_tensor(x, device)
    return offsets_tensor([int(x)] * n, device)


# ----------------------------------------------------------------------------
# fake arguments (compile without a GPU)
# ----------------------------------------------------------------------------


def fake_tensor(dtype, shape, div):
    """Fake tensor with a contiguous last dim and symbolic outer strides divisible by ``div`` elements."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=16 if div > 1 else 4)


def fake_flat(dtype):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=16)


def fake_i32(n=None):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Int32, (n if n is not None else cute.sym_int(),), stride=(1,), assumed_align=4)


def qkv_shapes(varlen: bool, head_dim: int):
    """Symbolic (q, k, lse) shapes: dense (b, s, h, d) / (b, h, s), or packed (t, h, d) / (h, t)."""
    import cutlass.cute as cute

    h, hk = cute.sym_int(), cute.sym_int()
    if not varlen:
        b, sq, sk = cute.sym_int(), cute.sym_int(), cute.sym_int()
        return (b, sq, h, head_dim), (b, sk, hk, head_dim), (b, h, sq)
    tq, tk = cute.sym_int(), cute.sym_int()
    return (tq, h, head_dim), (tk, hk, head_dim), (h, tq)


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


# ----------------------------------------------------------------------------
# compile cache and ahead-of-time export
# ----------------------------------------------------------------------------

_CACHE: dict = {}
_LOCK = threading.Lock()
_SOURCE_DIGEST = None


def compile_config(cfg, *, tvm_ffi: bool = True, extra_options: str = ""):
    """Compile one variant (works without a GPU when CUTE_DSL_ARCH=sm_90a is set)."""
    import cutlass.cute as cute

    opts = "--enable-tvm-ffi" if tvm_ffi else ""
    if extra_options:
        opts = (opts + " " + extra_options).strip()
    return cute.compile(cfg.build(), *cfg.fake_args(), options=opts)


def _source_digest() -> str:
    """Digest of the kernel sources, so that an AOT object built from other code is never loaded."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.sha1()
        here = os.path.dirname(os.path.abspath(__file__))
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                with open(os.path.join(here, name), "rb") as f:
                    h.update(f.read())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


DEFAULT_ARCH = "sm_90a"  # what the kernels are compiled for unless CUTE_DSL_ARCH says otherwise


def _set_default_arch() -> None:
    """CUTE_DSL_ARCH, set to DEFAULT_ARCH when unset: before a compile (which needs it without a GPU) and before a
    config_key, so that an export and the process that loads it name the same target."""
    os.environ.setdefault("CUTE_DSL_ARCH", DEFAULT_ARCH)


def _target_parts() -> list:
    """What an object file's machine code and calling convention depend on beyond the config and the kernel sources:
    the target architecture and the DSL and TVM-FFI versions."""
    from importlib import metadata

    parts = [os.environ.get("CUTE_DSL_ARCH", "")]
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=?")
    return parts


def config_key(cfg) -> str:
    """Stable file/symbol name of a config: its repr (every static parameter), the kernel sources and the target
    (_target_parts), so that an object built from other code, for another architecture or by another DSL is never
    loaded (an AOT folder made on another machine included)."""
    text = "|".join([repr(cfg), _source_digest()] + _target_parts())
    return "fa4cute_" + hashlib.sha1(text.encode()).hexdigest()[:20]


def _object_digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _write_object(fn, cfg, folder) -> str:
    """Writes the compiled ``fn`` as ``cfg``'s object file in ``folder`` and returns its path: under a temporary
    name, then renamed (a reader never sees part of a file, and an interrupted write leaves none under the final
    name; processes writing the same variant at once each rename a whole file) to ``config_key.<digest of its
    bytes>.o``, which :func:`stored_object` checks before a load."""
    name = config_key(cfg)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".o", dir=folder)  # unique across hosts sharing it
    os.close(fd)
    try:
        fn.export_to_c(tmp, function_name=name)
        os.chmod(tmp, 0o644)  # (mkstemp's 0600 kept a shared cache's entries from its other users)
        path = os.path.join(folder, f"{name}.{_object_digest(tmp)}.o")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return path


def export_aot(cfg, out_dir: str) -> str:
    """Compile ``cfg`` (no GPU needed) and write it as a TVM-FFI object file that get_compiled can load."""
    _set_default_arch()
    return _write_object(compile_config(cfg), cfg, out_dir)


def _sound_objects(folder, cfg):
    """The paths of ``cfg``'s object files in ``folder`` (written by :func:`_write_object`) whose bytes match the
    digest in their names.  A file whose bytes do not (changed after it was written: a bad disk, a copy cut short)
    is logged by name and never loaded: the loader takes such a file as long as its ELF headers hold."""
    name = config_key(cfg)
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), name + ".*.o"))):
        try:
            if _object_digest(path) == path[:-len(".o")].rsplit(".", 1)[1]:
                yield path
                continue
            problem = "its bytes do not match the digest in its name (corrupted)"
        except OSError as exc:
            problem = str(exc)
        logging.getLogger("fa4dist.kernels").warning("cute: refused %s: %s", path, problem)


def stored_object(folder, cfg):
    """The path of a sound object file of ``cfg`` in ``folder`` (:func:`_sound_objects`), or None."""
    return next(_sound_objects(folder, cfg), None)


def _load_object(folder, cfg, what: str):
    """The function of ``cfg`` from a sound object file in ``folder``, or None (none there, or none loads: logged).
    (A file is read twice, checked then loaded: a rename in between puts another whole, sound file there.)"""
    for path in _sound_objects(folder, cfg):
        try:
            import cutlass.cute as cute

            return getattr(cute.runtime.load_module(path, enable_tvm_ffi=True), config_key(cfg))
        except Exception as exc:  # the next one, or compile
            logging.getLogger("fa4dist.kernels").warning("cute: %s load of %s failed (%s)", what, path, exc)
    return None


def _toolchain_digest() -> str:
    """The disk cache's sub-folder: the target (_target_parts, in config_key too) and the Python version, so that
    one toolchain's entries can be removed together."""
    import sys

    return hashlib.sha1("|".join(_target_parts() + [sys.version.split()[0]]).encode()).hexdigest()[:16]


def disk_cache_dir():
    """Where compiled variants are kept between processes: FA4DIST_CUTE_CACHE_DIR (0 / off / false / no / empty:
    no disk cache; 1 / on / true / yes: the default folder; else a path, ``~`` expanded, relative to the working
    directory), by default $XDG_CACHE_HOME/fa4dist/cute or ~/.cache/fa4dist/cute; one sub-folder per toolchain
    (_toolchain_digest), and file names carry config_key, so an object of other kernel sources, another DSL or
    another architecture is never loaded. None when turned off."""
    env = os.environ.get(CACHE_ENV)
    value = (env or "").strip()
    if env is not None and value.lower() in _FALSE + ("",):
        return None
    if env is None or value.lower() in _TRUE:  # (=1 made a folder named "1" in the working directory)
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "fa4dist", "cute")
    else:
        root = _env_path(value)
    return os.path.join(root, _toolchain_digest())


def _env_path(value: str) -> str:
    """A folder named by an environment variable: spaces around it dropped, ``~`` expanded (no shell expands one
    that is quoted, or set in an env file or a launcher's env=: it was a folder named "~"), absolute."""
    return os.path.abspath(os.path.expanduser(value.strip()))


_DISK_CACHE_WARNED: list = []


def _store_on_disk(fn, cfg, folder) -> None:
    """Write ``fn`` (just compiled) to the disk cache (_write_object: atomic). A failure costs only the next
    process's compile: logged once per process, never raised."""
    try:
        _write_object(fn, cfg, folder)
    except Exception as exc:
        if not _DISK_CACHE_WARNED:
            _DISK_CACHE_WARNED.append(True)
            logging.getLogger("fa4dist.kernels").warning(
                "cute: could not write the compile cache in %s (%s); set %s to another folder, or to 0 to turn it "
                "off", folder, exc, CACHE_ENV)


_AOT_WARNED: list = []


def aot_dir():
    """The folder of ahead-of-time objects (FA4DIST_CUTE_AOT_DIR), or None when unset, empty or not a folder.  A
    path that is not a folder is logged once per process, naming the variable (a mistyped one was ignored
    silently, every variant then compiled on first use), not raised: the GPU session scripts set it before their
    AOT stage fills it, and a variant missing from it compiles anyway."""
    folder = os.environ.get(AOT_ENV, "")
    if not folder.strip():
        return None
    folder = _env_path(folder)
    if not os.path.isdir(folder):
        if not _AOT_WARNED:
            _AOT_WARNED.append(True)
            logging.getLogger("fa4dist.kernels").warning(
                "cute: %s=%r is not a folder: no ahead-of-time objects are loaded, every variant compiles on first "
                "use (3-6 s each)", AOT_ENV, folder)
        return None
    return folder


def _log_compile(cfg) -> None:
    """Appends ``cfg`` to the FA4DIST_CUTE_COMPILE_LOG file, if set (development: which variants an AOT folder was
    missing)."""
    log = os.environ.get(LOG_ENV)
    if not log:
        return
    try:
        with open(log, "a") as f:
            f.write(repr(cfg) + "\n")
    except OSError as exc:
        raise OSError(f"{LOG_ENV}={log!r}: cannot append to it ({exc})") from exc


def get_compiled(cfg):
    """The compiled kernel of ``cfg``: from this process's cache, an AOT folder (FA4DIST_CUTE_AOT_DIR), the disk
    cache (disk_cache_dir), or compiled now (3-6 s) and written to the disk cache for the next process."""
    fn = _CACHE.get(cfg)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(cfg)
            if fn is None:
                _set_default_arch()
                aot = aot_dir()
                fn = _load_object(aot, cfg, "AOT") if aot else None
                disk = disk_cache_dir() if fn is None else None
                if disk is not None:
                    fn = _load_object(disk, cfg, "compile cache")
                if fn is None:
                    fn = compile_config(cfg)
                    _log_compile(cfg)
                    if disk is not None:
                        _store_on_disk(fn, cfg, disk)
                _CACHE[cfg] = fn
    return fn


def cache_info(kind=None) -> list:
    """Configs compiled (or loaded) so far in this process, optionally only those of one config class."""
    return [c for c in _CACHE if kind is None or isinstance(c, kind)]
