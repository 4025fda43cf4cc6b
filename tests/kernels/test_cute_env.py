"""The cute backend's environment variables (kernels/cute/host.py lists them): every value the code cannot use is an
error (or, for the AOT folder, a log line) naming the variable. No GPU and no cutlass needed."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa4dist.kernels.cute import backward, forward, host

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("var, fields, text, expected", [
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "tile_m=abc", "field 'tile_m' must be an int >= 1, got 'abc'"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "rescale_threshold=x",
     "field 'rescale_threshold' must be a finite float >= 0"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "sanitize=maybe", "field 'sanitize' must be a boolean"),
    ("FA4DIST_BWD_OVERRIDE", backward._FIELDS, "det_chunk", "field 'det_chunk' must be an int >= 0, got ''"),
    ("FA4DIST_BWD_OVERRIDE", backward._FIELDS, "stmatrix_ds=2", "field 'stmatrix_ds' must be a boolean"),
    # sizes and counts below zero, and thresholds that compare false with everything, were taken as given
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "tile_m=-128", "field 'tile_m' must be an int >= 1, got '-128'"),
    # a tile, stage count or CTAs per SM of 0 failed deep in the launch (a ZeroDivisionError, an empty assert)
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "tile_m=0", "field 'tile_m' must be an int >= 1, got '0'"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "num_stages=0", "field 'num_stages' must be an int >= 1, got '0'"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "ctas_per_sm=0", "field 'ctas_per_sm' must be an int >= 1"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "persistent_ctas=-5", "field 'persistent_ctas' must be an int >= 0"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "num_stages=\u00b2", "field 'num_stages' must be an int >= 1"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "rescale_threshold=nan",
     "field 'rescale_threshold' must be a finite float >= 0, got 'nan'"),
    ("FA4DIST_FWD_OVERRIDE", forward._FIELDS, "rescale_threshold=-1", "field 'rescale_threshold' must be a finite"),
    ("FA4DIST_BWD_OVERRIDE", backward._FIELDS, "det_chunk=-8", "field 'det_chunk' must be an int >= 0, got '-8'"),
    ("FA4DIST_BWD_OVERRIDE", backward._FIELDS, "regs_mma=1.5", "field 'regs_mma' must be an int >= 0, got '1.5'"),
])
def test_a_bad_override_value_names_the_variable_and_the_field(monkeypatch, var, fields, text, expected):
    """int('abc') was a ValueError naming neither (raised at `import fa4dist.kernels`), a boolean field took
    anything but 1 / true / yes as False, and tile_m=-128 or rescale_threshold=nan reached the kernel build."""
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=f"^{var}: {expected}"):
        host.env_overrides(var, fields)


def test_override_booleans_take_the_usual_spellings_and_nothing_else():
    for text in ("1", "true", "YES", " on "):
        assert host.parse_bool(text) is True, text
    for text in ("0", "False", "no", "off"):
        assert host.parse_bool(text) is False, text
    for text in ("", "2", "maybe", "tru"):
        with pytest.raises(ValueError, match="not a boolean"):
            host.parse_bool(text)
    assert forward.parse_overrides("dynamic_tiles=off,tile_m=128") == dict(dynamic_tiles=False, tile_m=128)
    assert forward.parse_overrides("persistent_ctas=0, rescale_threshold= 8") == dict(persistent_ctas=0,
                                                                                      rescale_threshold=8.0)


def test_a_bad_override_fails_the_import_naming_the_variable():
    """The overrides are read when the cute modules are imported (by `import fa4dist.kernels`): the error a user sees
    is the first thing they run."""
    env = dict(os.environ, FA4DIST_FWD_OVERRIDE="tile_m=abc", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", "import fa4dist.kernels"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0
    assert "FA4DIST_FWD_OVERRIDE: field 'tile_m' must be an int >= 1, got 'abc'" in proc.stderr


def test_the_aot_folder_must_be_a_folder_or_it_is_logged_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(host, "_AOT_WARNED", [])
    monkeypatch.delenv(host.AOT_ENV, raising=False)
    assert host.aot_dir() is None
    monkeypatch.setenv(host.AOT_ENV, str(tmp_path))
    assert host.aot_dir() == str(tmp_path)
    monkeypatch.setenv(host.AOT_ENV, str(tmp_path / "missing"))
    with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
        assert host.aot_dir() is None
        assert host.aot_dir() is None
    assert caplog.text.count(f"{host.AOT_ENV}={str(tmp_path / 'missing')!r} is not a folder") == 1


def test_a_compile_log_that_cannot_be_written_names_the_variable(monkeypatch, tmp_path):
    log = tmp_path / "compiled.txt"
    monkeypatch.setenv(host.LOG_ENV, str(log))
    host._log_compile("cfg A")
    host._log_compile("cfg B")
    assert log.read_text() == "'cfg A'\n'cfg B'\n"
    monkeypatch.setenv(host.LOG_ENV, str(tmp_path / "no_such_folder" / "compiled.txt"))
    with pytest.raises(OSError, match=f"^{host.LOG_ENV}=.*no_such_folder.*: cannot append to it"):
        host._log_compile("cfg C")


@pytest.fixture
def default_cache(monkeypatch, tmp_path):
    """The default cache folder's parent under tmp_path, and a working directory of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(host.CACHE_ENV, raising=False)
    default = host.disk_cache_dir()
    assert default.startswith(str(tmp_path / "xdg" / "fa4dist" / "cute") + os.sep)
    return default


@pytest.mark.parametrize("on", ["1", "on", "TRUE", " yes "])
def test_the_cache_turned_on_by_name_is_the_default_folder(monkeypatch, default_cache, on):
    """FA4DIST_CUTE_CACHE_DIR=1 (the mirror of =0, off) made a folder named '1' in the working directory."""
    monkeypatch.setenv(host.CACHE_ENV, on)
    assert host.disk_cache_dir() == default_cache


@pytest.mark.parametrize("given, expected", [
    (" {tmp}/c ", "{tmp}/c"),  # spaces around a path (as around the off spellings) are not part of it
    ("~/c", "{home}/c"),  # a tilde the shell did not expand (quoted, an env file, a launcher's env=)
    ("rel/c", "{tmp}/rel/c"),  # a relative path is the working directory's when it is read
])
def test_the_cache_folder_is_the_path_given(monkeypatch, tmp_path, default_cache, given, expected):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fill = dict(tmp=str(tmp_path), home=str(tmp_path / "home"))
    monkeypatch.setenv(host.CACHE_ENV, given.format(**fill))
    folder = host.disk_cache_dir()
    assert os.path.dirname(folder) == expected.format(**fill), folder
    assert os.path.basename(folder) == os.path.basename(default_cache)  # the toolchain's sub-folder


def test_the_aot_folder_is_read_as_the_cache_folder_is(monkeypatch, tmp_path):
    """A tilde no shell expanded and spaces around the path: the folder was 'not a folder' (logged), every variant
    compiled on first use."""
    (tmp_path / "aot").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    for given in ("~/aot", f" {tmp_path / 'aot'} "):
        monkeypatch.setenv(host.AOT_ENV, given)
        assert host.aot_dir() == str(tmp_path / "aot"), given
