"""Every code example in the README and in fa4dist's docstrings runs as written.

- ```python blocks run in a fresh interpreter from the repository root; a block whose first line names a script and
  a ``torchrun`` command (``# name.py; run it with: torchrun --nproc-per-node N name.py``) is saved under that name
  and run exactly so.
- ```bash blocks: every command line that starts one of our programs (a recipe, ``fa4dist.demo``, a bench script)
  must parse with that program's own argument parser; the README's first command runs in CI itself (.ci/run) and
  its recipes in tests/recipes at test size.  So must the command lines in the module docstrings of fa4dist and the
  recipes.
- Every FA4DIST_* environment variable the package reads is named in the README or in the docstring of the module
  that reads it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
TORCHRUN_HEADER = re.compile(r"^# (\S+\.py); run it with: (torchrun .*?\1)\s*(?:\(.*)?$")


def _readme_blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((REPO / "README.md").read_text()) if kind == lang]


def _docstring_blocks() -> list[tuple[str, str]]:
    found = []
    for path in sorted((REPO / "fa4dist").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True) or ""
                for kind, body in FENCE.findall(doc + "\n"):
                    if kind == "python":
                        name = getattr(node, "name", "module")
                        found.append((f"{path.relative_to(REPO)}:{name}", body))
    return found


def _run(cmd, cwd, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _run_block(body: str, tmp_path: Path):
    header = TORCHRUN_HEADER.match(body.splitlines()[0])
    if header:
        script, command = header.groups()
        (tmp_path / script).write_text(body)
        args = shlex.split(command)
        assert args[0] == "torchrun"
        return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", *args[1:]], tmp_path)
    return _run([sys.executable, "-c", body], REPO)


README_PYTHON = _readme_blocks("python")
DOCSTRING_PYTHON = _docstring_blocks()


def test_there_are_examples_to_run():
    assert len(README_PYTHON) >= 2 and DOCSTRING_PYTHON


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(README_PYTHON)))
def test_readme_python_block_runs(index, tmp_path):
    _run_block(README_PYTHON[index], tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, body", DOCSTRING_PYTHON, ids=[w for w, _ in DOCSTRING_PYTHON])
def test_docstring_python_block_runs(where, body, tmp_path):
    _run_block(body, tmp_path)


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _our_commands(text: str):
    """(program, arguments) of each command line of ours in shell text (comments and continuations handled)."""
    text = re.sub(r"\\\n\s*", " ", text)
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split("&&"):
            words = shlex.split(part)
            for i, word in enumerate(words):
                if word.startswith("recipes/") and word.endswith(".py") or word.startswith("bench/") and \
                        word.endswith(".py"):
                    yield word, words[i + 1:]
                    break
                if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("fa4dist."):
                    yield words[i + 1], words[i + 2:]
                    break


def _parse(program: str, args: list[str]):
    if program == "fa4dist.demo":
        from fa4dist import demo

        return demo._args(args)
    module = _load(REPO / program)
    parse = getattr(module, "parse_args", None)
    assert parse is not None, f"{program} has no parse_args(argv) to check its documented flags with"
    return parse(args)


def test_readme_commands_use_flags_that_exist():
    commands = [c for body in _readme_blocks("bash") for c in _our_commands(body)]
    assert any(p == "fa4dist.demo" for p, _ in commands) and any(p.startswith("recipes/") for p, _ in commands)
    for program, args in commands:
        try:
            _parse(program, args)
        except SystemExit as exit_:
            pytest.fail(f"README: `{program} {' '.join(args)}` does not parse ({exit_})")


def test_docstring_commands_use_flags_that_exist():
    """The command lines in the module docstrings of fa4dist and the recipes (``torchrun ... -m fa4dist.demo
    --docs 12``) parse too (a placeholder path, ``/path/to/...``, left out: the parsers check that it exists)."""
    commands = []
    for path in sorted([*(REPO / "fa4dist").rglob("*.py"), *(REPO / "recipes").glob("*.py")]):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = [line for line in doc.splitlines()
                 if re.match(r"\s*(torchrun|python3?)\s", line) and "/path/to/" not in line]
        commands += [(path.name, *c) for c in _our_commands("\n".join(lines))]
    assert any(p == "fa4dist.demo" for _, p, _ in commands) and any(p.startswith("recipes/") for _, p, _ in commands)
    for where, program, args in commands:
        try:
            _parse(program, args)
        except SystemExit as exit_:
            pytest.fail(f"{where}: `{program} {' '.join(args)}` does not parse ({exit_})")


# the options of the tools the README's commands start besides ours (pip, pytest with xdist, torchrun)
OTHER_TOOLS_OPTIONS = {"--index-url", "--maxprocesses", "--dist", "--nproc-per-node", "--standalone"}


def test_every_option_the_readme_names_is_an_option_of_ours():
    """The README names options in prose too (`--docs 12`, `--window 4095`, `--cp-invariant` in the recipes), where
    test_readme_commands_use_flags_that_exist does not parse them: each must be an option that the demo, a recipe
    or a bench script defines (a string literal there), or one of the third-party tools its commands run."""
    readme = (REPO / "README.md").read_text()
    spans = re.findall(r"`([^`\n]+)`", readme) + _readme_blocks("bash")
    named = {flag for span in spans for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span)}
    sources = [REPO / "fa4dist" / "demo.py", *(REPO / "recipes").glob("*.py"), *(REPO / "bench").glob("*.py")]
    text = "".join(path.read_text() for path in sources)
    missing = sorted(flag for flag in named - OTHER_TOOLS_OPTIONS
                     if f'"{flag}"' not in text and f"'{flag}'" not in text)
    assert not missing, f"README names options no program of ours defines: {missing}"


def _environment_variables() -> list[tuple[str, str]]:
    """(file, name) of every FA4DIST_* name fa4dist's code reads (as a string constant: os.environ keys are)."""
    found = []
    for path in sorted((REPO / "fa4dist").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and re.fullmatch(r"FA4DIST_[A-Z0-9_]+", node.value)}
        found += [(str(path.relative_to(REPO)), name) for name in sorted(names)]
    return found


