"""Where the forward's softmax work lands in the SASS, on the CPU: the PV wait, the O rescale and the P conversion
placed against the step's exponentials.

ptxas schedules the step (two rows' max, exp2, sum; the O rescale; P to 16 bits) by its own heuristics, and the
order it picks decides how much of the MUFU queue's shadow the other work fills. The fourteenth session's
counters found our hdim-64 forward with every O-rescale FMUL after the step's last exp2 (flash-attn-4's after its
~13th) and the MUFUs waiting on a full MIO queue. This compiles one forward variant for sm_90a (no GPU), runs
ptxas and nvdisasm, and for every main-loop step (from the S wait, `WARPGROUP.DEPBAR.LE gsb0, 0x1`, to the next
HGMMA) prints how many exp2 precede the PV wait, the first and last O-rescale FMUL and the P conversions.
``--fa4`` does the same for flash-attn-4's forward (where installed: it compiles on the CPU under torch's
FakeTensorMode, its PTX kept with CUTE_DSL_KEEP), so the two schedules compare without a GPU; the local ptxas
reproduced the placements the GPU machine's SASS showed (hdim 64: its PV wait after exp2 #11-12, FMULs #13-19).

    python bench/sass_softmax.py --headdim 64 [--causal [--window-left 4095]] [--set sum_from_old=false] [--fa4] \\
        [--ops] [--ptxas /usr/local/cuda/bin/ptxas] [--nvdisasm nvdisasm]
    python bench/sass_softmax.py --backward --headdim 64 --ops [--deterministic] [--set try_waits=true] [--fa4]
    python bench/sass_softmax.py --backward --headdim 128 --causal --ops --softcap 30   # the capped step

``--ops`` counts the instructions of the main loop's step by opcode (the innermost loop with 32+ exp2): what every
warp issues per key tile, the quantity Nsight Compute's per-step counts gave in the fifteenth session.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _tool(name: str, given: str | None) -> str:
    path = given or shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))), None)
    if not path:
        raise SystemExit(f"{name} not found: pass --{name} PATH")
    return path


def ours_ptx(cfg, folder: str) -> str:
    """Compile our variant (forward or backward config) with its PTX kept in ``folder`` (named explicitly: the DSL
    otherwise keeps every PTX of a process in the working directory of its first compile)."""
    from fa4dist.kernels.cute import host

    host.compile_config(cfg, extra_options=f"--keep-ptx --dump-dir={folder}")
    return glob.glob(os.path.join(folder, "*.ptx"))[0]


def fa4_ptx(head_dim: int, causal: bool, folder: str, backward: bool = False) -> str:
    """Compile flash-attn-4's forward (or its backward, called directly: autograd would need a CUDA device) for
    sm_90a on the CPU (fake CUDA tensors of bench/kernels.py's shapes at 16k: its tile sizes do not depend on the
    length) and return its PTX."""
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132", CUTE_DSL_KEEP="ptx",
                      CUTE_DSL_DUMP_DIR=folder)
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.interface import _flash_attn_bwd

    heads = 2048 // head_dim
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, out, dout = (torch.empty(1, 16384, heads, head_dim, dtype=torch.bfloat16, device="cuda")
                              for _ in range(5))
        if backward:
            lse = torch.empty(1, heads, 16384, dtype=torch.float32, device="cuda")
            _flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
        else:
            flash_attn_func(q, k, v, causal=causal)
    kernel = "BackwardSm90" if backward else "Forward"
    return [p for p in glob.glob(os.path.join(folder, "*.ptx")) if kernel in p][0]


def sass_of(ptx: str, ptxas: str, nvdisasm: str, labels: bool = False) -> list[str]:
    """The SASS instructions of a PTX file, in order (``labels``: with the branch targets' label lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        text = re.sub(r"^\.version 9\.\d+", ".version 9.0", open(ptx).read(), flags=re.M)  # older ptxas
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(text)
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([ptxas, "-arch=sm_90a", "-O3", os.path.join(tmp, "k.ptx"), "-o", cubin], check=True)
        listing = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    out = []
    for ln in listing.splitlines():
        if re.search(r"/\*[0-9a-f]{4,}\*/", ln):
            out.append(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", ln).split(";")[0].strip())
        elif labels and re.match(r"^\.L_\w+:", ln.strip()):
            out.append(ln.strip())
    return out


def _opcode(t: str) -> str:
    words = t.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def main_loop_opcodes(lines: list[str]):
    """The opcode counts of the innermost loop (a label, then a branch back to it) with the most exp2: the main
    loop's step, what every warp issues per key tile. None if no loop holds 32 exp2."""
    where = {ln[:-1]: i for i, ln in enumerate(lines) if ln.startswith(".L_") and ln.endswith(":")}
    best = None
    for j, t in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_\w+)", t)
        if not m or where.get(m.group(1), j) >= j:
            continue
        body = [x for x in lines[where[m.group(1)]:j + 1] if not x.startswith(".L_")]
        mufu = sum("MUFU.EX2" in x for x in body)
        if mufu >= 32 and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return None
    counts = {}
    for t in best:
        counts[_opcode(t)] = counts.get(_opcode(t), 0) + 1
    return counts


def softmax_steps(ins: list[str]):
    """Per step with at least 32 exp2: (length, exp2 count, exp2 before the PV wait, exp2 before each O-rescale
    FMUL (in-place FMUL of a register), exp2 before each P conversion)."""
    for i, op in enumerate(ins):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in op:
            continue
        mufu, pv_wait, rescale, convert = 0, None, [], []
        j = i + 1
        while j < len(ins) and "HGMMA" not in ins[j]:
            t = ins[j]
            mufu += "MUFU.EX2" in t
            if "DEPBAR.LE gsb0, 0x0" in t and pv_wait is None:
                pv_wait = mufu
            m = re.match(r"(@\S+\s+)?FMUL (R\d+), (R\d+), R\d+", t)
            if m and m.group(2) == m.group(3):
                rescale.append(mufu)
            if t.startswith("F2FP") or " F2FP" in t:
                convert.append(mufu)
            j += 1
        if mufu >= 32:
            yield j - i, mufu, pv_wait, rescale, convert


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--short", action="store_true", help="the short-sequence tiles (forward.short_queries)")
    p.add_argument("--window-left", type=int, default=-1, help="with --causal: a sliding window's lower edge")
    p.add_argument("--set", default="", help="FwdConfig overrides, e.g. sum_from_old=false,rescale_threshold=8 "
                   "(BwdConfig's with --backward)")
    p.add_argument("--backward", action="store_true",
                   help="the backward's main kernel instead (dense bf16 fresh gradients, --deterministic; with --ops)")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--softcap", type=float, default=0.0, help="soft-capped scores (tanh), forward or backward")
    p.add_argument("--fa4", action="store_true", help="flash-attn-4's forward of the same head dim and mask instead")
    p.add_argument("--ops", action="store_true", help="also the main loop's instructions per step, by opcode")
    p.add_argument("--ptxas")
    p.add_argument("--nvdisasm")
    args = p.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import torch

    from fa4dist.kernels.cute import forward as F

    tools = _tool("ptxas", args.ptxas), _tool("nvdisasm", args.nvdisasm)
    with tempfile.TemporaryDirectory() as tmp:
        if args.fa4:
            print(f"flash-attn-4 {'backward' if args.backward else 'forward'}, hdim {args.headdim}, "
                  f"{'causal' if args.causal else 'full'}")
            ptx = fa4_ptx(args.headdim, args.causal, tmp, args.backward)
        elif args.backward:
            from fa4dist.kernels.cute import backward as B

            bf16 = torch.bfloat16
            _, cfg, _ = B.make_configs(bf16, args.headdim, causal=args.causal, varlen=False, seg_offsets=False,
                                       accumulate=False, deterministic=args.deterministic, dq_dtype=bf16,
                                       dkv_dtype=bf16, o_dtype=bf16, do_dtype=bf16, max_seqlen_k=16384,
                                       window_left=args.window_left, softcap=args.softcap,
                                       **B.parse_overrides(args.set))
            print(cfg)
            ptx = ours_ptx(cfg, tmp)
        else:
            cfg = F.make_config(torch.bfloat16, args.headdim, causal=args.causal, varlen=False, accumulate=False,
                                short=args.short, window_left=args.window_left, softcap=args.softcap,
                                **F.parse_overrides(args.set))
            print(cfg)
            ptx = ours_ptx(cfg, tmp)
        lines = sass_of(ptx, *tools, labels=True)
        ins = [t for t in lines if not t.startswith(".L_")]

    def span(xs):
        return f"{len(xs)} after exp2 #{xs[0]}..#{xs[-1]}" if xs else "none"

    for length, mufu, pv_wait, rescale, convert in ([] if args.backward else softmax_steps(ins)):
        print(f"step: {length} instructions, {mufu} exp2; PV wait after exp2 #{pv_wait}; O-rescale FMULs "
              f"{span(rescale)}; P conversions {span(convert)}")
    if args.ops:
        counts = main_loop_opcodes(lines)
        if counts is None:
            print("no loop with 32 exp2 found")
        else:
            print(f"main loop: {sum(counts.values())} instructions per step: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))))


if __name__ == "__main__":
    main()
