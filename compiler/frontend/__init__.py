"""The front end: load a model file, capture it with a symbolic sequence length, check that it
can be sliced by tokens, rewrite it (sliced causal attention with a KV cache, positions shifted by
the slice offset, the loss appended), cut it into units and build stage modules."""

from typing import TYPE_CHECKING

__all__ = ["load_model", "file_sha256", "logits_of", "read_vocab", "SlicedModel", "StageModule"]

if TYPE_CHECKING:
    from tpc.compiler.frontend.model_file import file_sha256, load_model, logits_of, read_vocab
    from tpc.compiler.frontend.sliced import SlicedModel
    from tpc.compiler.frontend.stage import StageModule


def __getattr__(name: str):
    """The names above, imported on first use (PEP 562): importing one module of the front end
    (model_file, say) does not import the whole front end and torch.export with it."""
    if name in ("load_model", "file_sha256", "logits_of", "read_vocab"):
        from tpc.compiler.frontend import model_file as module
    elif name == "SlicedModel":
        from tpc.compiler.frontend import sliced as module
    elif name == "StageModule":
        from tpc.compiler.frontend import stage as module
    else:
        raise AttributeError(f"module 'tpc.compiler.frontend' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
