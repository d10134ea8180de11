"""A gloo torchrun run per family group of the 2025-26 families, from a config.json through
`tpc compile` and `tpc run` (2 ranks, 3 clipped steps, --verify-grads on the first): keys
written into `new_empty` (DeepSeek-V3), soft-capped scores (Gemma 2), chunked local attention
(Llama 4), a mixture of experts (Mixtral), state-space scans carried across slices (Mamba's
selective scan; Bamba's Mamba-2 layers beside attention). The six plans run in one torchrun
launch, each rank running `tpc run` of each plan in turn (the launch and the imports once);
each plan's run is checked on its own and a failure names its family."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tests.executors.dist_harness import torchrun_verified_many  # noqa: E402
from tpc.cli.main import main  # noqa: E402
from tpc.ir.parse import parse  # noqa: E402

from .hf_models import config_dict  # noqa: E402

FAMILIES = [("deepseek_v3", "1,7,8"), ("gemma2", "5,3,8"), ("llama4_text", "3,6,7"), ("mixtral", "4"),
            ("mamba", "5,1,10"), ("bamba", "3,6,7")]


def test_torchrun_gloo_matches_autograd(tmp_path, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plans = {}
    for family, slices in FAMILIES:
        config = tmp_path / family / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps(config_dict(family, attn_implementation="eager")))
        path = tmp_path / family / "compiled.tpir"
        assert main(["compile", str(config), "-o", str(path), "--stages", "2", "--microbatches", "2", "--seq-len",
                     "16", "--batch", "4", "--slices", slices, "--schedule", "1f1b"]) == 0, family
        plans[f"{family}-{slices.replace(',', '.')}"] = parse(path.read_text(), file=str(path))
    runs = torchrun_verified_many(plans, tmp_path)
    assert set(runs) == set(plans)
    for case, rows in runs.items():
        assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows), (case, rows)
