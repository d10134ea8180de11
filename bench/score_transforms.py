"""Score transforms over a cached prefix: the written-out attention tpc runs vs FlexAttention.

One slice of `l` queries at offset `o` attends to the `o` cached keys and its own `l` (the mask
aligned bottom-right: query i, at position o + i, sees the keys <= o + i), batch 1, 8 heads of
64. Two transforms of the scores before the softmax:

  softcap   Gemma 2's logit soft-capping, c * tanh(s / c) with s = q.k^T / sqrt(d)
  sink      GPT-OSS's attention sinks: a learned logit per head joined as one more key column,
            its probability dropped after the softmax

Side by side, for each (transform, l, o), forward+backward time (and forward-only time) of

  (a) written-out   `runtime_ops.causal_attention(..., softcap= | sink=)`, which is what a
                    stage runs now: it calls `runtime_ops._written_out` (q.k^T, the transform,
                    the mask, a float32 softmax, @ v)
  (b) flex          torch.nn.attention.flex_attention over the same keys with a causal
                    `mask_mod` offset by o (a BlockMask built once per shape, as the runtime
                    builds its masks) and, for soft-capping, `score_mod = c * tanh(score)`.
                    A sink is no score_mod: FlexAttention has no extra key column. It is exact
                    through the log-sum-exp instead: softmax over [s, sink] gives the keys
                    exp(s_j) / (Z + e^sink) = p_j * sigmoid(log Z - sink), so the sinked output
                    is out * sigmoid(lse - sink) (lse from `return_aux=AuxRequest(lse=True)`,
                    gradients through lse included). Compiled (torch.compile, one compiled
                    function per shape), and eager where PyTorch runs it at all; a variant
                    PyTorch refuses is reported with its error.
  (c) SDPA          `causal_attention` without the transform (plain SDPA under the bottom-right
                    mask): the floor, what the attention would cost without a transform.

Numerical agreement of (a) and (b) (the most exact flex variant that runs, forward and the
gradients of q, the prefix and own keys/values and the sink): max abs difference, and each
against the written-out form in float64. The script fails (exit 1) where they disagree: in
fp32 by more than --tolerance (1e-5), in bf16 where (b) is more than twice as far from float64 as
(a). Beside them, "(a) compiled": the written-out attention under torch.compile, which is how a
`--compile` stage program runs it (inductor fuses the transform, mask and softmax), so that the
two compiled forms are weighed against each other too. The first-call time of each compiled
path is printed per shape: a fresh dynamo per shape and mode, inductor's FX graph cache off and
its kernel cache in a new folder, so the first case compiles cold and later ones may reuse a
kernel an earlier case compiled (as a stage's later slice shapes would).

    OMP_NUM_THREADS=1 python bench/score_transforms.py [--device cpu|cuda] [--dtype fp32|bf16] [--quick]

`--quick`: l = 64, o in {0, 768}, 5 repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, load_note, table  # noqa: E402

TRANSFORMS = ("softcap", "sink")
VARIANTS = ("flex compiled", "flex eager")


def refusal(e: BaseException) -> str:
    """A short form of what PyTorch said when it refused a variant."""
    text = str(e).strip().splitlines()
    msg = next((ln for ln in text if "NotImplementedError" in ln or "not support" in ln), text[0] if text else "")
    return f"{type(e).__name__}: {msg.strip()[:160]}"


class Case:
    """One (transform, l, o): the leaves, and the callables of (a), (b) and (c) over them."""

    def __init__(self, transform: str, l: int, o: int, heads: int, dim: int, dtype, device, softcap: float,
                 seed: int = 0):
        import torch

        self.transform, self.l, self.o, self.keys = transform, l, o, o + l
        self.softcap = softcap if transform == "softcap" else None
        # Gemma 2 folds its 1/sqrt(d) into the tanh: c * tanh(q.k^T / (sqrt(d) c)); without a
        # softcap, the plain scale. Scores of std ~1 before the tanh: it bends them.
        self.scale = dim ** -0.5 / softcap if transform == "softcap" else dim ** -0.5
        g = torch.Generator().manual_seed(seed)

        def leaf(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(device=device, dtype=dtype)

        std = softcap ** 0.5 if transform == "softcap" else 1.0
        self.base = {"q": leaf(1, heads, l, dim, std=std), "k_prefix": leaf(1, heads, o, dim, std=std),
                     "v_prefix": leaf(1, heads, o, dim), "k": leaf(1, heads, l, dim, std=std),
                     "v": leaf(1, heads, l, dim)}
        if transform == "sink":
            self.base["sink"] = leaf(1, heads, 1, 1)
        self.grad_out = leaf(1, heads, l, dim)
        self.device, self.dtype = device, dtype
        self._block_mask = None

    def leaves(self, grad: bool, dtype=None):
        return {n: t.detach().to(dtype or self.dtype).requires_grad_(grad) for n, t in self.base.items()}

    # ------------------------------------------------------------------- the three paths

    def written_out(self, x):
        from tpc.compiler.frontend.runtime_ops import causal_attention

        return causal_attention(x["q"], x["k"], x["v"], x["k_prefix"], x["v_prefix"], scale=self.scale,
                                softcap=self.softcap, sink=x.get("sink"))

    def sdpa(self, x):
        from tpc.compiler.frontend.runtime_ops import causal_attention

        return causal_attention(x["q"], x["k"], x["v"], x["k_prefix"], x["v_prefix"], scale=self.scale)

    def block_mask(self):
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            o = self.o
            self._block_mask = create_block_mask(lambda b, h, i, j: j <= i + o, None, None, self.l, self.keys,
                                                 device=self.device)
        return self._block_mask

    def flex(self, attend, x):
        """(b) through `attend` (flex_attention, compiled or not)."""
        import torch
        from torch.nn.attention.flex_attention import AuxRequest

        kf = torch.cat([x["k_prefix"], x["k"]], dim=-2) if self.o else x["k"]
        vf = torch.cat([x["v_prefix"], x["v"]], dim=-2) if self.o else x["v"]
        if self.transform == "softcap":
            c = self.softcap

            def capped(score, b, h, i, j):
                return torch.tanh(score) * c

            return attend(x["q"], kf, vf, score_mod=capped, block_mask=self.block_mask(), scale=self.scale)
        out, aux = attend(x["q"], kf, vf, block_mask=self.block_mask(), scale=self.scale,
                          return_aux=AuxRequest(lse=True))
        keep = torch.sigmoid(aux.lse.float().unsqueeze(-1) - x["sink"].float())  # (B, H, l, 1)
        return (out.float() * keep).to(out.dtype)


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_once(fn, case: Case, backward: bool):
    """One call of fn (forward, and backward with the case's output gradient): (seconds, out, grads)."""
    import torch

    x = case.leaves(backward)
    sync(case.device)
    t0 = time.perf_counter()
    if backward:
        out = fn(x)
        out.backward(case.grad_out)
    else:
        with torch.no_grad():
            out = fn(x)
    sync(case.device)
    dt = time.perf_counter() - t0
    return dt, out.detach(), ({n: t.grad for n, t in x.items()} if backward else None)


def compiled(fn):
    """fn under torch.compile, static shapes, one graph (a graph break would run part of it
    eagerly under the compiled name: an error instead)."""
    import torch

    return torch.compile(fn, dynamic=False, fullgraph=True)


def measure(case: Case, repeats: int, compile_flex: bool, tolerance: float):
    """Times (median seconds, or a refusal string) per (path, mode), the compile time, the
    exactness figures."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    def through(attend):
        return lambda x: case.flex(attend, x)

    paths = {"written-out": case.written_out, "SDPA": case.sdpa, "flex eager": through(flex_attention)}
    first_call = {}
    times = {}
    for mode in ("fwd+bwd", "fwd"):
        backward = mode == "fwd+bwd"
        if compile_flex:  # compiled afresh for each mode: a refusal in one leaves the other intact
            torch._dynamo.reset()
            paths = {**paths, "written-out compiled": compiled(case.written_out),
                     "flex compiled": through(compiled(flex_attention))}
        live = {}
        for name, fn in paths.items():
            try:
                dt, _, _ = run_once(fn, case, backward)  # compiles on first call; warms up otherwise
                if name.endswith("compiled") and name not in first_call:
                    first_call[name] = (dt, mode)
                run_once(fn, case, backward)
                live[name] = fn
            except Exception as e:  # noqa: BLE001 - what PyTorch says about this variant here
                times[(name, mode)] = refusal(e)
        samples = {name: [] for name in live}
        for _ in range(repeats):  # interleaved: machine noise falls on every path alike
            for name, fn in live.items():
                samples[name].append(run_once(fn, case, backward)[0])
        times.update({(name, mode): statistics.median(s) for name, s in samples.items()})
    return times, first_call, exactness(case, paths, times, tolerance)


def exactness(case: Case, paths: dict, times: dict, tolerance: float) -> dict:
    """Max abs differences of the most exact flex variant that ran (fwd+bwd before fwd only,
    compiled before eager) against (a), and of (a) and (b) against (a) in float64."""
    import torch

    pick = next(((n, m) for m in ("fwd+bwd", "fwd") for n in VARIANTS
                 if isinstance(times.get((n, m)), float)), None)
    if pick is None:
        return {"variant": "none ran", "exact": True}
    name, mode = pick
    backward = mode == "fwd+bwd"
    _, a_out, a_grads = run_once(case.written_out, case, backward)
    _, b_out, b_grads = run_once(paths[name], case, backward)
    ref = case.leaves(backward, torch.float64)
    r_out = case.written_out(ref)
    if backward:
        r_out.backward(case.grad_out.double())

    def gap(u, v):
        return (u.double() - v.double()).abs().max().item()

    res = {"variant": f"{name}, {mode}", "fwd a-b": gap(a_out, b_out), "fwd a-f64": gap(a_out, r_out),
           "fwd b-f64": gap(b_out, r_out)}
    if backward:
        res["grad a-b"] = max(gap(a_grads[n], b_grads[n]) for n in a_grads)
        res["grad a-f64"] = max(gap(a_grads[n], ref[n].grad) for n in a_grads)
        res["grad b-f64"] = max(gap(b_grads[n], ref[n].grad) for n in b_grads)
    res["exact"] = agrees(res, case.dtype, tolerance)
    return res


def agrees(res: dict, dtype, tolerance: float) -> bool:
    """fp32: (a) and (b) within `tolerance` (forward and gradients). bf16, where both round: (b)
    no further from the float64 result than twice (a)'s distance from it."""
    import torch

    if dtype == torch.float32:
        return all(res[k] <= tolerance for k in ("fwd a-b", "grad a-b") if k in res)
    return all(res[f"{k} b-f64"] <= 2 * res[f"{k} a-f64"] + tolerance for k in ("fwd", "grad") if f"{k} a-f64" in res)


def cell(v) -> str:
    return f"{v * 1e3:.2f} ms" if isinstance(v, float) else "refused"


def ratio(num, den) -> str:
    return f"{num / den:.2f}x" if isinstance(num, float) and isinstance(den, float) else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--lengths", default="64,256", help="slice lengths l, comma-separated")
    p.add_argument("--offsets", default="0,768,3840", help="cached prefix lengths o, comma-separated")
    p.add_argument("--transforms", default=",".join(TRANSFORMS))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--softcap", type=float, default=4.0, help="c of c * tanh(s / c) (default: 4)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per path and mode (median)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="fp32: the largest (a)-(b) difference that passes (bf16: (b)'s float64 error "
                        "within twice (a)'s, plus this)")
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled FlexAttention")
    p.add_argument("--quick", action="store_true", help="l = 64, o in {0, 768}, 5 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.offsets, args.repeats = "64", "0,768", 5
    at_root()
    # inductor's kernels compiled afresh: the first case's first calls are a cold compile (later
    # cases may reuse a kernel an earlier one compiled, as a stage's later shapes would)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpc-score-transforms-")
    import torch
    import torch._inductor.config as inductor_config

    torch.set_num_threads(1) if args.device == "cpu" else None
    inductor_config.fx_graph_cache = False  # every first call compiles: the cold compile time
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    # causal_attention's masks are lru-cached per shape; traced, the cache is bypassed (the mask
    # becomes part of the graph), which is what the warning is about
    warnings.filterwarnings("ignore", message=".*Dynamo detected a call to a `functools.lru_cache`.*")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    where = (f"{torch.cuda.get_device_name(0)}" if args.device.startswith("cuda") else MACHINE)
    print(f"# bench/score_transforms.py on {where}: torch {torch.__version__}, {args.dtype}, batch 1, "
          f"{args.heads} heads of {args.head_dim}, softcap {args.softcap:g}, {args.repeats} repeats, "
          f"{torch.get_num_threads()} thread(s), {load_note()}", flush=True)
    results, refusals = [], {}
    for transform in args.transforms.split(","):
        for l in (int(v) for v in args.lengths.split(",")):
            for o in (int(v) for v in args.offsets.split(",")):
                case = Case(transform, l, o, args.heads, args.head_dim, dtype, args.device, args.softcap)
                times, first, exact = measure(case, args.repeats, not args.no_compile, args.tolerance)
                for key, v in times.items():
                    if isinstance(v, str):
                        refusals.setdefault((transform, *key), v)
                results.append((transform, l, o, times, first, exact))
                print(f"{transform} l={l} o={o}: done", flush=True)
    for mode in ("fwd+bwd", "fwd"):
        rows = []
        for transform, l, o, t, _, _ in results:
            wo, woc, fc = (t.get((n, mode)) for n in ("written-out", "written-out compiled", "flex compiled"))
            rows.append([transform, l, o, o + l, cell(wo), cell(woc), *(cell(t.get((n, mode))) for n in VARIANTS),
                         cell(t[("SDPA", mode)]), ratio(wo, fc), ratio(woc, fc), ratio(wo, t[("SDPA", mode)])])
        print(f"\n## {mode} ({'forward and backward' if mode == 'fwd+bwd' else 'forward only, no autograd'})\n")
        print(table(["transform", "l", "o", "keys", "(a) written-out", "(a) compiled", "(b) flex compiled",
                     "(b) flex eager", "(c) SDPA, no transform", "(a)/(b) compiled", "(a) compiled/(b) compiled",
                     "(a)/(c)"], rows))
    print("\n(a)/(b) > 1: FlexAttention is faster; (a) compiled/(b) compiled: the same, both under torch.compile "
          "(what `--compile` stage programs would weigh); (a)/(c): the transform's cost over plain SDPA.")
    rows = []
    for transform, l, o, _, first, e in results:
        fmt = lambda k: f"{e[k]:.1e}" if k in e else "-"  # noqa: E731
        firsts = [f"{first[n][0]:.1f} s ({first[n][1]})" if n in first else "-"
                  for n in ("written-out compiled", "flex compiled")]
        rows.append([transform, l, o, e["variant"], fmt("fwd a-b"), fmt("grad a-b"), fmt("fwd a-f64"),
                     fmt("fwd b-f64"), fmt("grad a-f64"), fmt("grad b-f64"), "yes" if e["exact"] else "NO", *firsts])
    print("\n## exactness (max abs difference; (a) eager) and the compiled paths' first calls\n")
    print(table(["transform", "l", "o", "(b) compared", "fwd (a)-(b)", "grads (a)-(b)", "fwd (a)-f64",
                 "fwd (b)-f64", "grads (a)-f64", "grads (b)-f64", "agree", "(a) compiled first call",
                 "(b) compiled first call"], rows))
    if refusals:
        print("\nrefused by PyTorch here:")
        for (transform, name, mode), msg in refusals.items():
            print(f"- {transform}, {name}, {mode}: {msg}")
    bad = [f"{t} l={l} o={o}" for t, l, o, _, _, e in results if not e["exact"]]
    if bad:
        print(f"\nFlexAttention and the written-out attention DISAGREE: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
