"""The compile cache on disk (cute/host.py: disk_cache_dir, get_compiled): a variant compiled once is written as an
object file and loaded by the next process instead of compiled again (3-6 s a variant); broken, foreign or unwritable
cache entries cost a compile, never an error. Compiles for sm_90a without a GPU, and loads the object file back (the
load needs no GPU either)."""

import hashlib
import logging
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from fa4dist.kernels.cute import host  # noqa: E402
from fa4dist.kernels.cute.row_absmax import RowAbsMaxConfig  # noqa: E402

pytestmark = pytest.mark.cute

CFG = RowAbsMaxConfig(16, "fp16", True)  # a small kernel: about a second to compile


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """This process as a new one (nothing compiled yet) with its disk cache in tmp_path."""
    monkeypatch.setattr(host, "_CACHE", {})
    monkeypatch.setattr(host, "_DISK_CACHE_WARNED", [])
    monkeypatch.delenv(host.AOT_ENV, raising=False)
    monkeypatch.setenv(host.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def compiles_counted(monkeypatch):
    calls = []
    real = host.compile_config

    def counted(cfg, **kw):
        calls.append(cfg)
        return real(cfg, **kw)

    monkeypatch.setattr(host, "compile_config", counted)
    return calls


def test_a_compiled_variant_is_loaded_from_disk_by_the_next_process(fresh_process, monkeypatch):
    calls = compiles_counted(monkeypatch)
    host.get_compiled(CFG)
    assert calls == [CFG]
    path = host.stored_object(host.disk_cache_dir(), CFG)
    assert path is not None and os.path.dirname(path).startswith(str(fresh_process))
    assert os.stat(path).st_mode & 0o777 == 0o644  # a cache shared by a machine's users: mkstemp made it 0600
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")] == []  # no temporary file left

    monkeypatch.setattr(host, "_CACHE", {})  # the next process
    fn = host.get_compiled(CFG)
    assert calls == [CFG], "compiled again instead of loaded"
    assert callable(fn) and host.get_compiled(CFG) is fn


def test_a_cache_file_that_fails_to_load_is_compiled_again(fresh_process, monkeypatch, caplog):
    folder = host.disk_cache_dir()
    os.makedirs(folder)
    data = b"not an object file"  # (whole: its digest is its name's)
    with open(os.path.join(folder, f"{host.config_key(CFG)}.{hashlib.sha256(data).hexdigest()[:16]}.o"), "wb") as f:
        f.write(data)
    calls = compiles_counted(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
        assert callable(host.get_compiled(CFG))
    assert calls == [CFG] and "compile cache load" in caplog.text
    monkeypatch.setattr(host, "_CACHE", {})
    host.get_compiled(CFG)
    assert calls == [CFG], "the file written after the compile did not load"


def test_the_cache_is_keyed_by_the_toolchain(fresh_process, monkeypatch):
    """Objects for another architecture (or DSL / TVM-FFI / Python version) live in another folder."""
    sm90 = host.disk_cache_dir()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert host.disk_cache_dir() != sm90
    assert os.path.dirname(host.disk_cache_dir()) == os.path.dirname(sm90)


@pytest.mark.parametrize("off", ["0", "off", ""])
def test_turned_off_nothing_is_written(fresh_process, monkeypatch, off):
    monkeypatch.setenv(host.CACHE_ENV, off)
    assert host.disk_cache_dir() is None
    host.get_compiled(CFG)
    assert not fresh_process.exists()


def test_an_unwritable_cache_costs_a_warning_not_an_error(fresh_process, monkeypatch, caplog, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(host.CACHE_ENV, str(blocker))  # a file where the folder should be
    with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
        assert callable(host.get_compiled(CFG))
        monkeypatch.setattr(host, "_CACHE", {})
        assert callable(host.get_compiled(CFG))
    assert caplog.text.count("could not write the compile cache") == 1  # once per process
    assert host.CACHE_ENV in caplog.text


def test_the_default_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv(host.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert host.disk_cache_dir().startswith(os.path.join(str(tmp_path), "fa4dist", "cute") + os.sep)


def stored_files(folder):
    """The object files of CFG in ``folder`` (by name: however the name goes on after config_key)."""
    key = host.config_key(CFG)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(key)) if os.path.isdir(
        folder) else []


class Interrupted:
    """A compiled function whose export dies half-way through writing the file (the process killed)."""

    def __init__(self, fn):
        self.fn = fn

    def export_to_c(self, path, function_name):
        self.fn.export_to_c(path, function_name=function_name)
        with open(path, "r+b") as f:
            f.truncate(100)
        raise KeyboardInterrupt


def test_an_interrupted_export_leaves_no_object_under_its_name(fresh_process, monkeypatch, tmp_path):
    """export_aot wrote straight to the final name: a killed export left a truncated object there, which the
    session script's next export kept as done (bench/cute_session_dev.py skips a config whose file exists)."""
    real = host.compile_config
    monkeypatch.setattr(host, "compile_config", lambda cfg, **kw: Interrupted(real(cfg, **kw)))
    aot = tmp_path / "aot"
    with pytest.raises(KeyboardInterrupt):
        host.export_aot(CFG, str(aot))
    assert os.listdir(aot) == []  # neither a truncated object nor its temporary file


def test_an_aot_object_is_loaded_by_a_process_of_the_same_target(fresh_process, monkeypatch, tmp_path):
    """Exported and loaded where CUTE_DSL_ARCH is unset (a GPU machine): both name the default architecture."""
    monkeypatch.setenv(host.CACHE_ENV, "0")
    monkeypatch.delenv("CUTE_DSL_ARCH")
    path = host.export_aot(CFG, str(tmp_path / "aot"))
    assert stored_files(str(tmp_path / "aot")) == [path]
    assert os.stat(path).st_mode & 0o777 == 0o644  # readable by the machine's other users (mkstemp makes 0600)
    monkeypatch.delenv("CUTE_DSL_ARCH")  # the loading process
    monkeypatch.setenv(host.AOT_ENV, str(tmp_path / "aot"))
    calls = compiles_counted(monkeypatch)
    assert callable(host.get_compiled(CFG)) and calls == []


class CompileAsked(Exception):
    pass


@pytest.mark.parametrize("change", ["arch", "dsl"])
def test_an_aot_object_of_another_target_is_not_loaded(fresh_process, monkeypatch, tmp_path, change):
    """An AOT folder was keyed by the config and the kernel sources alone (the disk cache by the toolchain too): one
    exported for another architecture or by another CuTe DSL was loaded, its machine code or calling convention
    not this process's."""
    monkeypatch.setenv(host.CACHE_ENV, "0")
    host.export_aot(CFG, str(tmp_path / "aot"))
    monkeypatch.setenv(host.AOT_ENV, str(tmp_path / "aot"))
    if change == "arch":
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    else:
        from importlib import metadata

        real = metadata.version
        monkeypatch.setattr(metadata, "version", lambda d: "0.0.1" if d == "nvidia-cutlass-dsl" else real(d))

    def compile_asked(cfg, **kw):
        raise CompileAsked

    monkeypatch.setattr(host, "compile_config", compile_asked)
    with pytest.raises(CompileAsked):
        host.get_compiled(CFG)


def test_a_corrupted_cache_entry_is_refused_by_name_and_compiled_again(fresh_process, monkeypatch, caplog):
    """Bytes changed inside an object file (a bad disk, a copy cut short or half-synced) left a file the loader
    took: only a truncated one failed to load."""
    calls = compiles_counted(monkeypatch)
    host.get_compiled(CFG)
    [path] = stored_files(host.disk_cache_dir())
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 3, len(data) // 3 + 256):
        data[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    monkeypatch.setattr(host, "_CACHE", {})  # the next process
    with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
        assert callable(host.get_compiled(CFG))
    assert calls == [CFG, CFG], "the corrupted object was loaded"
    assert os.path.basename(path) in caplog.text
    monkeypatch.setattr(host, "_CACHE", {})
    host.get_compiled(CFG)
    assert calls == [CFG, CFG], "the corrupted object was not replaced"
