"""Pre-training the fa4dist Llama-style model with FSDP2 over data-parallel x context-parallel ranks.

    torchrun --nproc-per-node 4 recipes/fsdp2_train.py --model small --seqlen 16384 --cp 2 --steps 100

Ranks form a (dp, cp) DeviceMesh, cp innermost.  Every layer and the root are ``fully_shard``-ed over all dp x cp
ranks (ZeRO-3 style: parameters, gradients and optimizer state sharded over the whole world); inside, each
sequence is split over its cp group by the LPT plan and attention runs through ``FA4ContextParallelAttention``.
Gradients are summed over cp and averaged over dp (the loss going into the backward is multiplied by cp, and FSDP
averages over dp x cp), so the step equals a
single-process step over the same sequences.  Mixed precision: bf16 parameters/compute with fp32 gradient
reduction on GPUs (``--dtype``), fp32 on CPUs.  ``--activation-checkpointing`` recomputes each layer in the
backward.  ``--ckpt-dir`` + ``--save-every`` write torch.distributed.checkpoint checkpoints (model, optimizer,
step, LR schedule); ``--stop-at N`` stops early (saving a checkpoint there), and ``--resume latest`` with the
same ``--steps`` continues from the newest one with the same losses as a run that never stopped (a resume that
changes the schedule, the model, the data or the optimizer settings is refused).  Rank 0 prints a progress bar, and
at the end a ``SUMMARY {...}`` JSON line: tokens/s, MFU (formula in the line) and peak memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def shard_model(model, layout, dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = layout.mesh
    fsdp_mesh = mesh._flatten("dp_cp") if mesh.ndim > 1 else mesh
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
    # FSDP averages the gradients over the world (dp x cp), but the cp shares of a sequence must add: the training
    # loop multiplies its loss by cp (set_gradient_divide_factor(dp) would say the same, but it needs a PREMUL_SUM
    # reduction, which gloo lacks).
    return model


def _schedule_tensor(args) -> torch.Tensor:
    state = common.schedule_state(args)
    return torch.tensor([state["steps"], state["warmup"], state["lr"]], dtype=torch.float64)


def save_checkpoint(model, optimizer, step: int, ckpt_dir: str, rank: int, args) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    path = Path(ckpt_dir) / f"step_{step:06d}"
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step), "schedule": _schedule_tensor(args)},
             checkpoint_id=str(path))
    if rank == 0:
        common.save_run_settings(path, args, step)
    dist.barrier()
    if rank == 0:
        (Path(ckpt_dir) / "latest").write_text(path.name)
    return path


def find_checkpoint(resume: str, ckpt_dir: str, args) -> Path:
    """The checkpoint directory ``--resume`` names, checked before any process group or model exists (every rank
    alike): that it holds a checkpoint, and the settings, schedule and step recorded beside it
    (common.check_resumed_run): they used to be refused only once the model was built and sharded."""
    if resume == "latest":
        if not ckpt_dir:
            raise SystemExit("--resume latest needs --ckpt-dir")
        marker = Path(ckpt_dir) / "latest"
        if not marker.exists():
            raise SystemExit(f"no checkpoint in {ckpt_dir} (no 'latest' marker)")
        path = Path(ckpt_dir) / marker.read_text().strip()
    else:
        path = Path(resume)
    if not (path / ".metadata").is_file():  # what dcp.save writes last; without it dcp.load fails deep inside torch
        raise SystemExit(f"--resume {resume}: {str(path)!r} is not a checkpoint of this recipe (no .metadata in it)")
    common.check_resumed_run(path, args)  # before loading: another --model fails inside dcp.load
    return path


def load_checkpoint(model, optimizer, path: Path, args) -> int:
    """Loads the checkpoint :func:`find_checkpoint` found; returns its step.  The schedule stored in it is checked
    again (a checkpoint without the record beside it, an older one, is checked only here)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0), "schedule": _schedule_tensor(args)}
    dcp.load(state, checkpoint_id=str(path))
    steps, warmup, lr = state["schedule"].tolist()
    common.check_resumed_schedule(dict(steps=int(steps), warmup=int(warmup), lr=lr), args)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    common.add_checkpoint_args(p, "a checkpoint directory, or 'latest' (newest in --ckpt-dir)")
    args = p.parse_args(argv)
    common.check_common_args(p, args)
    common.check_checkpoint_args(p, args)
    if args.resume == "latest" and not args.ckpt_dir:  # (was refused on every rank once the model existed)
        p.error("--resume latest needs --ckpt-dir (the newest checkpoint in it)")
    return args


