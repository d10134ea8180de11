"""Profiles with known unit costs, for testing the plan search without timing anything."""

from __future__ import annotations

from tpc.compiler.costmodel.fit import CurveFit
from tpc.compiler.costmodel.store import Profile, UnitProfile

LENGTHS = (1, 8, 16, 32, 64)
BATCH_SIZES = (1, 2, 4)


def unit(label: str, fixed: float, per_token: float, per_context: float = 0.0,
         kv_bytes_per_token: int = 0, param_bytes: int = 1000) -> UnitProfile:
    """A unit whose forward takes fixed + per_token*l + per_context*l*c seconds for one
    sequence (b sequences: b times the token terms), backward twice that."""

    def curve(b: int, k: float) -> CurveFit:
        base = tuple(k * (fixed + b * per_token * l) for l in LENGTHS)
        return CurveFit(lengths=LENGTHS, base=base, coef=(0.0, 0.0, 0.0, k * b * per_context),
                        rel_error=0.0)

    return UnitProfile(label=label, fwd=tuple(curve(b, 1.0) for b in BATCH_SIZES),
                       bwd=tuple(curve(b, 2.0) for b in BATCH_SIZES),
                       kv_bytes_per_token=kv_bytes_per_token, param_bytes=param_bytes)


def profile(units, sha256: str = "0" * 64, model_path: str = "model.py", act_bytes_per_token: int = 128,
            link=(50e-6, 2e9)) -> Profile:
    return Profile(model_path=model_path, model_sha256=sha256, factory="model", device="cpu:synthetic",
                   seq_len=max(LENGTHS), hidden=32, batch_sizes=BATCH_SIZES, units=tuple(units),
                   act_bytes_per_token=act_bytes_per_token, link_latency=link[0],
                   link_bandwidth=link[1])


def tiny_gpt_profile(sha256: str, head_scale: float = 1.0) -> Profile:
    """The 4 units of tests/compiler/models/tiny_gpt.py: embedding, two blocks, head."""
    return profile([
        unit("transformer.wte+transformer.drop", 20e-6, 0.2e-6, param_bytes=8192),
        unit("transformer.h.0", 60e-6, 2e-6, 2e-9, kv_bytes_per_token=256, param_bytes=50_000),
        unit("transformer.h.1", 60e-6, 2e-6, 2e-9, kv_bytes_per_token=256, param_bytes=50_000),
        unit("transformer.ln_f+lm_head", 30e-6, head_scale * 1e-6, param_bytes=8448),
    ], sha256=sha256, model_path="tests/compiler/models/tiny_gpt.py")
