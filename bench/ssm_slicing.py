"""What token slicing costs a state-space model, and what its carried state weighs.

For Hugging Face Mamba-2 and Mamba (random weights from configs, float32, one thread), one
stage holding the whole model runs a forward and backward of one sequence of L tokens cut into
1, 2, 4 and 8 equal slices (`StageRuntime`, the carried state between them), side by side in
one process with the model as written under plain autograd (Hugging Face's own reference scan
over the whole sequence). Printed: each step's median time and its ratio to the model's, and
the loss difference. Then the memory the cache holds per sequence at length L: the state-space
layers' carried state (counted once per sequence whatever L) and their convolutions' windows,
against the keys and values of a Llama of the same width and depth at L.

    OMP_NUM_THREADS=1 python bench/ssm_slicing.py [--seq-len 1024] [--repeats 5] [--quick]
    python bench/ssm_slicing.py --device cuda          # on a GPU (bench/gpu_checks.py runs it)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, table  # noqa: E402

WIDTH, LAYERS, VOCAB = 256, 4, 512
CONFIGS = {
    "mamba2": dict(model_type="mamba2", hidden_size=WIDTH, num_hidden_layers=LAYERS, state_size=64, expand=2,
                   num_heads=16, head_dim=32, n_groups=1, chunk_size=64, conv_kernel=4),
    "mamba": dict(model_type="mamba", hidden_size=WIDTH, num_hidden_layers=LAYERS, state_size=16, expand=2,
                  conv_kernel=4, use_mambapy=False),
    "llama": dict(model_type="llama", hidden_size=WIDTH, num_hidden_layers=LAYERS, intermediate_size=4 * WIDTH,
                  num_attention_heads=8, num_key_value_heads=8),
}


def _model(family: str, seq_len: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpc.compiler.frontend.hf import returning_logits

    settings = dict(CONFIGS[family], vocab_size=VOCAB, max_position_embeddings=seq_len, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    return returning_logits(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def _timed(fn, repeats: int, sync) -> tuple[float, float]:
    fn()  # warm-up
    times, value = [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        value = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), value


def step_times(family: str, seq_len: int, repeats: int, counts, device: str = "cpu") -> list[list]:
    import torch
    import torch.nn.functional as F

    from tpc.compiler.frontend import SlicedModel
    from tpc.executors.stage_runtime import StageRuntime

    model = _model(family, seq_len)
    sm = SlicedModel.from_model(model, seq_len=seq_len, vocab=VOCAB, check_slices=None)
    stage = sm.stage_module(0, sm.num_units).to(device)
    model.to(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, seq_len), generator=g).to(device)
    targets = torch.randint(3, VOCAB, (1, seq_len), generator=g).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def plain():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        return loss.item()

    def sliced(n: int):
        def run():
            stage.zero_grad(set_to_none=True)
            rt = StageRuntime(stage, loss_scale=1.0)
            l = seq_len // n
            total = 0.0
            for i in range(n):
                total += float(rt.forward(0, i, ids[:, i * l:(i + 1) * l], i * l, targets[:, i * l:(i + 1) * l],
                                          capacity=seq_len))
            for i in reversed(range(n)):
                rt.backward(0, i, None)
            return total
        return run

    base, ref = _timed(plain, repeats, sync)
    rows = [[family, "model as written", f"{base * 1e3:.0f} ms", "1.00x", "-"]]
    print(f"  {family}: the model as written, {base * 1e3:.0f} ms", flush=True)
    for n in counts:
        t, loss = _timed(sliced(n), repeats, sync)
        rows.append([family, f"{n} slice{'s' if n > 1 else ''} of {seq_len // n}", f"{t * 1e3:.0f} ms",
                     f"{t / base:.2f}x", f"{abs(loss - ref) / abs(ref):.1e}"])
        print(f"  {family}: {n} slices, {t * 1e3:.0f} ms", flush=True)
    return rows


def cache_bytes(seq_len: int) -> list[list]:
    from tpc.compiler.frontend import SlicedModel
    from tpc.compiler.frontend.ssm_state import STATE

    rows = []
    for family in ("mamba2", "mamba", "llama"):
        sm = SlicedModel.from_model(_model(family, seq_len), seq_len=seq_len, vocab=VOCAB, check_slices=None)
        state = sum(n for unit in sm.unit_kv for n, w in unit if w == STATE)
        windows = sum(n * min(seq_len, w - 1) for unit in sm.unit_kv for n, w in unit if w not in (STATE, None))
        full = sum(n * seq_len for unit in sm.unit_kv for n, w in unit if w is None)
        total = 4 * (state + windows + full)
        rows.append([family, f"{4 * state / 2**10:.0f} KiB", f"{4 * windows / 2**10:.0f} KiB",
                     f"{4 * full / 2**10:.0f} KiB", f"{total / 2**10:.0f} KiB"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="L=64, 1 repeat, Mamba-2 only")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu, one thread)")
    args = ap.parse_args()
    at_root()
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    seq, repeats = (64, 1) if args.quick else (args.seq_len, args.repeats)
    families = ("mamba2",) if args.quick else ("mamba2", "mamba")
    where = MACHINE if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}; width {WIDTH}, {LAYERS} layers, one sequence of {seq} tokens, "
          f"forward + backward, median of {repeats}")
    rows = [r for f in families for r in step_times(f, seq, repeats, (1, 2, 4, 8), args.device)]
    print(table(["model", "run", "step", "vs the model", "loss rel. diff"], rows))
    print(f"\ncache per sequence at L={seq} (float32): carried scan state, convolution windows, full KV")
    print(table(["model", "scan state", "conv windows", "keys/values", "total"], cache_bytes(seq)))


if __name__ == "__main__":
    main()