def main(argv=None):
    args = parse_args(argv)
    # refused before the process group and the model exist: a layout the world does not allow, a checkpoint that
    # is not there or does not continue this run
    common.check_layout(common.launched_world(), args.cp, args.batch_size)
    resume = find_checkpoint(args.resume, args.ckpt_dir, args) if args.resume else None

    rank, world, device = common.init_distributed(args=args)
    common.set_determinism(args)
    layout = common.make_layout(rank, world, args.cp, args.batch_size, device)
    dtype = common.compute_dtype(args, device)
    model = common.build_model(args, layout.mesh["cp"], device)
    n_params = model.num_parameters()
    model = shard_model(model, layout, dtype)
    # --cp-invariant: parameter gradients in int64 fixed point, summed over every rank in place of FSDP2's
    # reduce-scatter (installed after sharding: each rank then sets its shard of the summed gradient)
    invariant = common.install_invariant_grads(model) if args.cp_invariant else None
    optimizer = common.make_optimizer(model, args)

    start = 0
    if resume is not None:
        start = load_checkpoint(model, optimizer, resume, args)
    stream = common.build_stream(args, resumed=resume)
    per_rank = layout.sequences_per_rank
    if rank == 0:
        print(f"fsdp2: world={world} dp={layout.dp} cp={layout.cp} model={args.model} params={n_params / 1e6:.1f}M "
              f"seqlen={args.seqlen} batch={args.batch_size} dtype={dtype} packing={args.packing} "
              f"device={device} start_step={start}", flush=True)
        if args.cp_invariant:
            print(common.cp_invariant_scope(
                "attention, logits and parameter gradients (int64 fixed point, summed over every rank)"), flush=True)
    progress = common.Progress(args.steps, rank, args.metrics_out, args.log_every, start)
    peak = common.peak_flops(args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    stop = common.last_step(args, start)
    meter = common.Throughput.for_run(args, device, start, stop)
    for step in range(start, stop):
        lr = common.set_lr(optimizer, step, args)
        samples = stream.batch(step, args.batch_size, first=layout.dp_rank * per_rank, count=per_rank)
        common.sync(device)
        t0 = common.now()
        if per_rank > 1:
            model.set_requires_gradient_sync(False)
        loss_sum, _ = common.forward_backward(
            model, samples, layout, args, device,
            before_last=(lambda: model.set_requires_gradient_sync(True)) if per_rank > 1 else None,
            loss_scale=1.0 if invariant else float(layout.cp))  # FSDP2 averages over dp x cp; the int64 sum, dp
        norm = invariant.finish(divide_by=layout.dp) if invariant else None
        grad_norm = common.clip_and_step(model.parameters(), optimizer, args, norm=norm)
        loss = common.step_loss(loss_sum, layout)
        common.sync(device)
        seconds = common.now() - t0
        tokens = args.batch_size * args.seqlen
        flops = model.training_flops([s.cu_seqlens for s in stream.batch(step, args.batch_size)])
        meter.add(step, seconds, tokens, flops)
        progress.update(step, loss=loss, lr=lr,
                        grad_norm=float(grad_norm) if grad_norm is not None else None,
                        tokens_per_s=tokens / seconds, step_s=seconds,
                        peak_mem_gib=common.peak_memory_gib(device))
        if common.saves_checkpoint(args, step + 1, stop):
            save_checkpoint(model, optimizer, step + 1, args.ckpt_dir, rank, args)
    progress.close()

    mem = common.max_peak_memory_gib(device)
    digest = common.weights_hash(model) if args.cp_invariant else None  # whole weights: every rank takes part
    if rank == 0:
        print(common.summary_line(
            recipe="fsdp2", model=args.model, params=n_params, world=world, dp=layout.dp, cp=layout.cp,
            seqlen=args.seqlen, batch_size=args.batch_size, packing=args.packing, dtype=str(dtype).split(".")[-1],
            activation_checkpointing=args.activation_checkpointing, **meter.summary(peak, world),
            peak_mem_gib=mem, flop_formula=common.FLOP_FORMULA,
            attention_backend=args.backend, cp_invariant=args.cp_invariant, weights_sha256=digest,
        ), flush=True)
    common.finish_distributed()


if __name__ == "__main__":
    common.run_main(main)
