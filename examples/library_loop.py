"""Your own training loop, pipelined by tpc (docs/library.md).

    torchrun --nproc-per-node 2 examples/library_loop.py          # two pipeline stages, gloo on CPU
    python examples/library_loop.py --interpret                   # every rank in this process

The model is examples/gpt.py's GPT, built here as any script builds its model; the optimizer,
the learning-rate schedule, gradient clipping, the batches and the printing are the script's
own. tpc compiles the model into a plan (2 stages, 4 micro-batches, 2 token slices each) and
runs this rank's stages of it.
"""

import argparse
import os
import sys

import torch

import tpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import model as gpt  # noqa: E402 - the example model beside this file

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--interpret", action="store_true", help="run every rank in this process")
parser.add_argument("--device", default="cpu", help="cpu | cuda (each rank on cuda:LOCAL_RANK) | auto")
args = parser.parse_args()

torch.manual_seed(0)  # every rank builds the same weights
model = gpt(n_layer=4, n_embd=64, n_head=4, block_size=64)
plan = tpc.compile(model, seq_len=64, batch=8, stages=2, microbatches=4, slices=2, schedule="1f1b")
pipe = tpc.pipeline(plan, model, interpret=args.interpret, device=args.device)

optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=args.steps)
data = torch.Generator().manual_seed(1)  # the same batches on every rank
rank = int(os.environ.get("RANK", 0))

for step in range(args.steps):
    # a toy task a model can learn: each row counts up from a random start
    start = torch.randint(0, 192, (8, 1), generator=data)
    tokens = start + torch.arange(65)
    loss = pipe.step(tokens[:, :-1], tokens[:, 1:])  # every micro-batch and slice of the step
    norm = pipe.clip_grad_norm_(1.0)  # the whole model's norm, over both ranks
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
        print(f"step {step + 1}: loss {loss.item():.4f}, grad norm {norm.item():.3f}", flush=True)

val = pipe.eval_step(tokens[:, :-1], tokens[:, 1:])  # the plan's evaluation program
if rank == 0:
    print(f"evaluation loss {val.item():.4f}; this process trains {len(pipe.state_dict())} tensors", flush=True)
pipe.close()
