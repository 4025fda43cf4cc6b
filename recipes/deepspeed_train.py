"""Pre-training the fa4dist Llama-style model with DeepSpeed ZeRO (stage 2 or 3) and context parallelism.

    torchrun --nproc-per-node 4 recipes/deepspeed_train.py --zero-stage 3 --cp 2 --model small --seqlen 16384

Our cp group is DeepSpeed's *sequence-parallel* group: the recipe hands ``deepspeed.initialize`` an ``mpu`` whose
sequence-parallel group is the cp group and whose sequence-data-parallel group is all dp x cp ranks.  DeepSpeed
then shards parameters/gradients/optimizer state over all ranks and divides the summed gradients by dp (not by
dp x cp): gradients are summed over cp and averaged over dp, which with our loss (each cp rank's share is its
local summed loss over the sequence's token count) is exactly the single-process gradient.  With cp = 1 no mpu is
passed and DeepSpeed does plain data parallelism.

``recipes/ds_config.json`` is the base config; the recipe fills in what depends on the run (micro batch 1 packed
sequence, gradient accumulation = sequences per dp rank, train batch, ZeRO stage, bf16, clipping).  A
``--ds-config`` may set those where they agree with the run (or say "auto", as HF-style configs do); one that
contradicts it is refused by name (it used to be overwritten), and so are an optimizer, a scheduler and an enabled
fp16, which the recipe would leave unused beside its client optimizer, schedule and --dtype.  At stage 3 the
recipe's prefetch and persistence settings are defaults: a file's own win.  The
optimizer is torch's AdamW (the same as the FSDP2 recipe and the reference), passed as a client optimizer, so no
DeepSpeed op has to be compiled.  On CPUs DeepSpeed runs on its CPU accelerator with gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

HERE = Path(__file__).resolve().parent


class ContextParallelMpu:
    """The interface DeepSpeed reads sequence parallelism from (that of ``deepspeed.runtime.sequence_parallel.
    parallel_state_sp``), backed by our groups: cp is DeepSpeed's sequence-parallel group."""

    def __init__(self, layout, seq_data_parallel_group):
        self._layout = layout
        self._sdp = seq_data_parallel_group

    def initialize_sequence_parallel(self, *args, **kwargs):  # DeepSpeed checks for this name; groups exist already
        raise RuntimeError("the sequence-parallel groups are fa4dist's cp groups; they are already initialized")

    def get_sequence_parallel_group(self):
        return self._layout.cp_group

    def get_sequence_parallel_world_size(self):
        return self._layout.cp

    def get_sequence_parallel_rank(self):
        return self._layout.cp_rank

    def get_sequence_data_parallel_group(self):
        return self._sdp

    def get_sequence_data_parallel_world_size(self):
        return self._layout.world

    def get_sequence_data_parallel_rank(self):
        return self._layout.rank

    # as in parallel_state_sp: the model-parallel names alias the sequence-parallel ones
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def ds_config(args, layout, dtype) -> dict:
    with open(args.ds_config) as f:
        cfg = json.load(f)
    file_cfg = dict(cfg)
    per_rank = layout.sequences_per_rank
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["gradient_accumulation_steps"] = per_rank
    cfg["train_batch_size"] = per_rank * layout.dp
    # --cp-invariant clips by the int64 gradients' whole norm before handing them over (FixedPointGrads.finish):
    # DeepSpeed's own norm adds partition partials in an order that depends on the world size
    cfg["gradient_clipping"] = 0.0 if args.cp_invariant else float(args.grad_clip)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = args.zero_stage
    if args.zero_stage == 3:
        # Gather the next layers' parameters on a side stream while this one computes, keep the small ones (norms)
        # resident instead of gathering them one by one, and keep a layer gathered between its recompute and its
        # backward under activation checkpointing (all three were off: every gather sat on the critical path).
        # Defaults: a --ds-config's own values win (they used to be overwritten).
        zero.setdefault("overlap_comm", True)
        zero.setdefault("stage3_param_persistence_threshold", 100_000)
        zero.setdefault("stage3_prefetch_bucket_size", 200_000_000)
        zero.setdefault("stage3_max_reuse_distance", 1_000_000_000)
    bf16 = cfg.pop("bfloat16", None)  # DeepSpeed's older name: one section, the recipe's
    bf16 = cfg.get("bf16", bf16)
    cfg["bf16"] = {**(bf16 if isinstance(bf16, dict) else {}), "enabled": dtype == torch.bfloat16}
    cfg["zero_allow_untested_optimizer"] = True
    check_layout_entries(args, file_cfg, cfg)
    return cfg


