"""fa4dist.data.packing: documents collected from local text and packed into windows; bad arguments refused by
name."""

import pytest
import torch

from fa4dist.data.packing import IGNORE, PackedTokenStream, Sample, collect_documents


def _tree(tmp_path):
    (tmp_path / "a.txt").write_text("alpha document")
    (tmp_path / "b.py").write_text("print('beta')")
    (tmp_path / "c.dat").write_text("not collected")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "d.txt").write_text("delta")
    return tmp_path


def test_one_root_and_one_suffix_may_be_given_as_strings(tmp_path):
    """A string is one root (not a sequence of one-character roots), and a string suffix one ending."""
    root = _tree(tmp_path)
    assert collect_documents(str(root), suffixes=".txt") == ["alpha document", "delta"]
    assert collect_documents(root, suffixes=(".py",)) == ["print('beta')"]
    assert collect_documents([root]) == collect_documents(str(root))
    with pytest.raises(TypeError, match="suffixes must be file name endings"):
        collect_documents(root, suffixes=[1])
    for bad in (None, 3):  # (was Python's own "'NoneType' object is not iterable")
        with pytest.raises(TypeError, match=f"suffixes must be file name endings \\(strings\\), got "
                                            f"{type(bad).__name__}"):
            collect_documents(root, suffixes=bad)


def test_a_root_that_does_not_exist_is_refused_by_name(tmp_path):
    """A missing root beside one that exists (a typo in --data) was skipped silently: less text than asked for."""
    root = _tree(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"roots must be existing files or directories.*'.*typo'"):
        collect_documents([root, tmp_path / "typo"])
    with pytest.raises(ValueError, match="max_file_bytes must be >= 0, got -1"):
        collect_documents(root, max_file_bytes=-1)


def test_an_empty_list_of_roots_is_refused_not_read_as_the_default(tmp_path):
    """roots=[] (a --data list or glob that matched nothing) was taken as None: this repository's own text, read
    silently in place of the caller's empty corpus."""
    with pytest.raises(ValueError, match=r"roots must name at least one file or directory \(None: this repository\), "
                                         r"got \[\]"):
        collect_documents([])
    with pytest.raises(ValueError, match=r"got \(\)"):
        collect_documents(())
    # an empty path is Path(""), the current directory: read silently in place of the caller's root
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ValueError, match=r"an empty path in \[.*''\]"):
        collect_documents([tmp_path, ""])
    with pytest.raises(ValueError, match=r"an empty path"):
        collect_documents("")


def test_a_root_whose_files_are_all_skipped_says_why(tmp_path):
    """A folder of files over max_file_bytes or not UTF-8 said only "no text files (.py, .md, ...) found", as if
    there were none with those endings."""
    (tmp_path / "big.txt").write_text("x" * 100)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"no text files .* skipped: 1 larger than max_file_bytes=10 \(e.g. "
                                         r"'.*big.txt'\), 1 not UTF-8 \(e.g. '.*latin1.txt'\)"):
        collect_documents(tmp_path, max_file_bytes=10)
    (tmp_path / "ok.txt").write_text("short")
    assert collect_documents(tmp_path, max_file_bytes=10) == ["short"]


def test_windows_keep_their_document_structure():
    stream = PackedTokenStream(["abcdef", "ghijklmnop", "qrs"], seqlen=8, seed=1)
    for i in range(stream.num_windows):
        w = stream.window(i)
        cu = w.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 8 and all(b > a for a, b in zip(cu, cu[1:]))
        for a, b in zip(cu, cu[1:]):  # positions restart in every document; no label across a boundary
            assert w.positions[a:b].tolist() == list(range(b - a))
        ends = [b - 1 for b in cu[1:-1]]
        assert all(w.labels[e] == IGNORE for e in ends)


@pytest.mark.parametrize("documents, seqlen, kwargs, error, message", [
    ("hello world", 4, {}, TypeError, "documents must be a sequence of texts, got one str"),
    (b"hello", 4, {}, TypeError, "documents must be a sequence of texts, got one bytes"),
    (["ok", b"x"], 4, {}, TypeError, "documents\\[1\\] must be a str, got bytes"),
    (["ok", None], 4, {}, TypeError, "documents\\[1\\] must be a str, got NoneType"),
    (["abc"], 4.0, {}, TypeError, "seqlen must be an int, got float"),
    (["abc"], "8", {}, TypeError, "seqlen must be an int, got str"),
    (["abc"], 1, {}, ValueError, "seqlen must be >= 2, got 1"),
    (["abc"], 4, dict(seed=None), TypeError, "seed must be an int, got NoneType"),
    (["abc"], 4, dict(packing="rows"), ValueError, "packing must be 'documents' or 'stream'"),
    (None, 4, {}, TypeError, "documents must be a sequence of texts \\(str\\), got NoneType"),  # not iterable
    (5, 4, {}, TypeError, "documents must be a sequence of texts \\(str\\), got int"),
    ({"a": "text"}, 4, {}, TypeError, "documents must be a sequence of texts \\(str\\), got dict"),  # packed its keys
])
def test_bad_stream_arguments_are_refused_by_name(documents, seqlen, kwargs, error, message):
    with pytest.raises(error, match=message):
        PackedTokenStream(documents, seqlen, **kwargs)