def test_every_environment_variable_is_documented_where_a_user_looks():
    """In the README or in the module docstring of the file that reads it (with its values and what a bad one does:
    the tests of each variable check those)."""
    variables = _environment_variables()
    assert {"FA4DIST_CP_INVARIANT", "FA4DIST_RING_STEPS_PER_LAUNCH", "FA4DIST_CUTE_SMS"} <= {n for _, n in variables}
    readme = (REPO / "README.md").read_text()
    missing = [f"{name} ({where})" for where, name in variables
               if name not in readme and name not in (ast.get_docstring(ast.parse((REPO / where).read_text())) or "")]
    assert not missing, f"environment variables documented neither in README.md nor in their module's docstring: " \
                        f"{missing}"


def test_the_layout_section_names_the_modules_and_test_folders_that_exist():
    """README's "Layout" lists the files of the contract, the cp package and the integrations, and the test folders;
    it had missed kernels/torch_ops.py, kernels/checkpointing.py and tests/data/.  Every module there is named, and
    every .py / folder it names exists."""
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("\n## Layout\n"):]
    named = set(re.findall(r"`([\w./]+)`", layout))
    missing = [f"{d}/{p.name}" for d in ("fa4dist/kernels", "fa4dist/context_parallel", "fa4dist/integrations")
               for p in sorted((REPO / d).glob("*.py")) if p.name != "__init__.py" and p.name not in named]
    missing += [f"tests/{p.name}/" for p in sorted((REPO / "tests").iterdir())
                if p.is_dir() and any(p.glob("test_*.py")) and f"{p.name}/" not in named]
    assert not missing, f"README's Layout does not name: {missing}"
    files = {p.name for d in ("fa4dist", "bench", "recipes", "tests") for p in (REPO / d).rglob("*")}
    stale = [n for n in named if n.endswith((".py", ".md", ".sh")) and n.split("/")[-1] not in files]
    assert not stale, f"README's Layout names files that do not exist: {stale}"
