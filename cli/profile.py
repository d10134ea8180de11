"""`tpc profile MODEL -o PROFILE --seq-len L [--batch-sizes 1,2,4] [--device cpu|cuda]`."""

from __future__ import annotations

import time

from tpc.compiler.costmodel.store import save_profile
from tpc.executors.profile import profile_model
from tpc.ir.diagnostics import Diagnostic, TpirError


def parse_batch_sizes(text: str) -> list[int]:
    try:
        return [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise TpirError(Diagnostic(f"--batch-sizes {text!r} is not a list of integers",
                                   where="--batch-sizes", hint="e.g. --batch-sizes 1,2,4")) from None


def cmd_profile(args) -> int:
    from tpc.ir.files import check_output

    sizes = parse_batch_sizes(args.batch_sizes)
    check_output(args.output, option="--output")  # before minutes of measuring
    t0 = time.perf_counter()
    prof = profile_model(args.model, args.seq_len, sizes, device=args.device, factory=args.factory,
                         log=print, compile=args.compile)
    save_profile(prof, args.output)
    print(f"{args.output}: {prof.num_units} units x {len(prof.batch_sizes)} micro-batch sizes on "
          f"{prof.device}; the fits are within {prof.fit_error_share():.2%} of the model's time "
          f"(split backward {prof.fit_error_share(split=True):.2%}), stash within "
          f"{prof.worst_stash_error:.1%}; {time.perf_counter() - t0:.1f} s")
    return 0
