"""One attention block through the forward's entry forms, side by side: where a ring step's work-list launch loses
against the same block as a plain call.

The block is q rows x k keys (dense, batch 1, bf16), non-causal by default (a ring's remote step block), timed in
interleaved rounds in one process, each form against the same inputs:

- ``plain``: ``attention_forward`` (16-bit out: what the ring simulation's "kernel" column runs per item);
- ``merge``: ``attention_forward`` with ``accumulate=True`` into a running fp32 (out, lse) (the dense fused merge);
- ``items_fresh``: ``attention_forward_items`` with the block as one work item, ``fresh=True`` (fp32 out written);
- ``items_merge``: the same merged into a running fp32 (out, lse) (a ring step's launch);
- ``items_split``: the block cut into ``--split`` key ranges, one work item each, merged in turn (a row's blocks
  over several steps).

``--variants`` repeats every form under cute forward overrides (``FA4DIST_FWD_OVERRIDE`` fields, e.g.
``chained_max=1`` or ``persistent_ctas=132``); ``default`` is the defaults. Torch's SDPA flash and cuDNN forward
run in the same rounds as the baselines.

    python bench/item_forms.py --q-rows 16384 --k-rows 16384 --heads 16
    python bench/item_forms.py --variants default chained_max=1 persistent_ctas=132,chained_max=1

Prints TFLOP/s and each form's ratio to ``plain`` under the defaults; writes JSON to $OUT/item_forms.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4dist.kernels import WorkItem, attention_forward, attention_forward_items  # noqa: E402
from fa4dist.kernels.cute import forward as cute_fwd  # noqa: E402
from fa4dist.kernels.mask import visible_pairs  # noqa: E402
from timing import cuda_median_ms  # noqa: E402


def forms(q, k, v, causal: bool, split: int) -> dict:
    """name -> a call of that form on (q, k, v)."""
    b, n, h, d = q.shape
    m = k.shape[1]
    out32 = torch.zeros(b, n, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
    mask = dict(causal=causal)
    whole = [WorkItem(0, n, 0, m, **mask)]
    step = -(-m // split)
    pieces = [WorkItem(0, n, s, min(step, m - s), 0, s, **mask) for s in range(0, m, step)]
    return {
        "plain": lambda: attention_forward(q, k, v, backend="cute", **mask),
        "merge": lambda: attention_forward(q, k, v, out=out32, lse=lse, accumulate=True, backend="cute", **mask),
        "items_fresh": lambda: attention_forward_items(q, k, v, whole, out32, lse, fresh=True, backend="cute"),
        "items_merge": lambda: attention_forward_items(q, k, v, whole, out32, lse, backend="cute"),
        "items_split": lambda: attention_forward_items(q, k, v, pieces, out32, lse, backend="cute"),
    }


def baselines(q, k, v, causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel([backend]):
                return sdpa(qt, kt, vt, is_causal=causal)
        try:
            call()
        except RuntimeError as err:
            print(f"# {name} unavailable: {str(err).splitlines()[0]}")
            continue
        out[name] = call
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--q-rows", type=int, default=16384)
    p.add_argument("--k-rows", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--causal", action="store_true", help="a causal block (q and k at the same positions)")
    p.add_argument("--split", type=int, default=4, help="key ranges of items_split")
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="cute forward overrides per variant ('default': none), e.g. chained_max=1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shape_q, shape_k = (1, args.q_rows, args.heads, args.headdim), (1, args.k_rows, args.heads, args.headdim)
    q = torch.randn(shape_q, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(shape_k, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pairs = visible_pairs(args.q_rows, args.k_rows, 0, 0, args.causal) * args.heads
    flops = 4 * pairs * args.headdim
    calls = {}
    for variant in args.variants:
        overrides = {} if variant == "default" else cute_fwd.parse_overrides(variant)
        for name, fn in forms(q, k, v, args.causal, args.split).items():
            calls[(variant, name)] = (overrides, fn)
    for name, fn in baselines(q, k, v, args.causal).items():
        calls[("-", name)] = ({}, fn)
    times = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, (overrides, fn) in calls.items():
            cute_fwd.set_override(**overrides)
            times[key].append(cuda_median_ms(fn, args.reps))
    cute_fwd.set_override()
    plain = statistics.median(times[("default", "plain")]) if ("default", "plain") in times else None
    print(f"item_forms: {args.q_rows} x {args.k_rows}, {args.heads} heads of {args.headdim}, bf16, "
          f"{'causal' if args.causal else 'non-causal'}, {args.rounds} rounds of median-of-{args.reps}")
    print(f"{'variant':>32} {'form':>12} {'ms':>8} {'TFLOP/s':>8} {'vs plain':>9}")
    rows = []
    for (variant, name), ts in times.items():
        ms = statistics.median(ts)
        row = dict(variant=variant, form=name, ms=ms, tflops=flops / ms / 1e9, rounds_ms=ts,
                   vs_plain=(plain / ms) if plain else None)
        rows.append(row)
        print(f"{variant:>32} {name:>12} {ms:>8.3f} {row['tflops']:>8.1f} "
              f"{'' if plain is None else format(row['vs_plain'], '9.3f')}")
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "item_forms.json")
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, **vars(args))
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
