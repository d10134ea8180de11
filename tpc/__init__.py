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

from typing import TYPE_CHECKING

__all__ = ["compile", "load", "pipeline", "with_forward", "Pipeline", "Plan", "LoadedBundle"]

if TYPE_CHECKING:
    from tpc.executors.library import LoadedBundle, Pipeline, Plan, compile, load, pipeline, with_forward


def __getattr__(name: str):
    """The public names are read from tpc.executors.library on first use (PEP 562), so that
    `import tpc.cli.main` (every `tpc` command, every torchrun rank) and `import tpc` load
    torch and the front end only where they are used (docs/benchmarks.md, "Import time")."""
    if name in __all__:
        from tpc.executors import library

        value = getattr(library, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
