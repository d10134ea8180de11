"""`tpc sample`: generate text from trained weights (a checkpoint directory, or a `tpc export`
.pt or .safetensors).

Sampling generates byte tokens: the prompt is encoded as UTF-8 bytes, the model predicts the
next byte from at most its training sequence length of context, and the result is decoded with
`errors="replace"` (a model may emit an incomplete UTF-8 sequence).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from tpc.compiler.frontend.model_file import logits_of
from tpc.executors.training.export import build_model, export_state_dict
from tpc.ir.diagnostics import Diagnostic, TpirError

BYTE_VOCAB = 256



def sample_text(source: str | os.PathLike, prompt: str, tokens: int, *, temperature: float = 0.8,
                top_k: int = 0, seed: int = 0, model_path: str | None = None,
                factory: str | None = None) -> str:
    """`tokens` bytes generated after `prompt` by the model in `source` (a checkpoint
    directory or an exported .pt), decoded as UTF-8 (invalid bytes replaced)."""
    model, meta = load_for_sampling(source, model_path=model_path, factory=factory)
    out = generate(model, list(prompt.encode("utf-8")), tokens, context=context_length(model, meta),
                   temperature=temperature, top_k=top_k, seed=seed)
    return bytes(out).decode("utf-8", errors="replace")


def load_for_sampling(source: str | os.PathLike, *, model_path: str | None = None,
                      factory: str | None = None) -> tuple[nn.Module, dict]:
    """The unsliced model with trained weights, from a checkpoint directory or an exported .pt or
    .safetensors (whose model file comes from `model_path`, else from the .json beside it)."""
    p = Path(source)
    if p.is_file():
        meta = _pt_meta(p)
        if model_path:
            meta = {**meta, "model_path": os.path.abspath(model_path), "sha256": None}
        if factory:
            meta["factory"] = factory
        if not meta.get("model_path"):
            raise TpirError(Diagnostic(f"{p}: no model file known for these weights",
                                       hint=f"keep {p.name}.json (written by `tpc export`) beside it, "
                                            "or sample from the checkpoint directory"))
        model = build_model(meta)
        try:
            if p.suffix == ".safetensors":
                from safetensors.torch import load_file

                sd = _with_ties(model, load_file(str(p)))
            else:
                sd = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:
            raise TpirError(Diagnostic(f"{p}: not a state_dict file ({type(e).__name__}: {e})",
                                       hint="give a .pt or .safetensors written by `tpc export`, or a "
                                            "checkpoint directory")) from None
    else:
        sd, meta = export_state_dict(p)
        model = build_model(meta)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise TpirError(Diagnostic(f"{p}: the weights do not fit the model ({str(e).splitlines()[0]})",
                                   hint="sample with the model file the weights were trained with")) from None
    return model.eval(), meta


def _with_ties(model: nn.Module, sd: dict) -> dict:
    """A safetensors file holds a tie under one of its names: give it every name the model has."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = dict(sd)
    for group in names.values():
        held = next((n for n in group if n in sd), None)
        for n in group:
            if held is not None:
                out.setdefault(n, sd[held])
    return out


def _pt_meta(pt: Path) -> dict:
    side = Path(f"{pt}.json")
    if not side.is_file():
        return {}
    try:
        return json.loads(side.read_text(encoding="utf-8"))
    except ValueError as e:
        raise TpirError(Diagnostic(f"{side}: unreadable ({e})", hint="re-run `tpc export`")) from None


def context_length(model: nn.Module, meta: dict) -> int:
    """The longest context to feed: the training sequence length (what the model has seen; a
    learned position table may not cover more), else a block_size the model declares."""
    if meta.get("seq"):
        return int(meta["seq"])
    for holder in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
        for attr in ("block_size", "max_seq_len", "max_position_embeddings"):
            value = getattr(holder, attr, None) if holder is not None else None
            if isinstance(value, int) and value > 0:
                return value
    raise TpirError(Diagnostic("cannot tell the model's maximum sequence length",
                               hint="sample from a checkpoint (its tpc.json records it) or give the model a "
                                    "`cfg.block_size`"))


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], n: int, *, context: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """Prompt followed by `n` generated byte ids. Temperature 0 is greedy (argmax); otherwise
    sample from softmax(logits / temperature), restricted to the `top_k` likeliest when
    top_k > 0. Only the first 256 logits (the byte values) are candidates, so the output always
    decodes as bytes. Deterministic for a seed."""
    if not prompt:
        raise TpirError(Diagnostic("the prompt is empty", where="--prompt",
                                   hint="give at least one character to continue, e.g. --prompt 'def '"))
    if n < 0 or temperature < 0 or top_k < 0:
        raise TpirError(Diagnostic(f"--tokens, --temperature and --top-k must be >= 0 (got {n}, {temperature}, {top_k})",
                                   where="tpc sample", hint="e.g. --tokens 200 --temperature 0.8 --top-k 40"))
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids[-context:]], dtype=torch.long)
        logits = _logits(model(x))[0, -1]
        if logits.shape[0] < BYTE_VOCAB:
            raise TpirError(Diagnostic(f"the model's vocabulary has {logits.shape[0]} entries, fewer than 256 bytes",
                                       hint="tpc sample decodes byte-level models (vocabulary >= 256)"))
        logits = logits[:BYTE_VOCAB].float()
        if temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if 0 < top_k < BYTE_VOCAB:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))
        ids.append(nxt)
    return ids


def _logits(out) -> torch.Tensor:
    """The logits (B, T, V) in what the model returns (see `logits_of`)."""
    logits = logits_of(out)
    if logits is None or logits.dim() != 3:
        raise TpirError(Diagnostic("the model's forward does not return logits of shape (batch, seq, vocab)",
                                   hint="sampling needs `model(ids) -> logits`"))
    return logits