def test_a_seed_outside_torchs_range_is_refused_by_name():
    """seed=2**64 (or below -2**63) failed in the generator's manual_seed with "Overflow when unpacking long long",
    naming nothing; it is refused by name, in the range the recipes' --seed is checked against (one check)."""
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match=rf"seed must be in \[-2\*\*63, 2\*\*64\) \(torch's seeds\), got {seed}"):
            PackedTokenStream(["abcdefgh"], 4, seed=seed)
    for seed in (2**64 - 1, -(2**63)):  # the range's ends are torch's own: taken, and each a fixed order
        first, again = (PackedTokenStream(["abcdefgh" * 4], 4, seed=seed) for _ in range(2))
        assert first.seed == seed and torch.equal(first._perm, again._perm)
    # NumPy's integers are ints (check_int takes them): the generator got the NumPy value and raised "an integer is
    # required", naming nothing
    np = pytest.importorskip("numpy")
    stream = PackedTokenStream(["abcdefgh" * 4], np.int64(4), seed=np.int64(3))
    assert type(stream.seqlen) is int and type(stream.seed) is int
    assert torch.equal(stream._perm, PackedTokenStream(["abcdefgh" * 4], 4, seed=3)._perm)

def test_a_step_batch_stays_inside_its_step():
    stream = PackedTokenStream(["abcdefgh" * 20], seqlen=4)
    whole = stream.batch(3, 4)
    assert [torch.equal(a.tokens, b.tokens) for a, b in zip(whole[1:3], stream.batch(3, 4, first=1, count=2))] == [
        True, True]
    for first, count in ((2, 4), (-2, None), (0, -1)):
        with pytest.raises(ValueError, match="first|count"):
            stream.batch(0, 4, first=first, count=count)
    with pytest.raises(ValueError, match="first=5 exceeds the step's sequences_per_step=4"):  # (named count, not given)
        stream.batch(0, 4, first=5)


def test_a_bad_step_or_window_index_is_refused_by_name():
    """A negative step or window index wrapped around to other windows silently; a float one was an IndexError."""
    stream = PackedTokenStream(["abcdefgh" * 20], seqlen=4)
    for step, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="step must be"):
            stream.batch(step, 2)
    for index, error in ((-1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="index must be"):
            stream.window(index)
    assert torch.equal(stream.window(stream.num_windows + 1).tokens, stream.window(1).tokens)  # the order repeats


@pytest.mark.parametrize("tokenizer", ["abc", b"abc", 3])
def test_a_tokenizer_that_is_not_one_is_refused_by_name(tokenizer):
    """A string was taken as the tokenizer: str.encode(text) raised LookupError: unknown encoding."""
    with pytest.raises(TypeError, match=r"tokenizer must be a ByteTokenizer \(or an object with an encode\(text\) "
                                        r"method returning token ids\) or None, got "):
        PackedTokenStream(["abc"], 4, tokenizer=tokenizer)


def test_a_tokenizer_object_is_used():
    class Upper:
        def encode(self, text):
            return list(text.upper().encode())

    assert PackedTokenStream(["ab"], 2, tokenizer=Upper()).tokens.tolist() == [65, 66, 65, 66]


def test_documents_may_be_any_iterable_of_texts():
    """A generator of texts was tokenized, then a corpus shorter than a window (repeated) failed with "object of type
    'generator' has no len()"; each copy is still a document of its own."""
    texts = ["hello", "world!"]
    want = PackedTokenStream(texts, 40)
    got = PackedTokenStream((t for t in texts), 40)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.doc_ids, want.doc_ids)
    assert got.doc_ids.unique().tolist() == list(range(6))  # 3 copies of 7 + 8 tokens for 41: 6 documents


@pytest.mark.parametrize("cu, message", [
    (torch.tensor([0, 5, 3], dtype=torch.int32), r"cu_seqlens must be non-decreasing, got \[0, 5, 3\]"),
    (torch.tensor([2, 5]), "cu_seqlens must start at 0, got 2"),
    (torch.tensor([0]), r"cu_seqlens must be 1-D with at least 2 entries"),
])
def test_positions_from_bad_cu_seqlens_are_refused_by_name(cu, message):
    """A decreasing cu_seqlens was a repeat_interleave error; one from 2 gave positions of the wrong length."""
    from fa4dist.data.packing import positions_from_cu_seqlens

    with pytest.raises(ValueError, match=message):
        positions_from_cu_seqlens(cu)


