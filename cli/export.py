"""`tpc export`, `tpc sample` and `tpc export-schedule`: trained weights out of a checkpoint,
text out of them, and a plan's schedule out in torch's CSV."""

from __future__ import annotations

from tpc.executors.training.export import export_format, write_export
from tpc.executors.training.generate import sample_text


def cmd_export(args) -> int:
    """`tpc export CKPT -o model.pt|model.safetensors|DIR [--format pt|safetensors|hf]`."""
    from tpc.ir.files import check_output

    # before the checkpoint is read: could -o be written at all? (its folders are created)
    check_output(args.output, option="-o", folder=export_format(args.output, args.format) == "hf", parents=True)
    sd, meta, fmt = write_export(args.checkpoint, args.output, args.format)
    n_params = sum(t.numel() for t in {id(t): t for t in sd.values()}.values())
    what = {"pt": "", "safetensors": "safetensors, ", "hf": "Hugging Face model directory, "}[fmt]
    print(f"wrote {args.output}: {what}{len(sd)} tensors, {n_params:,} values, from step {meta['step']} "
          f"of {meta['model_path']}")
    return 0


def cmd_sample(args) -> int:
    """`tpc sample CKPT|model.pt --prompt TEXT --tokens N --temperature T --top-k K --seed S`."""
    print(sample_text(args.checkpoint, args.prompt, args.tokens, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed, model_path=args.model, factory=args.factory))
    return 0


def cmd_export_schedule(args) -> int:
    """`tpc export-schedule PLAN -o SCHED.csv [--format compute_only|compute_comms]`."""
    from tpc.compiler.torch_schedule.exporter import export_schedule
    from tpc.compiler.torch_schedule.load import load_checked_plan
    from tpc.compiler.torch_schedule.slice_map import map_path
    from tpc.ir.files import check_output
    from tpc.ir.semantics import GLOO

    check_output(args.output, option="--output")
    check_output(map_path(args.output), option="--output")  # the slice map beside it
    # any valid plan exports, a plan for gloo's rules too: checked under them, the format's own
    plan = load_checked_plan(args.plan, comm=GLOO)
    print(export_schedule(plan, args.output, fmt=args.format, plan_name=args.plan).summary())
    return 0
