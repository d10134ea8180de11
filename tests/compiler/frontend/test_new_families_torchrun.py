"""One gloo torchrun run per family group of the 2025-26 families, from a config.json through
`tpc compile` and `tpc run` (2 ranks, 3 clipped steps, --verify-grads on the first): keys
written into `new_empty` (DeepSeek-V3), soft-capped scores (Gemma 2), chunked local attention
(Llama 4), a mixture of experts (Mixtral), state-space scans carried across slices (Mamba's
selective scan; Bamba's Mamba-2 layers beside attention)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tests.executors.dist_harness import torchrun_verified  # noqa: E402
from tpc.cli.main import main  # noqa: E402
from tpc.ir.parse import parse  # noqa: E402

from .hf_models import config_dict  # noqa: E402


@pytest.mark.parametrize("family,slices", [("deepseek_v3", "1,7,8"), ("gemma2", "5,3,8"), ("llama4_text", "3,6,7"),
                                           ("mixtral", "4"), ("mamba", "5,1,10"), ("bamba", "3,6,7")])
def test_torchrun_gloo_matches_autograd(tmp_path, monkeypatch, family, slices):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(config_dict(family, attn_implementation="eager")))
    path = tmp_path / "compiled.tpir"
    assert main(["compile", str(config), "-o", str(path), "--stages", "2", "--microbatches", "2", "--seq-len", "16",
                 "--batch", "4", "--slices", slices, "--schedule", "1f1b"]) == 0
    plan = parse(path.read_text(), file=str(path))
    rows = torchrun_verified(plan, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
