"""A user's own training loop, twice: through `tpc.pipeline` and in plain PyTorch on the whole
model. Both draw the same batches and run the same torch.optim.SGD (momentum), OneCycleLR
schedule and global gradient clipping; the pipeline's loop runs as one rank of a torchrun
world (tests/executors/dist_harness.launch) or with every rank in one process."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.compiler.frontend.hf_models import VOCAB, config_dict

STEPS, ROWS, SEQ, CLIP = 4, 4, 16, 0.05


def hf_llama(seed: int = 0) -> torch.nn.Module:
    """A tiny Hugging Face Llama from its config, random weights (code nobody here wrote)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = config_dict("llama", num_hidden_layers=4, tie_word_embeddings=True)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def batches():
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def optimizer_of(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=STEPS)


def plain_loop(model) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The loop in one process on the whole model: losses, then the weights."""
    model = copy.deepcopy(model)
    opt, sched = optimizer_of(model.parameters())
    losses = []
    for x, y in batches():
        out = logits(model, x)
        loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def tpc_loop(model, interpret: bool, **compile_options) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same loop through tpc: losses, then this process's weights by the model's names."""
    import tpc

    net = tpc.with_forward(model, logits)
    plan = tpc.compile(net, seq_len=SEQ, batch=ROWS, **compile_options)
    pipe = tpc.pipeline(plan, net, interpret=interpret, device="cpu")
    opt, sched = optimizer_of(pipe.parameters())
    losses = []
    for x, y in batches():
        loss = pipe.step(x, y)
        pipe.clip_grad_norm_(CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    state = pipe.state_dict()
    pipe.close()
    return losses, {n: v.clone() for n, v in state.items()}


def rank_main(rank: int, out_dir: str, compile_options: dict) -> None:
    """One torchrun rank of `tpc_loop`; writes rank<r>.pt with its losses and weights."""
    losses, state = tpc_loop(hf_llama(), interpret=False, **compile_options)
    torch.save({"losses": losses, "state": state}, Path(out_dir) / f"rank{rank}.pt")
