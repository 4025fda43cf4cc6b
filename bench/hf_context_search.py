"""The largest context a transformers model trains at with fa4dist context parallelism, FSDP2 and activation
checkpointing: one job builds the model once (recipes/hf_sft.py), then runs one training step per context length,
longer each time, recording each try's step time, peak memory and where the memory goes.

    torchrun --nproc-per-node 2 bench/hf_context_search.py --model llama3-8b --cp 2 --activation-checkpointing \
        --seqlens 131072 196608 --budget-s 150 --out results.jsonl

After the given lengths, a linear fit of peak memory over tokens (from the last two tries that fitted) picks the
next length: the largest multiple of ``--granularity`` predicted to fit in ``--fill`` of the device memory; then it
keeps adding ``--granularity`` until a try runs out of memory or the time budget (each try's time predicted from
the last) is spent.  The first out-of-memory ends the search (a model whose step failed half-way is not reused).
Adam's state is allocated before the first try, so every try's peak includes it.  One JSON line per try in
``--out`` (rank 0), flushed as it goes ("started" before the try, its result after), and a table on stdout.

When only some ranks run out of memory, the others wait in a collective that will never complete: the process
group's timeout (``--timeout-s``) then ends the job, and the try stays "started" without a result in ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
# The script's own folder (Python puts it first on the path) holds bench/kernels.py, which shadows Hugging Face's
# `kernels` package: transformers imports that package when it is installed, and got our benchmark instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO / "recipes"))

import common  # noqa: E402
import hf_sft  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144], help="lengths to try first")
    p.add_argument("--granularity", type=int, default=32768, help="predicted lengths are multiples of this")
    p.add_argument("--fill", type=float, default=0.97, help="fraction of device memory a predicted try may use")
    p.add_argument("--max-seqlen", type=int, default=1 << 23)
    p.add_argument("--max-tries", type=int, default=6)
    p.add_argument("--budget-s", type=float, default=150.0, help="stop before a try predicted to end past this")
    p.add_argument("--memory-gib", type=float, default=None, help="device memory to plan with (default: the GPU's)")
    p.add_argument("--out", default=None, help="JSON lines, one per try (rank 0)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="process-group timeout (ends a job stuck after an "
                   "out-of-memory on some ranks)")
    own, rest = p.parse_known_args(argv)
    recipe = hf_sft.parse_args(rest + ["--seqlen", str(own.seqlens[0]), "--batch-size", "1", "--steps", "1",
                                       "--memory-report"])
    return own, recipe


def one_step(step, handle, optimizer, stream_args, layout, device, facts, index):
    """One training step at ``stream_args.seqlen``: (seconds, phases, flops)."""
    stream = common.build_stream(stream_args)
    samples = stream.batch(index, 1)
    phases = {"static": hf_sft._mem(device)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    common.sync(device)
    t0 = time.perf_counter()
    hf_sft.forward_backward(step, handle, samples, layout, device, phases)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    common.sync(device)
    seconds = time.perf_counter() - t0
    phases["peak_step"] = hf_sft._peak(device)
    return seconds, phases, hf_sft.training_flops(facts, [s.cu_seqlens for s in samples])


def next_length(tries, own, capacity_gib):
    """The next length to try after the given ones, or None."""
    fitted = [t for t in tries if t["ok"]]
    if not fitted or not tries[-1]["ok"]:
        return None
    last = tries[-1]["seqlen"]
    if len(tries) < len(own.seqlens):
        return own.seqlens[len(tries)]
    if len(fitted) >= 2:
        (t0, m0), (t1, m1) = [(t["seqlen"], t["peak_gib"]) for t in fitted[-2:]]
        slope = (m1 - m0) / (t1 - t0) if t1 != t0 else 0.0
        if slope > 0:
            predicted = t1 + (own.fill * capacity_gib - m1) / slope
            jump = int(predicted // own.granularity) * own.granularity
            if jump > last + own.granularity and not any(t["seqlen"] == jump for t in tries):
                return min(jump, own.max_seqlen)
    candidate = last + own.granularity
    return candidate if candidate <= own.max_seqlen else None


def main(argv=None):
    own, args = parse_args(argv)
    start = time.perf_counter()
    rank, world, device = common.init_distributed(timeout_s=own.timeout_s)
    common.set_determinism(args)
    layout = common.make_layout(rank, world, args.cp, 1, device)
    dtype = common.compute_dtype(args, device)
    step, handle, model, facts = hf_sft.prepare(args, layout, device, dtype)
    optimizer = common.make_optimizer(step, args)
    hf_sft.preallocate_adam_state(optimizer)
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # the weights do not matter here; keep them as initialized
    capacity = own.memory_gib or (torch.cuda.get_device_properties(device).total_memory / 2**30
                                  if device.type == "cuda" else 1.0)
    peak_flops = common.peak_flops(args, device)
    out = open(own.out, "a") if (own.out and rank == 0) else None
    if rank == 0:
        print(f"hf_context_search: {args.model} ({facts['params'] / 1e9:.2f}B params) cp={layout.cp} world={world} "
              f"setup {time.perf_counter() - start:.1f}s, device memory {capacity:.1f} GiB", flush=True)
    tries: list[dict] = []
    seqlen = own.seqlens[0]
    while seqlen is not None and len(tries) < own.max_tries:
        elapsed = time.perf_counter() - start
        if tries:
            predicted = tries[-1]["step_s"] * seqlen / tries[-1]["seqlen"] * 1.15
            if elapsed + predicted > own.budget_s:
                if rank == 0:
                    print(f"stop: a {seqlen}-token try would take ~{predicted:.0f}s, {own.budget_s - elapsed:.0f}s "
                          "left", flush=True)
                break
        args.seqlen = seqlen
        record = dict(seqlen=seqlen, local_tokens=-(-seqlen // layout.cp), cp=layout.cp, world=world,
                      model=args.model, params=facts["params"], capacity_gib=round(capacity, 2),
                      activation_checkpointing=args.activation_checkpointing, tile_mlp=args.tile_mlp,
                      offload_checkpoints=args.offload_checkpoints, loss=args.loss)
        if out:
            out.write(json.dumps(dict(record, status="started"), sort_keys=True) + "\n")
            out.flush()
        try:
            seconds, phases, flops = one_step(step, handle, optimizer, args, layout, device, facts, len(tries))
            ok = torch.ones(1, device=device)
        except torch.cuda.OutOfMemoryError as err:
            seconds, phases, flops, ok = None, {}, None, torch.zeros(1, device=device)
            record["error"] = str(err).splitlines()[0][:300]
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank stops when one ran out of memory
        peak = torch.tensor([phases.get("peak_step", 0.0)], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        record.update(status="ok" if ok.item() else "out of memory", ok=bool(ok.item()),
                      step_s=round(seconds, 3) if seconds else None, peak_gib=round(float(peak), 3),
                      measured_gib={k: round(v, 3) for k, v in phases.items()},
                      estimated_gib={k: (round(v, 3) if v is not None else None) for k, v in
                                     hf_sft.memory_estimates(facts, record["local_tokens"], world, args,
                                                             dtype).items()})
        if seconds:
            record.update(tokens_per_s=round(seqlen / seconds, 1),
                          mfu=round(flops / seconds / (peak_flops * world), 4) if peak_flops else None)
        tries.append(record)
        if rank == 0:
            print(f"try {seqlen}: {'ok' if record['ok'] else 'out of memory'}, peak {record['peak_gib']:.1f} GiB"
                  + (f", {seconds:.1f}s" if seconds else ""), flush=True)
            if out:
                out.write(json.dumps(record, sort_keys=True) + "\n")
                out.flush()
        if not record["ok"]:
            break
        seqlen = next_length(tries, own, capacity)
    if rank == 0:
        best = max((t["seqlen"] for t in tries if t["ok"]), default=None)
        print("| seqlen | ok | step s | tokens/s | MFU | peak GiB | after forward GiB |")
        print("|---|---|---|---|---|---|---|")
        for t in tries:
            m = t["measured_gib"]
            print(f"| {t['seqlen']} | {t['ok']} | {t['step_s'] or '-'} | {t.get('tokens_per_s', '-')} | "
                  f"{t.get('mfu', '-')} | {t['peak_gib']} | {m.get('after_forward', '-')} |")
        print("SEARCH " + json.dumps(dict(largest_ok=best, tries=len(tries), model=args.model, cp=layout.cp,
                                          seconds=round(time.perf_counter() - start, 1)), sort_keys=True), flush=True)
        if out:
            out.close()
    del step, model, optimizer
    gc.collect()
    handle.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
