"""The kernel benchmarks' CPU-checkable promises: bench/kernels.py's cute/cuDNN column divides by torch's cuDNN op
itself, not by our guarded sdpa_cudnn backend (JSON from before the raw baseline falls back to the guarded one);
bench/packed_tiles.py's documents, FLOPs, table and variant parsing; bench/fwd_error.py's and bench/split_error.py's
fp64 oracles; bench/lse_drift_model.py's fp32 model of the online softmax's rescale."""

import os
import bench_scripts
import pytest


def _load():
    return bench_scripts.load("kernels")


def _rows(tflops: dict):
    return [dict(backend=b, headdim=128, causal=True, seqlen=1024, direction="fwd", deterministic=False, tflops=t)
            for b, t in tflops.items()]


def test_cudnn_ratio_uses_torchs_op():
    table = _load().summary_table(_rows({"cute": 400.0, "cudnn": 500.0, "sdpa_cudnn": 100.0, "flash_attn_4": 410.0}))
    last = table.splitlines()[-1]
    assert last.endswith("| 0.80 | 0.98 |"), table


def test_cudnn_ratio_falls_back_to_the_guarded_backend():
    table = _load().summary_table(_rows({"cute": 400.0, "sdpa_cudnn": 200.0, "flash_attn_4": 400.0}))
    assert table.splitlines()[-1].endswith("| 2.00 | 1.00 |"), table


def test_packed_tiles_documents_cover_the_batch():
    """bench/packed_tiles.py cuts exactly the batch into documents (equal or mixed lengths in the stated range) and
    counts causal FLOPs over each document's visible pairs."""
    packed = bench_scripts.load("packed_tiles")
    assert packed.doc_lengths(4096, 1000, False) == [1000] * 4 + [96]
    mixed = packed.doc_lengths(65536, 512, True)
    assert sum(mixed) == 65536 and max(mixed) <= 1024 and min(mixed[:-1]) >= 128
    assert packed.causal_flops([1, 2], heads=2, headdim=8) == 4.0 * 2 * 8 * (1 + 3)
    assert packed.causal_flops([1, 2], heads=2, headdim=8, direction="bwd") == 2.5 * 4.0 * 2 * 8 * (1 + 3)
    rows = [dict(backend=b, headdim=64, doclen=512, docs=128, tflops=t)
            for b, t in (("cute", 200.0), ("cute[persistent_ctas=0]", 160.0), ("flash_attn_4", 100.0))]
    table = packed.summary_table(rows)
    assert "| 64 | 512 | 128 | 200 | 160 | 100 | 2.00 | 1.60 |" in table


def test_forward_override_text_is_typed_and_checked():
    """The packed bench's variant rows parse through the forward's own field types; a misspelt field is an error."""
    from fa4dist.kernels.cute import forward

    assert forward.parse_overrides("tile_m=128, dynamic_tiles=0,rescale_threshold=8") == dict(
        tile_m=128, dynamic_tiles=False, rescale_threshold=8.0)
    with pytest.raises(ValueError, match="forward overrides: unknown field 'tile_mm'"):
        forward.parse_overrides("tile_mm=128")


def test_backward_override_text_is_typed_and_checked():
    """The packed bench's backward rows parse through the backward's own field types."""
    from fa4dist.kernels.cute import backward

    assert backward.parse_overrides("persistent_ctas=132,det_resident=false") == dict(
        persistent_ctas=132, det_resident=False)
    with pytest.raises(ValueError, match="backward overrides: unknown field 'persistent'"):
        backward.parse_overrides("persistent=1")


def test_ncu_scripts_parse_cases_and_read_the_committed_counters(capsys):
    """bench/ncu_kernels.py's case strings, and bench/ncu_summary.py over the thirteenth session's counters: the
    per-kernel table and the side-by-side stalls (our 1k causal backward's main kernel is launch 2, 430 us)."""
    ncu = bench_scripts.load("ncu_kernels")
    assert ncu.parse_case("bwd:128:1024:causal:det") == dict(direction="bwd", headdim=128, seqlen=1024, causal=True,
                                                             deterministic=True)
    for bad in ("fwd:128:1024:causal:det", "bwd:128:1024", "bwd:128:1024:yes"):
        with pytest.raises(SystemExit, match="--cases"):
            ncu.parse_case(bad)
    summary = bench_scripts.load("ncu_summary")
    results = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
    summary.raw(os.path.join(results, "2026-12-02-thirteenth-ncu-raw.csv.gz"), [(2, 5)])
    out = capsys.readouterr().out
    assert "| 2 | kernel_cutlass_kernel_fa4distkernelscute | 430.4 | 132 |" in out
    assert "lg_throttle" in out and "smsp__sass_inst_executed_op_global_st.sum" in out
    # the fourteenth session's source pages (hdim-64 forward, 16k, ours against flash-attn-4): the extra samples sat
    # on the MUFUs, with the instructions executed within 1% (the same instruction mix, scheduled differently)
    pages = [os.path.join(results, f"2026-12-02-fourteenth-ncu-sass-{who}-fwd-d64-full-16k.csv.gz")
             for who in ("cute", "fa4")]
    summary.compare(*pages)
    out = capsys.readouterr().out
    mufu = next(line.split() for line in out.splitlines() if line.split()[:1] == ["MUFU"])
    assert float(mufu[3]) > 20000  # ours - theirs, warp samples
    executed = next(line for line in out.splitlines() if line.startswith("instructions executed"))
    ours, theirs = (float(x) for x in executed.split("totals ")[1].rstrip(")").split(" / "))
    assert abs(ours / theirs - 1) < 0.01


