"""`tpc export` and `tpc sample`: from a sharded training checkpoint back to the plain model.

Export gathers every stage's parameters from the rank shards of a checkpoint (they are stored
under the original model's parameter names) and writes one state_dict of the *unsliced* model,
which loads with `model().load_state_dict(sd)` (strict):

- the model is rebuilt from the file and factory recorded in the checkpoint's tpc.json, so the
  state_dict has exactly the keys and order of `model().state_dict()`;
- a tied parameter (one tensor under several names, e.g. the embedding and the output head) is
  held by several ranks; the copy of the lowest rank is written once, under every name the
  model's state_dict has for it (torch.save keeps them one tensor);
- buffers (a causal mask, a RoPE table) are not trained and not checkpointed: they come from
  the model's own constructor.

Beside model.pt goes model.pt.json (model file, factory, step), so `tpc sample model.pt` can
rebuild the model without the checkpoint; model.pt itself stays a plain state_dict.

Sample generates byte tokens: the prompt is encoded as UTF-8 bytes, the model predicts the next
byte from at most its training sequence length of context, and the result is decoded with
`errors="replace"` (a model may emit an incomplete UTF-8 sequence).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn as nn

from tpc.executors.training.checkpoint import load_checkpoint, read_meta, resolve_checkpoint, stored_entries
from tpc.ir.diagnostics import Diagnostic, TpirError

_PARAM_KEY = re.compile(r"^rank(\d+)\.params\.(.+)$")
BYTE_VOCAB = 256


# ------------------------------------------------------------------------------ export


def export_from_cli(args) -> int:
    """`tpc export CKPT -o model.pt`."""
    sd, meta = export_state_dict(args.checkpoint)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, out)
    sidecar = {k: meta[k] for k in ("model_path", "factory", "sha256", "step", "seq", "vocab") if k in meta}
    Path(f"{out}.json").write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    n_params = sum(t.numel() for t in {id(t): t for t in sd.values()}.values())
    print(f"wrote {out}: {len(sd)} tensors, {n_params:,} values, from step {meta['step']} "
          f"of {meta['model_path']}")
    return 0


def export_state_dict(checkpoint: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The unsliced model's state_dict from a checkpoint (root or step directory), and its tpc.json."""
    step_dir = resolve_checkpoint(checkpoint)
    meta = read_meta(step_dir)
    model = build_model(meta)
    trained = _gather_params(step_dir)
    return _assemble(model, trained, step_dir), meta


def build_model(meta: dict) -> nn.Module:
    """`factory()` of the model file recorded in a checkpoint's (or export's) metadata."""
    from tpc.compiler.frontend.model_file import file_sha256, load_model

    path = meta.get("model_path")
    if not path:
        raise TpirError(Diagnostic("the checkpoint does not record its model file",
                                   hint="it was written by an older tpc; export needs tpc.json's model_path"))
    if not os.path.isfile(path):
        raise TpirError(Diagnostic(f"the model file the checkpoint was trained from is gone: {path}",
                                   hint="restore the file at that path (tpc.json in the checkpoint records it)"))
    if meta.get("sha256") and file_sha256(path) != meta["sha256"]:
        print(f"warning: {path} has changed since the checkpoint was written; "
              "the weights load only if the parameter names and shapes are the same", file=sys.stderr)
    return load_model(path, meta.get("factory", "model"))


