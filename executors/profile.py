"""`tpc profile`: time every unit of a model over slice length x context x micro-batch size.

Each unit runs as a one-unit stage through the same StageRuntime the executors use, so what is
timed is what a plan runs: forward of a slice whose KV prefix holds `c` tokens (made by an
untimed forward of a c-token slice first), then its backward (which also sends gradients into
the prefix). The same slice after the same prefix then runs once more, forward untimed, with
its backward split the way a plan may split it: `backward_input` (gradients of the stage input
and of the prefix) timed, then `backward_weight` (parameter gradients) timed. Every point is
warmed up, then the median of the repeats is kept (of each of the four times). The grid is
small on purpose (a handful of lengths, contexts 0 / half / all of what precedes) and the fit
(fit.py) fills in the rest; the profile records the fit error so a poor fit is visible.

At every point one more, untimed forward measures the stash: the bytes of the tensors autograd
saves for the slice's backward (parameters and KV caches excluded: they are counted apart), fitted
per unit and micro-batch size by `fit.fit_stash` (the form is `fit.StashFit`'s). The split
pass also measures what `backward_input` keeps for `backward_weight` (the output gradients of
the linear layers, and the weight gradients other ops hand over: `StageRuntime.held_bytes`),
fitted the same way plus a constant (the handed weight gradients do not grow with the slice): a
plan that splits its backward holds it from one half to the other.
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np
import torch

from tpc.compiler.costmodel.fit import fit_curve, fit_stash
from tpc.compiler.costmodel.store import Profile, UnitProfile
from tpc.compiler.frontend import SlicedModel, file_sha256, load_model, read_vocab
from tpc.compiler.programs.stage_programs import ProgramOptions, StagePrograms
from tpc.executors.stage_runtime import StageRuntime
from tpc.executors.stage_runtime import storage_key
from tpc.ir.diagnostics import Diagnostic, TpirError

# a loopback gloo transfer on one host: latency and bandwidth of a memcpy through a socket
CPU_LINK = (50e-6, 2e9)
# two GPUs of one host over NVLink/PCIe (not measurable with one GPU; a conservative PCIe figure)
CUDA_LINK = (10e-6, 20e9)


def device_name(kind: str) -> str:
    """The identity a profile is valid for: the kind and model of the processor."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TpirError(Diagnostic("--device cuda: no CUDA device is visible", where="--device",
                                       hint="profile with --device cpu, or run on a machine with a GPU"))
        return f"cuda:{torch.cuda.get_device_name(0)}"
    if kind == "cpu":
        return f"cpu:{_cpu_model()}"
    raise TpirError(Diagnostic(f"unknown device {kind!r}", where="--device", hint="use cpu or cuda"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def grid_lengths(L: int) -> list[int]:
    """Slice lengths to measure: L/64 .. L in powers of two. Short slices are where time is
    least proportional to length, so they get the densest sampling, and the optimiser weighs
    slicings of many short slices: below the shortest measured length the model can only
    guess (fit.py)."""
    return sorted({max(1, L // d) for d in (64, 32, 16, 8, 4, 2, 1)})


def grid_contexts(L: int, l: int) -> list[int]:
    return sorted({0, (L - l) // 2, L - l})


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slice_inputs(stage, dev, vocab, hidden, b):
    """make_input(n), targets(n): what a slice of n tokens of b sequences feeds the stage."""

    def make_input(n):
        if stage.is_first:
            return torch.randint(0, vocab, (b, n), device=dev)
        return torch.randn(b, n, hidden, device=dev)

    def targets(n):
        return torch.randint(0, vocab, (b, n), device=dev) if stage.is_last else None

    return make_input, targets


def _time_point(rt, split_rt, stage, dev, vocab, hidden, l, c, b, warmup, repeats):
    """Median (forward, backward, backward-input, backward-weight) seconds of one slice of
    length l after a c-token prefix: a plain backward, and in a second pass the split one; and
    the bytes the split backward kept between its halves (`StageRuntime.held_bytes`)."""
    make_input, targets = _slice_inputs(stage, dev, vocab, hidden, b)

    def grad_out(y):
        return None if stage.is_last else torch.randn_like(y)

    def prefix(rt):
        if c:
            rt.forward(0, 0, make_input(c), 0, targets(c))
        return 1 if c else 0

    fs, bs, bis, bws = [], [], [], []
    for rep in range(warmup + repeats):
        sl = prefix(rt)
        x, tg = make_input(l), targets(l)
        _sync(dev)
        t0 = time.perf_counter()
        y = rt.forward(0, sl, x, c, tg)
        _sync(dev)
        t1 = time.perf_counter()
        rt.backward(0, sl, grad_out(y))
        _sync(dev)
        t2 = time.perf_counter()
        if c:
            rt.backward(0, 0, None if stage.is_last else torch.randn(b, c, hidden, device=dev))
        rt.free_kv(0)
        stage.zero_grad(set_to_none=True)
        # the split backward of the same slice, through the stage's programs (what runs it): a
        # fresh prefix and forward (untimed), then the two halves (the prefix's own backward is
        # not needed: free_kv drops what it saved)
        sl = prefix(split_rt)
        g = grad_out(split_rt.forward(0, sl, make_input(l), c, targets(l)))
        _sync(dev)
        t3 = time.perf_counter()
        split_rt.backward_input(0, sl, g)
        _sync(dev)
        t4 = time.perf_counter()
        held = split_rt.held_bytes(0, sl)
        split_rt.backward_weight(0, sl)
        _sync(dev)
        t5 = time.perf_counter()
        split_rt.free_kv(0)
        stage.zero_grad(set_to_none=True)
        if rep >= warmup:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
            bis.append(t4 - t3)
            bws.append(t5 - t4)
    return (statistics.median(fs), statistics.median(bs), statistics.median(bis),
            statistics.median(bws), held)


def stash_point(rt, stage, dev, vocab, hidden, l, c, b) -> int:
    """Bytes autograd saves for the backward of one slice of length l after a c-token prefix:
    the forward `_time_point` times, run once more (untimed; the count is deterministic) with a
    pack hook that records every saved tensor and returns it unchanged.

    Each storage counts once, whole: a saved view of a larger buffer keeps all of it alive,
    which is what memory really holds. Left out: the stage's parameters and buffers (param_bytes,
    held the whole step) and the KV caches (kv_bytes): a storage the cache shares (a first
    slice's keys/values are views of its QKV projection, which attention also saves a query
    view of) counts without the cache's own bytes. A cached static tensor (the bottom-right
    attention mask, made once per shape) is counted for every slice and unit that saves it.
    """
    make_input, targets = _slice_inputs(stage, dev, vocab, hidden, b)
    sl = 0
    if c:
        rt.forward(0, 0, make_input(c), 0, targets(c))
        sl = 1
    x, tg = make_input(l), targets(l)
    before = list(rt.kv_buffers(0)) if c else []  # the prefix buffers (replaced if they grow)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rt.forward(0, sl, x, c, tg)
        held = {storage_key(t) for t in (*stage.parameters(), *stage.buffers())}
        cache_bytes: dict[tuple, dict] = {}  # storage -> {(offset, numel): bytes} of cache views
        for k in before + list(rt.kv_buffers(0)):
            cache_bytes.setdefault(storage_key(k), {})[(k.storage_offset(), k.numel())] = (
                k.numel() * k.element_size())
        counted: dict[tuple, int] = {}
        for t in saved:
            key = storage_key(t)
            if key in held or key in counted:
                continue
            kv = sum(cache_bytes.get(key, {}).values())
            counted[key] = max(0, t.untyped_storage().nbytes() - kv)
    finally:
        rt.free_kv(0)  # drops both slices' graphs (no backward ran: no gradients to clear)
        saved.clear()
    return int(sum(counted.values()))


def profile_model(model_path: str, seq_len: int, batch_sizes, device: str = "cpu",
                  factory: str = "model", warmup: int = 1, repeats: int = 3, log=None,
                  compile: bool = False) -> Profile:
    """Measure and fit every unit of the model in `model_path`; see the module docstring.
    `compile`: time the units' programs compiled (`tpc run --compile`); each point's shape is
    compiled in its warm-up (`warmup` >= 1), and the stash is still eager autograd's."""

    warmup = max(warmup, 1) if compile else warmup  # a point's first run compiles its shape
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise TpirError(Diagnostic(f"bad micro-batch sizes {batch_sizes}", where="--batch-sizes",
                                   hint="give positive sizes, e.g. --batch-sizes 1,2,4"))
    if seq_len < 2:
        raise TpirError(Diagnostic(f"--seq-len {seq_len} is too short to profile", where="--seq-len",
                                   hint="profile at the sequence length you will train with"))
    name = device_name(device)
    dev = torch.device(device)
    model = load_model(model_path, factory)
    vocab = read_vocab(model, model_path)
    # profiling times units; whether the model slices exactly is `tpc compile`'s self-check
    sliced = SlicedModel.from_model(model, seq_len=seq_len, vocab=vocab, check_slices=None)
    model.to(dev)
    hidden = sliced.hidden_size
    elem = next(model.parameters()).element_size()
    lengths = grid_lengths(seq_len)
    units = []
    for u in range(sliced.num_units):
        stage = sliced.stage_module(u, u + 1).to(dev)
        eager_rt = StageRuntime(stage, 1.0)
        if compile:  # one runtime of compiled programs times the whole and the split backward
            rt = split_rt = StageRuntime(stage, 1.0, StagePrograms(stage, ProgramOptions(compile=True)))
        else:
            rt, split_rt = eager_rt, StageRuntime(stage, 1.0, StagePrograms(stage))
        fwd_fits, bwd_fits, stash_fits, samples, stash_samples = [], [], [], [], []
        input_fits, weight_fits, held_fits, held_samples = [], [], [], []
        for b in sizes:
            pts = []
            for l in lengths:
                for c in grid_contexts(seq_len, l):
                    tf, tb, ti, tw, held = _time_point(rt, split_rt, stage, dev, vocab, hidden, l, c, b, warmup,
                                                       repeats)
                    nbytes = stash_point(eager_rt, stage, dev, vocab, hidden, l, c, b)
                    pts.append((l, c, tf, tb, nbytes, ti, tw, held))
                    samples.append((b, l, c, tf, tb, ti, tw))
                    stash_samples.append((b, l, c, nbytes))
                    held_samples.append((b, l, c, held))
            arr = np.array(pts, dtype=np.float64)
            fwd_fits.append(fit_curve(arr[:, 0], arr[:, 1], arr[:, 2]))
            bwd_fits.append(fit_curve(arr[:, 0], arr[:, 1], arr[:, 3]))
            stash_fits.append(fit_stash(arr[:, 0], arr[:, 1], arr[:, 4]))
            input_fits.append(fit_curve(arr[:, 0], arr[:, 1], arr[:, 5]))
            weight_fits.append(fit_curve(arr[:, 0], arr[:, 1], arr[:, 6]))
            held_fits.append(fit_stash(arr[:, 0], arr[:, 1], arr[:, 7], constant=True))
        kv_per_token = sum(_kv_row_bytes(shape, d, dt)
                           for shape, d, dt in zip(stage.kv_shapes, stage.kv_dims, stage.kv_dtypes))
        params = sum(p.numel() * p.element_size() for p in stage.parameters())
        units.append(UnitProfile(label=stage.label, fwd=tuple(fwd_fits), bwd=tuple(bwd_fits),
                                 kv_bytes_per_token=int(kv_per_token), param_bytes=int(params),
                                 samples=tuple(samples), stash=tuple(stash_fits),
                                 stash_samples=tuple(stash_samples), bwd_input=tuple(input_fits),
                                 bwd_weight=tuple(weight_fits), held=tuple(held_fits),
                                 held_samples=tuple(held_samples)))
        if log:
            step = max(tf + tb for _, _, _, tf, tb, _, _ in samples)
            log(f"unit {u} {stage.label}: {len(samples)} points, up to {step * 1e3:.3g} ms "
                f"forward + backward, stash fit error {max(f.rel_error for f in stash_fits):.1%}")
    link = CUDA_LINK if dev.type == "cuda" else CPU_LINK
    return Profile(model_path=model_path, model_sha256=file_sha256(model_path), factory=factory,
                   device=name, seq_len=seq_len, hidden=hidden, batch_sizes=tuple(sizes),
                   units=tuple(units), act_bytes_per_token=hidden * elem,
                   link_latency=link[0], link_bandwidth=link[1],
                   notes=(f"link {link[0] * 1e6:.0f} us + bytes / {link[1] / 1e9:.0f} GB/s is a "
                          "stated figure, not measured",)
                   + (("times are of the stage programs compiled by inductor (tpc profile --compile); "
                       "the stash is eager autograd's",) if compile else ()))


def _kv_row_bytes(shape_fn, seq_dim: int, dtype) -> int:
    """Bytes one token of one sequence adds to a cached tensor: its shape at batch 1 with the
    sequence dimension set to 1."""
    shape = list(shape_fn(1))
    shape[seq_dim] = 1
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