def test_positions_from_cu_seqlens_take_any_integer_dtype_and_refuse_floats():
    from fa4dist.data.packing import positions_from_cu_seqlens

    for dtype in (torch.int32, torch.int64):
        got = positions_from_cu_seqlens(torch.tensor([0, 2, 2, 5], dtype=dtype))
        assert got.tolist() == [0, 1, 0, 1, 2] and got.dtype == torch.int64
    with pytest.raises(TypeError, match="cu_seqlens must hold integers, got dtype torch.float32"):
        positions_from_cu_seqlens(torch.tensor([0.0, 2.0]))


def _fields(n=8):
    return dict(tokens=torch.arange(n), labels=torch.arange(1, n + 1), positions=torch.arange(n),
                cu_seqlens=torch.tensor([0, n], dtype=torch.int32))


@pytest.mark.parametrize("field, value, error, message", [
    ("labels", torch.arange(7), ValueError, r"Sample.labels must have the length of Sample.tokens \(8\), got shape "
                                            r"\(7,\)"),
    ("positions", torch.arange(9), ValueError, r"Sample.positions must have the length of Sample.tokens \(8\), got "
                                               r"shape \(9,\)"),
    ("tokens", torch.arange(8).view(2, 4), ValueError, r"Sample.tokens must be 1-D \(seqlen,\), got shape \(2, 4\)"),
    ("labels", torch.arange(8).view(8, 1), ValueError, r"Sample.labels must have the length of Sample.tokens \(8\), "
                                                       r"got shape \(8, 1\)"),
    ("tokens", torch.arange(8.0), TypeError, "Sample.tokens must hold integers, got dtype torch.float32"),
    ("labels", torch.ones(8, dtype=torch.bool), TypeError, "Sample.labels must hold integers, got dtype torch.bool"),
    ("positions", torch.arange(8.0) / 2, TypeError, "Sample.positions must hold integers, got dtype torch.float32"),
    ("positions", list(range(8)), TypeError, "Sample.positions must be a torch.Tensor, got list"),
    ("cu_seqlens", [0, 8], TypeError, "Sample.cu_seqlens must be a torch.Tensor, got list"),
    ("cu_seqlens", (0, 3, 8), TypeError, "Sample.cu_seqlens must be a torch.Tensor, got tuple"),
    ("cu_seqlens", torch.tensor(8), ValueError, r"Sample.cu_seqlens must be 1-D \(documents \+ 1,\), got shape \(\)"),
])
def test_a_sample_with_bad_fields_is_refused_by_name(field, value, error, message):
    """At cp 1 labels or positions of the wrong length went through shard_sample, to fail later in the loss or the
    model (or not at all: float positions); every Sample is checked where it is made.  cu_seqlens given as a list was
    taken, and shard_sample then failed at every cp size with "'list' object has no attribute 'tolist'" (Sample.to:
    "has no attribute 'to'"), and a 0-d one with "'int' object is not subscriptable"."""
    with pytest.raises(error, match=message):
        Sample(**{**_fields(), field: value})


def test_a_good_sample_is_kept_as_given():
    s = Sample(**_fields())
    assert s.tokens.dtype == torch.int64 and s.to("cpu").labels.tolist() == list(range(1, 9))


class _Ids:
    def __init__(self, ids):
        self.ids = ids

    def encode(self, text):
        return self.ids


@pytest.mark.parametrize("ids, error, message", [
    ([1.5, 2.0], TypeError, r"tokenizer.encode\(documents\[0\]\) must hold integers, got dtype torch.float32"),
    ([True, False], TypeError, r"tokenizer.encode\(documents\[0\]\) must hold integers, got dtype torch.bool"),
    ([[1, 2], [3, 4]], ValueError, r"must return a flat sequence of token ids, got shape \(2, 2\)"),
    ("xyz", TypeError, r"tokenizer.encode\(documents\[0\]\) must return a sequence of integer token ids, got str"),
    (None, TypeError, "must return a sequence of integer token ids, got NoneType"),
])
def test_a_tokenizers_bad_ids_are_refused_by_name(ids, error, message):
    """Float ids were truncated silently, nested lists made a 2-D stream (with document ids of another length), a
    string failed inside torch ("too many dimensions 'str'")."""
    with pytest.raises(error, match=message):
        PackedTokenStream(["abc"], 4, tokenizer=_Ids(ids))


def test_a_tokenizers_ids_may_be_a_tensor_and_empty():
    tensor = PackedTokenStream(["a", "b"], 2, tokenizer=_Ids(torch.tensor([5, 6, 7], dtype=torch.int32)))
    assert tensor.tokens.tolist() == [5, 6, 7, 5, 6, 7] and tensor.doc_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert tensor.tokens.dtype == torch.int64
    with pytest.raises(ValueError, match="no documents to pack"):
        PackedTokenStream(["a"], 2, tokenizer=_Ids([]))


