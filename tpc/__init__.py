"""tpc: token-level pipeline-parallel training of Transformer language models, compiled.

The public API (docs/library.md); everything else under `tpc.` is private and may change.

    import tpc
    plan = tpc.compile(model, seq_len=256, batch=16, stages=2, microbatches=4, slices=2)
    pipe = tpc.pipeline(plan, model)          # under torchrun: this rank's stages
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    for inputs, targets in batches:
        loss = pipe.step(inputs, targets)     # every micro-batch and token slice of one step
        pipe.clip_grad_norm_(1.0)             # the whole model's norm, over every rank
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
"""

from tpc.executors.library import LoadedBundle, Pipeline, Plan, compile, load, pipeline, with_forward

__all__ = ["compile", "load", "pipeline", "with_forward", "Pipeline", "Plan", "LoadedBundle"]