def _gather_params(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every parameter stored by any rank, each from the lowest rank holding it (data replica 0,
    and for a tie the first stage's copy). All copies of a parameter are equal after a step, so
    which one is read does not matter; the lowest is a deterministic choice."""
    owner: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    for key, entry in stored_entries(step_dir).items():
        m = _PARAM_KEY.match(key)
        if m is None:
            continue
        rank, name = int(m.group(1)), m.group(2)
        if name not in owner or rank < owner[name]:
            owner[name] = rank
            shapes[name] = (tuple(entry.size), entry.properties.dtype)
    if not owner:
        raise TpirError(Diagnostic(f"{step_dir}: the checkpoint holds no parameters",
                                   hint="give a checkpoint written by `tpc run --checkpoint-dir`"))
    template: dict[str, dict] = {}
    for name, rank in owner.items():
        size, dtype = shapes[name]
        template.setdefault(f"rank{rank}", {}).setdefault("params", {})[name] = torch.empty(size, dtype=dtype)
    load_checkpoint(step_dir, template)
    return {name: template[f"rank{rank}"]["params"][name] for name, rank in owner.items()}


def _assemble(model: nn.Module, trained: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """Fill `model.state_dict()`'s keys: parameters from `trained` (through any alias of a tied
    tensor), buffers from the model itself. Every stored parameter must find a place."""
    aliases = _alias_groups(model)
    base = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing, wrong = [], []
    for key, value in base.items():
        if key not in aliases:  # a buffer: from the model's constructor
            out[key] = value
            continue
        found = [n for n in aliases[key] if n in trained]
        if not found:
            missing.append(key)
            continue
        tensor = trained[found[0]]
        used.update(found)
        if tuple(tensor.shape) != tuple(value.shape):
            wrong.append(f"{key}: checkpoint {list(tensor.shape)}, model {list(value.shape)}")
            continue
        out[key] = tensor.to(value.dtype)
    extra = sorted(set(trained) - used)
    problems = ([f"not in the checkpoint: {_listing(missing, ', ')}"] if missing else []) + \
               ([f"shapes differ: {_listing(wrong, '; ')}"] if wrong else []) + \
               ([f"not in the model: {_listing(extra, ', ')}"] if extra else [])
    if problems:
        raise TpirError(Diagnostic(f"{where}: the checkpoint does not fit the model file ({' | '.join(problems)})",
                                   hint="export with the model file (and factory) the run was trained with"))
    # one tensor per tie, shared by all its names
    shared: dict[int, torch.Tensor] = {}
    for key in out:
        if key in aliases:
            group = id(aliases[key])
            out[key] = shared.setdefault(group, out[key])
    return out


def _listing(items: list[str], sep: str, show: int = 3) -> str:
    more = f"{sep}... ({len(items) - show} more)" if len(items) > show else ""
    return sep.join(items[:show]) + more


def _alias_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> every name of the same tensor (one entry per name; the same tuple
    object for all names of a tie)."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    out = {}
    for names in by_tensor.values():
        group = tuple(names)
        for n in names:
            out[n] = group
    return out


# ------------------------------------------------------------------------------ sample


def sample_from_cli(args) -> int:
    """`tpc sample CKPT|model.pt --prompt TEXT --tokens N --temperature T --top-k K --seed S`."""
    model, meta = load_for_sampling(args.checkpoint, model_path=getattr(args, "model", None),
                                    factory=getattr(args, "factory", None))
    prompt = args.prompt.encode("utf-8")
    out = generate(model, list(prompt), args.tokens, context=context_length(model, meta),
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(bytes(out).decode("utf-8", errors="replace"))
    return 0


def load_for_sampling(source: str | os.PathLike, *, model_path: str | None = None,
                      factory: str | None = None) -> tuple[nn.Module, dict]:
    """The unsliced model with trained weights, from a checkpoint directory or an exported .pt
    (whose model file comes from `model_path`, else from the .pt.json beside it)."""
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
            sd = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:
            raise TpirError(Diagnostic(f"{p}: not a state_dict file ({type(e).__name__}: {e})",
                                       hint="give a .pt written by `tpc export`, or a checkpoint directory")) from None
    else:
        sd, meta = export_state_dict(p)
        model = build_model(meta)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise TpirError(Diagnostic(f"{p}: the weights do not fit the model ({str(e).splitlines()[0]})",
                                   hint="sample with the model file the weights were trained with")) from None
    return model.eval(), meta


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
    """Models return logits (B, T, V), or a tuple/dict whose first entry / "logits" they are."""
    if isinstance(out, dict):
        out = out.get("logits")
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise TpirError(Diagnostic("the model's forward does not return logits of shape (batch, seq, vocab)",
                                   hint="sampling needs `model(ids) -> logits`"))
    return out
