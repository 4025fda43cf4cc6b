"""Read Nsight Compute's CSV pages (from bench/ncu_kernels.py runs) into the few tables we compare kernels by.

    python bench/ncu_summary.py raw RAW.csv[.gz] [--pairs 2:5 8:11]   # `ncu --import R --page raw --csv`
    python bench/ncu_summary.py source SASS.csv[.gz] [...]           # `--page source --csv --print-source sass`
    python bench/ncu_summary.py compare OURS.csv[.gz] THEIRS.csv[.gz]  # two source pages: where the samples differ

raw: per kernel (launch ID) its time, grid, registers, tensor-pipe and shared-pipe activity, issue activity, bank
conflicts and DRAM; with --pairs A:B (ours:theirs), the warp stall reasons per issued instruction side by side and
the SASS operation counts (spills, global / shared / TMA operations). source: the share of warp samples per stall
reason and per opcode, and the 25 instructions with the most samples. compare: two source pages' samples per
stall reason and per opcode, and instructions executed per opcode, with their differences.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def _open(path):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return float("nan")


METRICS = [
    ("us", "gpu__time_duration.sum", 1000.0),  # the page reports ms
    ("grid", "launch__grid_size", 1),
    ("regs", "launch__registers_per_thread", 1),
    ("tensor%", "TPC.TriageCompute.sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed", 1),
    ("smem pipe%", "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active", 1),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("bank confl.", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", 1),
    ("dram%", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
]


def raw(path: str, pairs: list[tuple[int, int]]):
    rows = list(csv.reader(_open(path)))
    hdr, data = rows[0], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    print("| ID | kernel | " + " | ".join(m[0] for m in METRICS) + " |")
    print("|" + "---|" * (len(METRICS) + 2))
    for r in data:
        vals = [_num(r[col[k]]) * s if k in col else float("nan") for _, k, s in METRICS]
        print(f"| {r[col['ID']]} | {r[col['Kernel Name']][:40]} | " + " | ".join(f"{v:.4g}" for v in vals) + " |")
    if not pairs:
        return
    by_id = {int(r[col["ID"]]): r for r in data}
    prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    stalls = [h for h in hdr if h.startswith(prefix) and h.endswith(suffix)]
    ops = [h for h in hdr if ("sass_inst_executed_op_" in h and h.endswith(".sum")) or h.endswith("_spilling")]
    print("\nwarp stalls per issued instruction, " + ", ".join(f"{a} / {b}" for a, b in pairs))
    for h in stalls + ops:
        vals = [(_num(by_id[a][col[h]]), _num(by_id[b][col[h]])) for a, b in pairs]
        if max(max(v) for v in vals) < (0.05 if h in stalls else 1):
            continue
        name = h[len(prefix):-len(suffix)] if h in stalls else h
        print(f"  {name[:52]:52s} " + "  ".join(f"{x:9.3g} / {y:<9.3g}" for x, y in vals))


def _source_counts(path: str):
    """(header, rows, stall-reason columns, samples per reason, samples per opcode, instructions executed per
    opcode) of one `--page source` CSV."""
    rows = list(csv.reader(_open(path)))
    hdr, data = rows[1], rows[2:]
    i_all, i_src, i_exec = (hdr.index(h) for h in ("Warp Stall Sampling (All Samples)", "Source",
                                                   "Instructions Executed"))
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    by_reason, by_op, executed = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        for i in reasons:
            by_reason[hdr[i][6:]] += int(r[i] or 0)
        words = r[i_src].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        by_op[op.split(".")[0]] += int(r[i_all] or 0)
        executed[op.split(".")[0]] += int(_num(r[i_exec] or "0"))
    return hdr, data, reasons, by_reason, by_op, executed


def source(path: str):
    hdr, data, reasons, by_reason, by_op, _ = _source_counts(path)
    i_all, i_src = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Source")
    total = sum(int(r[i_all] or 0) for r in data)
    print(f"{path}: {len(data)} SASS instructions, {total} warp samples")
    print("  by stall reason: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_reason.most_common(10)))
    print("  by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_op.most_common(14)))
    for r in sorted(data, key=lambda r: -int(r[i_all] or 0))[:25]:
        top = sorted(((int(r[i] or 0), hdr[i][6:]) for i in reasons), reverse=True)[:2]
        print(f"  {int(r[i_all]) / total:6.1%}  {r[i_src].strip()[:64]:64s} {top}")


def compare(ours: str, theirs: str):
    """Two kernels' source pages side by side: where the extra warp samples sit (by opcode and by stall reason),
    and whether the instruction mix differs (instructions executed per opcode). Samples are taken at a fixed rate,
    so with equal instruction counts the extra samples are the extra time."""
    a, b = _source_counts(ours)[3:], _source_counts(theirs)[3:]
    for title, i, n in (("warp samples by stall reason", 0, 12), ("warp samples by opcode", 1, 12),
                        ("instructions executed by opcode", 2, 12)):
        print(f"{title}: ours, theirs, ours - theirs (totals {sum(a[i].values()):.4g} / {sum(b[i].values()):.4g})")
        keys = sorted(set(a[i]) | set(b[i]), key=lambda k: -abs(a[i][k] - b[i][k]))[:n]
        for k in keys:
            print(f"  {k[:22]:22s} {a[i][k]:12.4g} {b[i][k]:12.4g} {a[i][k] - b[i][k]:+12.4g}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("page", choices=["raw", "source", "compare"])
    p.add_argument("paths", nargs="+")
    p.add_argument("--pairs", nargs="*", default=[], help="raw: launch IDs to compare, ours:theirs")
    args = p.parse_args()
    if args.page == "compare":
        if len(args.paths) != 2:
            p.error("compare takes two source pages: ours and theirs")
        compare(*args.paths)
        return
    for path in args.paths:
        if args.page == "raw":
            raw(path, [tuple(int(x) for x in pair.split(":")) for pair in args.pairs])
        else:
            source(path)


if __name__ == "__main__":
    main()