def test_compile_logs_replay_as_an_aot_set(tmp_path):
    """bench/cute_session_dev.py --set log:PATH: the configs a GPU run had to compile (FA4DIST_CUTE_COMPILE_LOG),
    read back as literals (the fourteenth session's suites: 81 forward, 10 backward, 6 + 6 pre / post variants),
    equal to the configs the code builds for the same call; anything but a config repr is refused."""
    pytest.importorskip("cutlass")
    torch = pytest.importorskip("torch")
    dev = bench_scripts.load("cute_session_dev")
    from fa4dist.kernels.cute import forward

    results = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
    cfgs = dev.logged_configs(os.path.join(results, "2026-12-02-fourteenth-compiled-suites.txt"))
    names = [type(c).__name__ for c in cfgs]
    assert (names.count("FwdConfig"), names.count("BwdConfig"), names.count("PreConfig"),
            names.count("PostConfig")) == (81, 10, 6, 6)
    made = forward.make_config(torch.bfloat16, 64, causal=True, varlen=False, accumulate=False)
    log = tmp_path / "compiled.txt"
    log.write_text(repr(made) + "\n")
    assert dev.logged_configs(str(log)) == [made]
    log.write_text("__import__('os').system('true')\n")
    with pytest.raises(SystemExit, match="not a config repr"):
        dev.logged_configs(str(log))


def test_host_python_runs_on_cpu_tensors():
    """bench/host_python.py's default (CPU tensors, no-op launches) runs the contract end to end: the forward's
    reusable tile counter is a CUDA stream's, so off CUDA the host must hand a fresh one instead of asking CUDA."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "host_python.py")
    run = subprocess.run([sys.executable, script, "--calls", "5", "--loops", "1"], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "forward+backward:" in run.stdout, run.stdout


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_error_oracle_is_the_reference_attention(causal):
    """bench/fwd_error.py's fp64 oracle, chunked over queries, equals the reference backend in fp64 (causal with the
    diagonal at the start), so its error column measures the kernels, not the oracle."""
    import torch

    from fa4dist.kernels import attention_forward

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 300, 3, 64, dtype=torch.float64, generator=gen) for _ in range(3))
    got = bench_scripts.load("fwd_error").fp64_attention(q, k, v, causal, chunk=128)
    want = attention_forward(q, k, v, causal=causal, backend="reference")[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_split_error_oracle_is_the_reference_attention():
    """bench/split_error.py's fp64 lse and out of chosen query rows (chunked, GQA expanded, causal with a query
    offset) equal the reference backend's rows in fp64."""
    pytest.importorskip("cutlass")
    import torch

    from fa4dist.kernels import attention_forward

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(200, 4, 64, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(260, 2, 64, dtype=torch.float64, generator=gen) for _ in range(2))
    rows = torch.tensor([0, 3, 64, 65, 130, 199])
    lse, out = bench_scripts.load("split_error").fp64_rows(q, k, v, True, 60, rows, chunk=4)
    want_o, want_l = attention_forward(q[None], k[None], v[None], causal=True, q_offset=60, backend="reference")
    torch.testing.assert_close(out, want_o[0, rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_l[0][:, rows], rtol=1e-12, atol=1e-12)


def test_lse_drift_model_separates_the_rescale_forms():
    """The fp32 model of a row's online softmax: with the fused rescale argument (m_old * c - m_new * c, one
    rounding) the lse drifts with the number of key tiles; with the difference of the maxima, or of maxima stored in
    log2 units (the kernels' form), it does not."""
    import numpy as np

    model = bench_scripts.load("lse_drift_model")
    rng = np.random.default_rng(3)
    for keys, tile in ((4096, 128), (32768, 128)):
        err = {form: max(model.row_lse_error(rng, keys, tile, form) for _ in range(20)) for form in model.FORMS}
        assert err["difference"] < 2e-6 and err["stored"] < 2e-6, (keys, err)
        if keys == 32768:  # 256 tiles: the drift is several times the other forms' error
            assert err["fused"] > 4 * max(err["difference"], err["stored"]), err


def test_bench_scripts_take_bench_kernels_by_its_path(monkeypatch):
    """A module named ``kernels`` imported first (Hugging Face's package, once transformers is imported) must not
    stand in for bench/kernels.py: the scripts that reuse it load it through bench/sibling.py, by its path, and no
    script imports it by name."""
    import re
    import sys
    import types

    monkeypatch.setitem(sys.modules, "kernels", types.ModuleType("kernels"))
    monkeypatch.delitem(sys.modules, "fa4dist_bench_kernels", raising=False)
    for name in ("fwd_error", "ncu_kernels"):
        bench_scripts.load(name)
    assert hasattr(sys.modules["fa4dist_bench_kernels"], "_make_fn")
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
    bare = re.compile(r"^\s*(from kernels import|import kernels\b)", re.M)
    for script in sorted(os.listdir(bench)):
        if script.endswith(".py"):
            with open(os.path.join(bench, script)) as f:
                assert not bare.search(f.read()), f"bench/{script} imports bench/kernels.py by name"
