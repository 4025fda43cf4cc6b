"""Packed training data from local text.

Documents (files of local text) are tokenized byte-level, concatenated into one token stream, and cut into
windows of ``seqlen`` tokens.  A window keeps its document structure: ``cu_seqlens`` marks where each document
(or piece of one) starts, ``positions`` restart at 0 in every document, and the label of a document's last token
is ``IGNORE`` so nothing is predicted across a document boundary.  With ``packing="stream"`` the window is one
causal sequence (documents only separated by their EOS/BOS tokens), which is what a "32k context" benchmark
wants when the documents are short.

Which windows a step trains on is a pure function of (seed, step, dp rank): a restarted job sees the same data.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Optional, Sequence

import torch

from ..kernels.problem import check_int, check_integer_dtype, check_seed, cu_seqlens_values, type_name
from .tokenizer import ByteTokenizer

IGNORE = -100
DEFAULT_SUFFIXES = (".py", ".md", ".toml", ".txt", ".json", ".sh", ".cfg", ".yaml", ".yml")
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules", ".venv", "venv", "build", "dist"}


def _skipped(part: str) -> bool:
    """A directory name collect_documents does not enter (hidden, a cache, a build output, egg-info)."""
    return part.startswith(".") or part in _SKIP_DIRS or part.endswith(".egg-info")


def _tracked_files(root: Path) -> Optional[list[Path]]:
    """The files git tracks under ``root``, outside the skipped directories, in walk order (sorted by path parts);
    None where ``root`` is not the top of a git checkout or git is not there (an installed package in a git-ignored
    ``.venv`` inside a project's checkout, uv's and poetry's layout, is in a checkout that tracks none of it)."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             check=True, timeout=60).stdout.decode("utf-8", "surrogateescape").strip()
        if not top or Path(top).resolve() != root.resolve():
            return None
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rel = [Path(p) for p in out.decode("utf-8", "surrogateescape").split("\0") if p]
    rel = [p for p in rel if not any(_skipped(part) for part in p.parts[:-1])]
    # os.walk's order: a directory's files before its subdirectories, each level sorted
    rel.sort(key=lambda p: [(1, part) for part in p.parts[:-1]] + [(0, p.name)])
    return [root / p for p in rel]


def default_text_root() -> Path:
    """The repository checkout when fa4dist is installed from one (editable), else the installed package."""
    pkg = Path(__file__).resolve().parents[1]
    repo = pkg.parent
    return repo if (repo / "pyproject.toml").exists() else pkg


def collect_documents(
    roots: Optional[Sequence[os.PathLike | str]] = None,
    suffixes: Iterable[str] = DEFAULT_SUFFIXES,
    max_file_bytes: int = 1 << 20,
) -> list[str]:
    """Texts of the files under ``roots`` (default: this repository's source and docs), in a fixed order.

    Hidden directories, caches, egg-info and build outputs are skipped; files larger than ``max_file_bytes`` or not
    valid UTF-8 are skipped too.  The default root, when it is a git checkout, gives the files git tracks only, so
    that a bench's or a test's outputs (git-ignored or not yet added) do not change the text between two runs of one
    recipe; their contents are read from the working tree, so the default data is a function of the commit only
    while the tracked files have no uncommitted edits."""
    if isinstance(roots, (str, os.PathLike)):  # one root (a string is not a sequence of roots)
        roots = [roots]
    if roots is not None:
        if isinstance(roots, bytes) or not isinstance(roots, Iterable):
            raise TypeError(f"roots must be a path or a sequence of paths (None: this repository), got "
                            f"{type(roots).__name__}")
        given, roots = roots, list(roots)
        bad = [r for r in roots if not isinstance(r, (str, os.PathLike))]
        if bad:
            raise TypeError(f"roots must hold paths (str or os.PathLike), got {type(bad[0]).__name__} in {given!r}")
        if not roots:  # (was taken as None: this repository's text, silently)
            raise ValueError(f"roots must name at least one file or directory (None: this repository), got {given!r}")
        empty = [r for r in roots if not os.fspath(r)]
        if empty:  # Path("") is ".": the current directory, read silently
            raise ValueError(f"roots must name files or directories, got an empty path in {given!r}")
    tracked = None if roots is not None else _tracked_files(default_text_root())
    roots = [Path(r) for r in (roots if roots is not None else [default_text_root()])]
    missing = [str(r) for r in roots if not r.exists()]
    if missing:  # was skipped silently beside roots that exist: a typo trained on less text than asked for
        raise FileNotFoundError(f"roots must be existing files or directories, these do not exist: {missing}")
    check_int("max_file_bytes", max_file_bytes, 0)
    if not isinstance(suffixes, (str, Iterable)) or isinstance(suffixes, bytes):
        raise TypeError(f"suffixes must be file name endings (strings), got {type(suffixes).__name__}")
    suffixes = (suffixes,) if isinstance(suffixes, str) else tuple(suffixes)
    if not suffixes or not all(isinstance(x, str) for x in suffixes):
        raise TypeError(f"suffixes must be file name endings (strings), got {suffixes!r}")
    docs: list[str] = []
    too_large, not_utf8 = [], []  # skipped files, named when nothing is left (else "no text files" misled)
    for root in roots:
        if root.is_file():
            files = [root]
        elif tracked is not None:
            files = [f for f in tracked if f.name.endswith(suffixes)]
        else:
            files = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
                files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
        for path in files:
            try:
                if path.stat().st_size > max_file_bytes:
                    too_large.append(str(path))
                    continue
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                not_utf8.append(str(path))
                continue
            except OSError:
                continue
            if text.strip():
                docs.append(text)
    if not docs:
        skipped = ([f"{len(too_large)} larger than max_file_bytes={max_file_bytes} (e.g. {too_large[0]!r})"]
                   if too_large else []) + ([f"{len(not_utf8)} not UTF-8 (e.g. {not_utf8[0]!r})"] if not_utf8 else [])
        raise ValueError(f"no text files ({', '.join(suffixes)}) found under {[str(r) for r in roots]}"
                         + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    return docs


@dataclass
class Sample:
    """One packed window: ``tokens``/``labels``/``positions`` (seqlen,) int64, ``cu_seqlens`` int32 (docs + 1).

    Every Sample (made by a stream, by hand, or by :meth:`to`) is checked here: ``tokens``, ``labels`` and
    ``positions`` integer tensors, 1-D, of one length, and ``cu_seqlens`` a 1-D tensor (no values read: free on any
    device).  Its values are checked by the plan that reads them (:func:`fa4dist.data.make_sample_plan`), and the
    tokens against them by the plan's ``shard``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor

    def __post_init__(self):
        # at cp 1 labels or positions of the wrong length went through shard_sample, to fail in the loss or the model
        # (a list of boundaries made plans, then failed in shard_sample and Sample.to: "'list' object has no
        # attribute 'tolist'")
        for name in ("tokens", "labels", "positions", "cu_seqlens"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Sample.{name} must be a torch.Tensor, got {type(t).__name__}")
        for name in ("tokens", "labels", "positions"):
            check_integer_dtype(f"Sample.{name}", getattr(self, name))
        if self.tokens.dim() != 1:
            raise ValueError(f"Sample.tokens must be 1-D (seqlen,), got shape {tuple(self.tokens.shape)}")
        for name in ("labels", "positions"):
            t = getattr(self, name)
            if t.shape != self.tokens.shape:
                raise ValueError(f"Sample.{name} must have the length of Sample.tokens ({self.tokens.numel()}), got "
                                 f"shape {tuple(t.shape)}")
        if self.cu_seqlens.dim() != 1:  # a 0-d one failed in shard_sample: "'int' object is not subscriptable"
            raise ValueError(f"Sample.cu_seqlens must be 1-D (documents + 1,), got shape "
                             f"{tuple(self.cu_seqlens.shape)}")

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def to(self, device) -> "Sample":
        return Sample(*(t.to(device) for t in (self.tokens, self.labels, self.positions, self.cu_seqlens)))


def segments_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32) of the runs of equal ids in a 1-D tensor."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor, got {type_name(doc_ids)}")
    if doc_ids.dim() != 1:  # nonzero() of a (1, T) tensor gives coordinate pairs: boundaries silently wrong
        raise ValueError(f"doc_ids must be 1-D (tokens,), got shape {tuple(doc_ids.shape)}")
    n = doc_ids.numel()
    starts = torch.nonzero(torch.diff(doc_ids) != 0).flatten() + 1
    # (on doc_ids' device: a CPU zero beside CUDA starts made torch.cat fail)
    ends = torch.tensor([0, n], dtype=torch.long, device=doc_ids.device)
    return torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of every token within its segment (int64); ``cu_seqlens`` a 1-D integer tensor from 0,
    non-decreasing.  One host read of ``cu_seqlens`` (a device sync for a CUDA one)."""
    total = cu_seqlens_values("cu_seqlens", cu_seqlens)[-1]
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)  # the size known: no second sync
    return torch.arange(total, device=cu.device) - starts  # on cu_seqlens' device (a CUDA one too)


def _token_ids(ids, index: int) -> torch.Tensor:
    """A tokenizer's ids of ``documents[index]`` as int64: a flat sequence of integers (float ids were truncated
    silently, nested lists packed a 2-D stream, a string failed deep in torch)."""
    name = f"tokenizer.encode(documents[{index}])"
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must return a sequence of integer token ids, got {type_name(ids)}") from err
    if t.numel() == 0:  # [] is a float tensor to torch
        return torch.zeros(0, dtype=torch.long)
    if t.dim() != 1:
        raise ValueError(f"{name} must return a flat sequence of token ids, got shape {tuple(t.shape)}")
    check_integer_dtype(name, t)
    t = t.long()
    if bool((t < 0).any()):  # (-100, the labels' IGNORE, would silently drop the previous token's target)
        raise ValueError(f"{name} must return token ids >= 0, got {int(t.min())}")
    return t


class PackedTokenStream:
    """Documents concatenated into one token stream, cut into windows of ``seqlen`` tokens.

    ``tokenizer``: a :class:`ByteTokenizer` (the default, ``None``), a :class:`PretrainedTokenizer` or any object
    whose ``encode(text)`` returns the text's token ids."""

    def __init__(self, documents: Iterable[str], seqlen: int, *, packing: str = "documents", seed: int = 0,
                 tokenizer: Optional[ByteTokenizer] = None):
        if packing not in ("documents", "stream"):
            raise ValueError(f"packing must be 'documents' or 'stream', got {packing!r}")
        seqlen, seed = check_int("seqlen", seqlen, 2), check_seed("seed", seed)  # (Python ints: NumPy's too)
        if isinstance(documents, (str, bytes)):
            raise TypeError("documents must be a sequence of texts, got one "
                            f"{type(documents).__name__} (wrap it in a list: [text])")
        if isinstance(documents, Mapping) or not isinstance(documents, Iterable):  # (a dict packed its keys)
            raise TypeError(f"documents must be a sequence of texts (str), got {type(documents).__name__}")
        if tokenizer is None:
            tokenizer = ByteTokenizer()
        elif isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None)):
            # a str has an encode method too: str.encode(text) took the text as a codec name (LookupError)
            raise TypeError("tokenizer must be a ByteTokenizer (or an object with an encode(text) method returning "
                            f"token ids) or None, got {type(tokenizer).__name__}")
        pieces = []
        for i, text in enumerate(documents):
            if not isinstance(text, str):
                raise TypeError(f"documents[{i}] must be a str, got {type(text).__name__}")
            pieces.append(_token_ids(tokenizer.encode(text), i))
        if not sum(p.numel() for p in pieces):
            raise ValueError("no documents to pack")
        tokens = torch.cat(pieces)
        docs = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor([p.numel() for p in pieces]))
        # A corpus shorter than one window is repeated (each copy a separate document).
        copies = -(-(seqlen + 1) // tokens.numel())
        if copies > 1:
            tokens = tokens.repeat(copies)
            docs = torch.cat([docs + c * len(pieces) for c in range(copies)])  # (documents may be a generator)
        self.tokens, self.doc_ids = tokens, docs
        self.seqlen, self.packing, self.seed = seqlen, packing, seed
        self.num_windows = (tokens.numel() - 1) // seqlen
        self._perm = torch.randperm(self.num_windows, generator=torch.Generator().manual_seed(seed))

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def window(self, index: int) -> Sample:
        """Window ``index`` of the stream (windows in a seeded order; the order repeats every ``num_windows``)."""
        check_int("index", index, 0)
        w = int(self._perm[index % self.num_windows])
        start = w * self.seqlen
        span = slice(start, start + self.seqlen + 1)  # one extra token: the last label
        toks, docs = self.tokens[span], self.doc_ids[span]
        tokens, labels = toks[:-1].clone(), toks[1:].clone()
        if self.packing == "stream":
            cu = torch.tensor([0, self.seqlen], dtype=torch.int32)
        else:
            labels[docs[1:] != docs[:-1]] = IGNORE
            cu = segments_from_doc_ids(docs[:-1])
        return Sample(tokens, labels, positions_from_cu_seqlens(cu), cu)

    def global_index(self, step: int, sequence: int, sequences_per_step: int) -> int:
        return step * sequences_per_step + sequence

    def batch(self, step: int, sequences_per_step: int, first: int = 0, count: Optional[int] = None) -> list[Sample]:
        """Samples ``first .. first + count`` of the ``sequences_per_step`` that make up global step ``step``
        (a data-parallel rank asks for its slice)."""
        check_int("step", step, 0)
        check_int("sequences_per_step", sequences_per_step, 1)
        check_int("first", first, 0)
        if first > sequences_per_step:  # (the default count would be negative, and the error name it)
            raise ValueError(f"first={first} exceeds the step's sequences_per_step={sequences_per_step}")
        count = sequences_per_step - first if count is None else count
        check_int("count", count, 0)
        if first + count > sequences_per_step:
            raise ValueError(f"samples first={first} .. first + count={first + count} exceed the step's "
                             f"sequences_per_step={sequences_per_step}")
        return [self.window(self.global_index(step, first + i, sequences_per_step)) for i in range(count)]
