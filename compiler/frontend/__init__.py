"""The front end: load a model file, capture it with a symbolic sequence length, check that it
can be sliced by tokens, rewrite it (sliced causal attention with a KV cache, positions shifted by
the slice offset, the loss appended), cut it into units and build stage modules."""

from tpc.compiler.frontend.model_file import file_sha256, load_model, logits_of, read_vocab
from tpc.compiler.frontend.sliced import SlicedModel
from tpc.compiler.frontend.stage import StageModule

__all__ = ["load_model", "file_sha256", "logits_of", "read_vocab", "SlicedModel", "StageModule"]