def test_segments_from_doc_ids_refuses_what_is_not_one_1d_tensor():
    """A (1, T) tensor of document ids (the batch shape transformers' collators make) gave the boundaries of its
    flattened nonzero() coordinates, silently wrong ([0, 1, 2, 3] for [[0, 0, 1]], which has [0, 2, 3]); a list
    failed with AttributeError: 'list' object has no attribute 'numel'."""
    from fa4dist.data.packing import segments_from_doc_ids

    assert segments_from_doc_ids(torch.tensor([0, 0, 1, 1, 1, 4])).tolist() == [0, 2, 5, 6]
    with pytest.raises(ValueError, match=r"doc_ids must be 1-D \(tokens,\), got shape \(1, 3\)"):
        segments_from_doc_ids(torch.tensor([[0, 0, 1]]))
    with pytest.raises(TypeError, match="doc_ids must be a torch.Tensor, got list"):
        segments_from_doc_ids([0, 0, 1])


def test_the_default_data_of_a_git_checkout_is_what_git_tracks(tmp_path, monkeypatch):
    """The default root (this repository) gives the files git tracks, in the walk's order, so that a bench's or a
    test's outputs there (git-ignored, or not yet added) do not change the default data between two runs of a
    recipe; a root that is not a checkout is walked as before."""
    import shutil
    import subprocess

    from fa4dist.data import packing

    if shutil.which("git") is None:
        pytest.skip("no git")
    root = _tree(tmp_path)
    (root / ".gitignore").write_text("out/\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "a.txt", "b.py", "sub/d.txt", ".gitignore"], check=True)
    subprocess.run(git + ["commit", "-qm", "docs"], check=True)
    (root / "out").mkdir()
    (root / "out" / "bench.json").write_text('{"a bench": "output"}')  # ignored
    (root / "sub" / "e.txt").write_text("not added yet")  # untracked
    monkeypatch.setattr(packing, "default_text_root", lambda: root)
    assert collect_documents() == ["alpha document", "print('beta')", "delta"]
    # an explicit root: every file, walked (a directory's files, then its subdirectories in order)
    assert collect_documents([root]) == ["alpha document", "print('beta')", '{"a bench": "output"}', "delta",
                                         "not added yet"]


def test_an_installed_package_in_an_ignored_folder_of_a_checkout_is_walked(tmp_path, monkeypatch):
    """uv's and poetry's layout: the package installed in a git-ignored .venv inside the user's own checkout.  git's
    list there is empty (the checkout tracks none of it), and it was trusted: 'no text files found' under a folder
    holding them.  git's list is taken only where the root is the top of its checkout."""
    import shutil
    import subprocess

    from fa4dist.data import packing

    if shutil.which("git") is None:
        pytest.skip("no git")
    project = tmp_path / "project"
    pkg = project / ".venv" / "site-packages" / "fa4dist"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("print('installed')")
    (project / ".gitignore").write_text(".venv/\n")
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", ".gitignore"], check=True)
    subprocess.run(git + ["commit", "-qm", "project"], check=True)
    assert packing._tracked_files(pkg) is None
    monkeypatch.setattr(packing, "default_text_root", lambda: pkg)
    assert collect_documents() == ["print('installed')"]


@pytest.mark.parametrize("roots, message", [
    (5, "roots must be a path or a sequence of paths \\(None: this repository\\), got int"),
    ([None], "roots must hold paths \\(str or os.PathLike\\), got NoneType"),
])
def test_roots_that_are_not_paths_are_refused_by_name(roots, message):
    with pytest.raises(TypeError, match=message):
        collect_documents(roots)


@pytest.mark.gpu
def test_segments_from_doc_ids_of_a_cuda_tensor():
    """The boundaries are built on doc_ids' device (a CPU zero beside CUDA starts failed in torch.cat)."""
    from fa4dist.data.packing import segments_from_doc_ids

    cu = segments_from_doc_ids(torch.tensor([0, 0, 1, 1, 1, 4], device="cuda"))
    assert cu.device.type == "cuda" and cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6]


def test_negative_token_ids_from_a_tokenizer_are_refused():
    """-100 is the labels' IGNORE: a tokenizer id of -100 silently dropped the previous token's target."""
    from fa4dist.data import PackedTokenStream

    class Tokenizer:
        def encode(self, text):
            return [1, -100, 2, 3]

    with pytest.raises(ValueError, match=r"tokenizer.encode\(documents\[0\]\) must return token ids >= 0, got -100"):
        PackedTokenStream(["abc"], 4, tokenizer=Tokenizer()).window(0)