def zero3_loss_scale(args, layout) -> float:
    """ZeRO-3's reduce-scatter averages gradients over all dp x sp ranks and never scales back by the sequence-
    parallel size (ZeRO-2 divides by dp only): the loss going into the backward is multiplied by cp, as in the FSDP2
    recipe, so the cp shares add up (checked in tests/recipes/test_recipes_deepspeed.py).  (The earlier workaround,
    its all-reduce path, moved twice the gradient bytes and held whole gradients.)"""
    return float(layout.cp) if args.zero_stage == 3 else 1.0


# what the recipe sets itself: a --ds-config entry for one of them must agree with it (or be "auto", as HF-style
# configs write it); a conflicting one is refused by name (it used to be overwritten). The batch shape, the clipping
# and bf16 depend on the run's layout or device: checked when ds_config builds the config, on every rank alike.
SET_BY_THE_RECIPE = {
    "train_micro_batch_size_per_gpu": "one packed sequence per micro batch",
    "gradient_accumulation_steps": "--batch-size (the sequences per dp rank)",
    "train_batch_size": "--batch-size (sequences per dp rank x dp)",
    "gradient_clipping": "--grad-clip",
    "bf16": "--dtype",
    "bfloat16": "--dtype",  # DeepSpeed's older name for the bf16 section
    "fp16": "--dtype (bf16 or fp32: fp16 is not a recipe dtype)",
}
# what the recipe does not use at all: refused at parse time
UNUSED_BY_THE_RECIPE = {
    "optimizer": "--lr and --weight-decay (torch's AdamW, a client optimizer)",
    "scheduler": "--lr, --warmup and --steps (the recipe's schedule)",
}


def _enabled(entry):
    """A precision section's "enabled" ("auto" / absent: None), or the entry itself where it is not a section."""
    return entry.get("enabled") if isinstance(entry, dict) else entry


def check_ds_config(p: argparse.ArgumentParser, args, cfg) -> None:
    """Refuses a --ds-config entry the recipe leaves unused, or one that contradicts what it sets and can be
    checked before the run's layout exists, naming it and the option to use."""
    where = f"--ds-config {args.ds_config}"
    if not isinstance(cfg, dict):
        p.error(f"{where}: a DeepSpeed config is a JSON object, got {type(cfg).__name__}")
    for key, option in UNUSED_BY_THE_RECIPE.items():
        if key in cfg:
            p.error(f"{where}: {key!r} is not used: the recipe takes {option}; remove it from the file")
    if _enabled(cfg.get("fp16")) not in (None, False, "auto"):
        p.error(f"{where}: 'fp16' is enabled, but the recipe computes in --dtype (bf16 or fp32); remove it or set "
                f"\"enabled\": false")
    micro = cfg.get("train_micro_batch_size_per_gpu", 1)
    if micro not in (1, "auto"):
        p.error(f"{where}: 'train_micro_batch_size_per_gpu' is {micro!r}, but the recipe runs "
                f"{SET_BY_THE_RECIPE['train_micro_batch_size_per_gpu']} (1, or \"auto\")")
    clip = cfg.get("gradient_clipping", "auto")
    if clip != "auto" and (not isinstance(clip, (int, float)) or float(clip) != float(args.grad_clip)):
        p.error(f"{where}: 'gradient_clipping' is {clip!r} but --grad-clip is {args.grad_clip}: pass --grad-clip "
                f"{clip}, or remove it from the file")
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        p.error(f"{where}: 'zero_optimization' must be a JSON object, got {type(zero).__name__}")
    if "stage" in zero and zero["stage"] != args.zero_stage:
        p.error(f"{where}: zero_optimization.stage is {zero['stage']!r} but --zero-stage is {args.zero_stage} (the "
                f"recipe runs --zero-stage): pass --zero-stage {zero['stage']}, or remove the stage from the file")


