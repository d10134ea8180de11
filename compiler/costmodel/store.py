"""Measured profiles on disk (msgpack): what `tpc profile` writes and `--cost FILE` reads.

A profile is only valid for the model file it measured (its SHA-256) and the device it ran on;
loading it for another model or device raises a TpirError that says which and how to refresh
it, rather than letting the optimiser plan with someone else's timings. A profile of an older
format version (version 1 had no activation stash, version 2 no split backward, version 3 fitted
context terms that moved context-free slices off their measured times, version 4 did not measure
what a split backward keeps between its halves) is refused as
stale the same way, saying what the newer version measures and how to write it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from tpc.compiler.costmodel.fit import CurveFit, StashFit
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.files import atomic_write_bytes

PROFILE_FORMAT = "tpc-profile"
PROFILE_VERSION = 5
# what each version added, for the message that refuses an older file
VERSION_ADDED = {
    2: "what each slice keeps for its backward",
    3: "the two halves of a split backward (backward-input and backward-weight)",
    4: "slices down to L/64, and fits context terms that leave context-free slices at their measured times",
    5: "the output gradients a split backward keeps from its input half to its weight half",
}


@dataclass(frozen=True)
class UnitProfile:
    label: str
    # per measured micro-batch size (ascending, as in Profile.batch_sizes): forward and backward
    fwd: tuple[CurveFit, ...]
    bwd: tuple[CurveFit, ...]
    kv_bytes_per_token: int  # KV-cache bytes one token of one sequence leaves on this unit
    param_bytes: int
    # raw medians per measured point: (mb, l, c, t_fwd, t_bwd, t_bwd_input, t_bwd_weight) as
    # `tpc profile` writes them (a profile built in memory may carry only t_fwd, t_bwd)
    samples: tuple[tuple, ...] = ()
    # per measured micro-batch size, like fwd/bwd: bytes autograd keeps for a slice's backward
    # (empty: not measured, e.g. a synthetic profile; the cost model then has no stash)
    stash: tuple[StashFit, ...] = ()
    # measured stash: (mb, l, c, bytes) per point
    stash_samples: tuple[tuple[int, int, int, int], ...] = ()
    # per measured micro-batch size, like fwd/bwd: the split backward's halves, timed apart
    # (`StageRuntime.backward_input`, then `backward_weight`); empty: not measured (a profile
    # built in memory), the cost model then prices each half as half the backward
    bwd_input: tuple[CurveFit, ...] = ()
    bwd_weight: tuple[CurveFit, ...] = ()
    # per measured micro-batch size, like stash: the bytes `backward_input` leaves for
    # `backward_weight` (the kept output gradients, executors/weight_grads.py); empty: not
    # measured, the cost model then counts none
    held: tuple[StashFit, ...] = ()
    # measured: (mb, l, c, bytes) per point
    held_samples: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True)
class Profile:
    model_path: str
    model_sha256: str
    factory: str
    device: str
    seq_len: int
    hidden: int
    batch_sizes: tuple[int, ...]
    units: tuple[UnitProfile, ...]
    act_bytes_per_token: int  # bytes of one token of one sequence's activation between units
    # point-to-point link between stage ranks: latency (s) and bandwidth (bytes/s)
    link_latency: float
    link_bandwidth: float
    version: int = PROFILE_VERSION
    notes: tuple[str, ...] = field(default=())

    @property
    def num_units(self) -> int:
        return len(self.units)

    def fit_error_share(self, split: bool = False) -> float:
        """The fits' error as a share of the whole model's time: over every unit and measured
        point, the worst |fit - measured| of a unit's forward and backward (with `split`: of
        its backward-input and backward-weight), divided by the forward + backward of all
        units at that point. A sub-millisecond unit may be fitted within 400% of its own time
        and still be exact to 0.01% of a step, which is what a plan's prediction feels; this
        is the number to judge a profile by. 0 for a profile without samples."""
        total: dict[tuple, float] = {}
        for u in self.units:
            for b, l, c, tf, tb, *_ in u.samples:
                total[(b, l, c)] = total.get((b, l, c), 0.0) + tf + tb
        sizes = {b: k for k, b in enumerate(self.batch_sizes)}
        worst = 0.0
        for u in self.units:
            fits = (u.bwd_input, u.bwd_weight) if split else (u.fwd, u.bwd)
            if not all(fits):
                continue
            for b, l, c, *times in u.samples:
                measured = times[2:4] if split else times[0:2]
                if len(measured) < 2 or not total.get((b, l, c)):
                    continue
                for fit, t in zip(fits, measured):
                    err = abs(float(fit[sizes[b]](l, c)) - t)
                    worst = max(worst, err / total[(b, l, c)])
        return worst

    @property
    def worst_fit_error(self) -> float:
        return max(f.rel_error for u in self.units for f in u.fwd + u.bwd)

    @property
    def worst_split_error(self) -> float:
        return max((f.rel_error for u in self.units for f in u.bwd_input + u.bwd_weight),
                   default=0.0)

    @property
    def worst_stash_error(self) -> float:
        return max((f.rel_error for u in self.units for f in u.stash), default=0.0)


def _to_obj(p: Profile) -> dict:
    return {
        "format": PROFILE_FORMAT, "version": p.version, "model_path": p.model_path,
        "model_sha256": p.model_sha256, "factory": p.factory, "device": p.device,
        "seq_len": p.seq_len, "hidden": p.hidden, "batch_sizes": list(p.batch_sizes),
        "act_bytes_per_token": p.act_bytes_per_token, "link_latency": p.link_latency,
        "link_bandwidth": p.link_bandwidth, "notes": list(p.notes),
        "units": [{"label": u.label, "fwd": [f.to_dict() for f in u.fwd],
                   "bwd": [f.to_dict() for f in u.bwd], "kv_bytes_per_token": u.kv_bytes_per_token,
                   "param_bytes": u.param_bytes, "samples": [list(s) for s in u.samples],
                   "stash": [f.to_dict() for f in u.stash],
                   "stash_samples": [list(s) for s in u.stash_samples],
                   "bwd_input": [f.to_dict() for f in u.bwd_input],
                   "bwd_weight": [f.to_dict() for f in u.bwd_weight],
                   "held": [f.to_dict() for f in u.held],
                   "held_samples": [list(s) for s in u.held_samples]}
                  for u in p.units],
    }


def _sample(s) -> tuple:
    """(mb, l, c, then the times): three integers and at least forward and backward."""
    if len(s) < 5:
        raise ValueError(f"sample {s}")
    return (int(s[0]), int(s[1]), int(s[2]), *(float(v) for v in s[3:]))


def _from_obj(d: dict) -> Profile:
    units = tuple(UnitProfile(label=u["label"], fwd=tuple(CurveFit.from_dict(f) for f in u["fwd"]),
                              bwd=tuple(CurveFit.from_dict(f) for f in u["bwd"]),
                              kv_bytes_per_token=int(u["kv_bytes_per_token"]),
                              param_bytes=int(u["param_bytes"]),
                              samples=tuple(_sample(s) for s in u["samples"]),
                              stash=tuple(StashFit.from_dict(f) for f in u["stash"]),
                              stash_samples=tuple((int(s[0]), int(s[1]), int(s[2]), int(s[3]))
                                                  for s in u["stash_samples"]),
                              bwd_input=tuple(CurveFit.from_dict(f) for f in u["bwd_input"]),
                              bwd_weight=tuple(CurveFit.from_dict(f) for f in u["bwd_weight"]),
                              held=tuple(StashFit.from_dict(f) for f in u["held"]),
                              held_samples=tuple((int(s[0]), int(s[1]), int(s[2]), int(s[3]))
                                                 for s in u["held_samples"]))
                  for u in d["units"])
    return Profile(model_path=d["model_path"], model_sha256=d["model_sha256"], factory=d["factory"],
                   device=d["device"], seq_len=int(d["seq_len"]), hidden=int(d["hidden"]),
                   batch_sizes=tuple(int(b) for b in d["batch_sizes"]), units=units,
                   act_bytes_per_token=int(d["act_bytes_per_token"]),
                   link_latency=float(d["link_latency"]), link_bandwidth=float(d["link_bandwidth"]),
                   version=int(d["version"]), notes=tuple(d.get("notes", ())))


def _added_since(version: int) -> str:
    """What the versions after `version` added, in words."""
    added = [what for v, what in sorted(VERSION_ADDED.items()) if v > version]
    return ", and ".join(added) if added else "more"


def _reprofile_hint(obj: dict, path: Path) -> str:
    """How to write the profile again: the exact command when the old file names its model."""
    model, seq_len = obj.get("model_path"), obj.get("seq_len")
    if not (isinstance(model, str) and isinstance(seq_len, int)):
        return "profile the model again with this version of `tpc profile`"
    cmd = f"tpc profile {model} -o {path} --seq-len {seq_len}"
    sizes = obj.get("batch_sizes")
    if isinstance(sizes, list) and sizes and all(isinstance(b, int) for b in sizes):
        cmd += f" --batch-sizes {','.join(str(b) for b in sizes)}"
    if obj.get("factory") not in (None, "model"):
        cmd += f" --factory {obj['factory']}"
    if str(obj.get("device", "")).startswith("cuda:"):
        cmd += " --device cuda"
    return f"run `{cmd}` again with this version of tpc"


def save_profile(profile: Profile, path: str | Path) -> None:
    atomic_write_bytes(path, msgpack.packb(_to_obj(profile), use_bin_type=True))


def load_profile(path: str | Path, model_sha256: str | None = None, device: str | None = None) -> Profile:
    """Read a profile; refuse one measured for another model file or another device."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise TpirError(Diagnostic(f"no such cost profile: {path}", where=where,
                                   hint="write one with `tpc profile MODEL -o FILE --seq-len L`"))
    try:
        obj = msgpack.unpackb(path.read_bytes(), raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise TpirError(Diagnostic(f"{path} is not a cost profile ({e})", where=where,
                                   hint="give a .msgpack file written by `tpc profile`"))
    if not isinstance(obj, dict) or obj.get("format") != PROFILE_FORMAT:
        raise TpirError(Diagnostic(f"{path} is not a cost profile", where=where,
                                   hint="give a .msgpack file written by `tpc profile`"))
    version = obj.get("version")
    if version != PROFILE_VERSION:
        older = isinstance(version, int) and version < PROFILE_VERSION
        raise TpirError(Diagnostic(
            f"cost profile {path} is {'stale' if older else 'not readable'}: format version "
            f"{version}, this tpc reads version {PROFILE_VERSION}"
            + (f" (a profile now also measures {_added_since(version)})" if older else ""),
            where=where, hint=_reprofile_hint(obj, path)))
    try:
        profile = _from_obj(obj)
    except (KeyError, TypeError, ValueError) as e:
        raise TpirError(Diagnostic(f"cost profile {path} is damaged: missing or bad {e}", where=where,
                                   hint="profile the model again with `tpc profile`"))
    if model_sha256 is not None and profile.model_sha256 != model_sha256:
        raise TpirError(Diagnostic(
            f"cost profile {path} is stale: it measured {profile.model_path} with sha256 "
            f"{profile.model_sha256[:12]}..., the model file now has {model_sha256[:12]}...",
            where=where,
            hint=f"the model changed since it was profiled; run `tpc profile {profile.model_path} "
                 f"-o {path} --seq-len {profile.seq_len}` again"))
    if device is not None and profile.device != device:
        raise TpirError(Diagnostic(
            f"cost profile {path} was measured on {profile.device!r}, not on {device!r}", where=where,
            hint="timings do not carry across devices: profile on the device that will run the "
                 "plan, or use --device-model for an analytic estimate"))
    return profile