def check_layout_entries(args, file_cfg: dict, recipe: dict) -> None:
    """A --ds-config's batch shape and bf16 section against what the recipe sets for this layout and device (the
    same on every rank: each raises the same error)."""
    where = f"--ds-config {args.ds_config}"
    for key in ("gradient_accumulation_steps", "train_batch_size"):
        if file_cfg.get(key, "auto") not in ("auto", recipe[key]):
            raise SystemExit(f"{where}: {key!r} is {file_cfg[key]!r} but this run has {recipe[key]} (from "
                             f"{SET_BY_THE_RECIPE[key]}): remove it from the file or set it to \"auto\"")
    for key in ("bf16", "bfloat16"):
        enabled = _enabled(file_cfg.get(key))
        if enabled not in (None, "auto", recipe["bf16"]["enabled"]):
            raise SystemExit(f"{where}: {key!r} has enabled {enabled!r} but this run computes in "
                             f"{'bf16' if recipe['bf16']['enabled'] else 'fp32'} (--dtype {args.dtype}): remove it "
                             f"or set \"enabled\": \"auto\"")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    g = p.add_argument_group("deepspeed")
    g.add_argument("--zero-stage", type=int, choices=[2, 3], default=2,
                   help="ZeRO stage: 2 shards gradients and optimizer state, 3 the parameters too")
    g.add_argument("--ds-config", default=str(HERE / "ds_config.json"),
                   help="DeepSpeed JSON config (batch sizes and precision come from the recipe's flags)")
    common.add_checkpoint_args(p, "'latest' (newest tag in --ckpt-dir) or a tag")
    args = p.parse_args(argv)
    common.check_common_args(p, args)
    common.check_checkpoint_args(p, args)
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir (DeepSpeed's checkpoints are tags inside it)")
    try:  # read again by ds_config(), on every rank, once the process group and the model exist
        with open(args.ds_config) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as err:
        p.error(f"--ds-config {args.ds_config}: not a readable JSON file ({err})")
    check_ds_config(p, args, cfg)
    return args


def resume_tag(args) -> str:
    """The checkpoint tag ``--resume`` names, checked before the process group and DeepSpeed's engine exist (every
    rank alike): a tag that is not there, one saved at the other ZeRO stage or by another number of ranks ended in
    an AssertionError or a ZeRORuntimeException inside DeepSpeed's loader once the engine was built; the settings,
    schedule and step recorded beside it (common.check_resumed_run) were refused only after loading."""
    ckpt = Path(args.ckpt_dir)
    if args.resume == "latest":
        marker = ckpt / "latest"
        if not marker.is_file():
            raise SystemExit(f"no DeepSpeed checkpoint found in {args.ckpt_dir} (no 'latest' file)")
        tag = marker.read_text().strip()
    else:
        tag = args.resume
    where = ckpt / tag
    if not where.is_dir():
        raise SystemExit(f"--resume {args.resume}: no checkpoint tag {tag!r} in --ckpt-dir {args.ckpt_dir}")
    saved = (3 if any(where.glob("zero_pp_rank_*_model_states.pt"))
             else 2 if any(where.glob("mp_rank_*_model_states.pt")) else None)
    if saved is None:  # (another recipe's checkpoint, or an empty tag: an AssertionError inside DeepSpeed's loader)
        raise SystemExit(f"--resume {args.resume}: {where} is not a checkpoint of this recipe (no DeepSpeed model "
                         "states in it)")
    if saved != args.zero_stage:
        raise SystemExit(f"--resume {args.resume}: the checkpoint was saved with --zero-stage {saved}, this run has "
                         f"--zero-stage {args.zero_stage}; DeepSpeed loads it only at its own stage")
    # ZeRO partitions the optimizer state over all dp x cp ranks, one file per rank
    ranks = {f.name.split("zero_pp_rank_")[1].split("_")[0] for f in where.glob("*zero_pp_rank_*_optim_states.pt")}
    world = common.launched_world()
    if ranks and len(ranks) != world:
        raise SystemExit(f"--resume {args.resume}: the checkpoint was saved by {len(ranks)} ranks, this run has "
                         f"{world}; DeepSpeed loads ZeRO's partitioned optimizer state only at the world size it was "
                         f"saved with (--cp may differ)")
    common.check_resumed_run(where, args)
    return tag


def clear_tag(where: Path, rank: int) -> None:
    """Removes what an earlier save left at the tag about to be saved (rank 0; every rank then meets at a barrier
    before writing): its files stayed beside the new ones, and resume_tag's checks and DeepSpeed's loader read
    every rank's file (another run's ranks or ZeRO stage refused the resume, or failed inside the loader)."""
    if rank == 0 and where.is_dir():
        shutil.rmtree(where)
    elif rank == 0 and where.exists():
        where.unlink()
    dist.barrier()


def main(argv=None):
    args = parse_args(argv)
    common.require("deepspeed", "deepspeed", "recipes/deepspeed_train.py")
    # refused before the process group and DeepSpeed's engine exist: a layout the world does not allow, a
    # checkpoint that is not there, was saved at another ZeRO stage or world size, or does not continue this run
    world = common.launched_world()
    dp = common.check_layout(world, args.cp, args.batch_size)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the device common.init_distributed takes
    config = ds_config(args, common.Layout(0, world, dp, args.cp, 0, 0, None, None, None, args.batch_size),
                       common.compute_dtype(args, torch.device(device_type)))  # depends on the layout's sizes only
    resume = resume_tag(args) if args.resume else None

    rank, world, device = common.init_distributed(args=args)
    import deepspeed  # after the process group exists: DeepSpeed adopts it
    from deepspeed.utils import safe_set_full_grad

    # DeepSpeed's ZeRO calls torch.distributed's all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
    # deprecates: a FutureWarning at every step (126 lines in a 20-step run) about code the user cannot change
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                            r"(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

    if device.type == "cpu":
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory collective op (about a minute, needs a C++
        # compiler) used for inference all-reduce; training collectives go through gloo either way.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    common.set_determinism(args)
    layout = common.make_layout(rank, world, args.cp, args.batch_size, device)
    dtype = common.compute_dtype(args, device)
    model = common.build_model(args, layout.mesh["cp"], device)
    n_params = model.num_parameters()
    # --cp-invariant: parameter gradients in int64 fixed point, summed over every rank; DeepSpeed's hooks reduce
    # zeros for them, and the sums replace those in its gradient partitions before each optimizer step
    invariant = common.install_invariant_grads(model, zero_weight_grads=True) if args.cp_invariant else None
    optimizer = common.make_optimizer(model, args)
    mpu = None
    if layout.cp > 1:
        mpu = ContextParallelMpu(layout, dist.new_group(list(range(world))))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu,
                                                  config=config)
    start = 0
    if resume is not None:
        path, client = engine.load_checkpoint(args.ckpt_dir, tag=resume)
        if path is None:
            raise SystemExit(f"no DeepSpeed checkpoint found in {args.ckpt_dir}")
        start = int(client["step"])
        common.check_resumed_schedule(client["schedule"], args)
    stream = common.build_stream(args, resumed=Path(args.ckpt_dir) / resume if resume is not None else None)
    per_rank = layout.sequences_per_rank
    if rank == 0:
        print(f"deepspeed: ZeRO-{args.zero_stage} world={world} dp={layout.dp} cp={layout.cp} model={args.model} "
              f"params={n_params / 1e6:.1f}M seqlen={args.seqlen} batch={args.batch_size} dtype={dtype} "
              f"device={device} accelerator={deepspeed.get_accelerator()._name} start_step={start}", flush=True)
        if args.cp_invariant:
            print(common.cp_invariant_scope(
                "attention, logits and parameter gradients (int64 fixed point, summed over every rank, set into "
                "DeepSpeed's partitions)"), flush=True)
    progress = common.Progress(args.steps, rank, args.metrics_out, args.log_every, start)
    peak = common.peak_flops(args, device)

    invariant_norm = []  # the step's gradient norm in --cp-invariant mode

    def backward(loss, n):
        engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps (= n) itself
        if invariant is not None and engine.is_gradient_accumulation_boundary():
            invariant_norm[:] = [invariant.finish(divide_by=layout.dp, max_norm=args.grad_clip or None,
                                                  assign=safe_set_full_grad)]
        engine.step()  # an optimizer step only at the accumulation boundary

    stop = common.last_step(args, start)
    meter = common.Throughput.for_run(args, device, start, stop)
    for step in range(start, stop):
        lr = common.set_lr(optimizer, step, args)
        samples = stream.batch(step, args.batch_size, first=layout.dp_rank * per_rank, count=per_rank)
        common.sync(device)
        t0 = common.now()
        loss_sum, _ = common.forward_backward(engine, samples, layout, args, device, backward=backward,
                                              loss_scale=1.0 if invariant else zero3_loss_scale(args, layout))
        loss = common.step_loss(loss_sum, layout)
        common.sync(device)
        seconds = common.now() - t0
        tokens = args.batch_size * args.seqlen
        flops = model.training_flops([s.cu_seqlens for s in stream.batch(step, args.batch_size)])
        meter.add(step, seconds, tokens, flops)
        grad_norm = invariant_norm[0] if invariant is not None else engine.get_global_grad_norm()
        progress.update(step, loss=loss, lr=lr,
                        grad_norm=float(grad_norm) if grad_norm is not None else None,
                        tokens_per_s=tokens / seconds, step_s=seconds, peak_mem_gib=common.peak_memory_gib(device))
        if common.saves_checkpoint(args, step + 1, stop):
            tag = f"step_{step + 1:06d}"
            clear_tag(Path(args.ckpt_dir) / tag, rank)
            if rank == 0:  # before DeepSpeed's own files (its 'latest' marks a finished checkpoint)
                common.save_run_settings(Path(args.ckpt_dir) / tag, args, step + 1)
            engine.save_checkpoint(args.ckpt_dir, tag=tag,
                                   client_state={"step": step + 1, "schedule": common.schedule_state(args)})
    progress.close()

    mem = common.max_peak_memory_gib(device)
    digest = None
    if args.cp_invariant:  # the whole weights (ZeRO-3 gathers its partitions; every rank takes part)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            digest = common.weights_hash(model)
    if rank == 0:
        print(common.summary_line(
            recipe="deepspeed", zero_stage=args.zero_stage, model=args.model, params=n_params, world=world,
            dp=layout.dp, cp=layout.cp, seqlen=args.seqlen, batch_size=args.batch_size,
            dtype=str(dtype).split(".")[-1], **meter.summary(peak, world), peak_mem_gib=mem,
            flop_formula=common.FLOP_FORMULA, cp_invariant=args.cp_invariant, weights_sha256=digest,
        ), flush=True)
    common.finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    common.run_main(main)
