"""Weights in files a run can start from (`tpc run --init-from PATH`): what each file holds, and
reading some of its tensors without reading the rest.

- a state_dict saved with `torch.save` (.pt, .pth, .bin): loaded with `weights_only=True`, so
  unpickling runs no code, and memory-mapped, so only the tensors that are used are read;
- a .safetensors file;
- a Hugging Face model directory: config.json beside model.safetensors, or beside
  model.safetensors.index.json and the shards it names (local files; nothing is downloaded);
- a tpc checkpoint (DIR or DIR/step_NNNNNN): its parameters (not its optimizer state).

`open_weights(path)` picks by what the path is; every file that cannot be read is a located
`TpirError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Iterable, Protocol

import torch

from tpc.ir.diagnostics import Diagnostic, TpirError

# safetensors' dtype names
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"


def _refuse(path, what: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(f"{path}: {what}", where="--init-from", hint=hint))


class WeightFile(Protocol):
    """Named tensors in a file: `entries()` gives name -> (shape, dtype) without reading the
    data, `read(names)` the tensors of those names."""

    path: Path
    what: str  # in words, for messages

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]: ...


class TorchFile:
    """A state_dict written by torch.save."""

    def __init__(self, path: Path):
        self.path, self.what = path, "state_dict"
        self._sd = self._load()

    def _load(self) -> dict[str, torch.Tensor]:
        try:
            try:
                sd = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap can only be used" not in str(e):
                    raise
                sd = torch.load(self.path, map_location="cpu", weights_only=True)  # the legacy format
        except pickle.UnpicklingError as e:
            raise _refuse(self.path, f"not a weights-only file: loading it would run code "
                                     f"({_unsupported(e)})",
                          "save only tensors: torch.save(model.state_dict(), PATH), or a .safetensors "
                          "file; tpc never unpickles code") from None
        except Exception as e:  # noqa: BLE001 - a damaged file raises whatever the reader meets
            raise _refuse(self.path, f"not a readable torch.save file ({type(e).__name__}: {_first_line(e)})",
                          "the file is damaged or truncated: save it again") from None
        if not isinstance(sd, dict) or not sd or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                         for k, v in sd.items()):
            shown = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(sd.items())[:4]) \
                if isinstance(sd, dict) else type(sd).__name__
            raise _refuse(self.path, f"not a flat state_dict of tensors ({shown or 'empty'})",
                          "save model.state_dict() itself (names -> tensors), not a dict around it")
        return sd

    def entries(self):
        return {k: (tuple(v.shape), v.dtype) for k, v in self._sd.items()}

    def read(self, names):
        return {n: self._sd[n] for n in names}


class SafetensorsFiles:
    """One .safetensors file, or the shards of a Hugging Face directory (name -> shard)."""

    def __init__(self, path: Path, shards: dict[str, Path] | None = None, what: str = "safetensors file",
                 config: dict | None = None):
        self.path, self.what = path, what
        self.config = config  # a Hugging Face directory's config.json
        files = sorted(set(shards.values())) if shards else [path]
        self._where: dict[str, Path] = {}
        self._entries: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for f in files:
            for name, entry in _safetensors_header(f).items():
                if shards is not None and shards.get(name, f) != f:
                    continue  # the index names another shard for it
                self._where[name] = f
                self._entries[name] = entry
        if shards is not None:
            lost = sorted(n for n in shards if n not in self._entries)
            if lost:
                raise _refuse(path, f"{HF_INDEX} names tensors its shards do not hold: {', '.join(lost[:4])}",
                              "the directory is incomplete: copy every shard the index names")

    def entries(self):
        return dict(self._entries)

    def read(self, names):
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._where[n], []).append(n)
        out = {}
        for f, group in by_file.items():
            try:
                with safe_open(str(f), framework="pt", device="cpu") as handle:
                    for n in group:
                        out[n] = handle.get_tensor(n)
            except Exception as e:  # noqa: BLE001
                raise _refuse(f, f"reading its tensors failed ({_first_line(e)})",
                              "the file is damaged or truncated: write it again") from None
        return out


def _safetensors_header(f: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) from a safetensors header; a truncated or damaged file is refused."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise _refuse(f, "reading .safetensors needs the `safetensors` package",
                      "pip install safetensors") from None
    if not f.is_file():
        raise _refuse(f, "no such file", "give a .safetensors file that exists")
    out = {}
    try:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise _refuse(f, f"tensor {name} has dtype {sl.get_dtype()}, which tpc does not read",
                                  "convert the weights to float32 or bfloat16")
                out[name] = (tuple(sl.get_shape()), dtype)
    except TpirError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError for a truncated or damaged header
        raise _refuse(f, f"not a readable safetensors file ({_first_line(e)})",
                      "the file is damaged or truncated: write it again") from None
    return out


class CheckpointWeights:
    """The parameters of a tpc checkpoint (either format)."""

    def __init__(self, path: Path):
        from tpc.executors.training.model_state import layout_of

        self.step_dir, meta, self.layout = layout_of(path)
        self.path, self.what = self.step_dir, f"tpc checkpoint at step {meta['step']}"

    def entries(self):
        return {n: self.layout.shape(n) for n in self.layout.names}

    def read(self, names):
        from tpc.executors.training.model_state import read_params

        return read_params(self.step_dir, self.layout, names)


def hf_directory(path: Path) -> SafetensorsFiles:
    """A Hugging Face model directory: config.json and its safetensors weights."""
    if not (path / "config.json").is_file():
        raise _refuse(path, "a directory that is neither a Hugging Face model directory (no config.json) "
                            "nor a tpc checkpoint (no tpc.json or `latest`)",
                      "give a state_dict .pt, a .safetensors file, a directory saved with "
                      "save_pretrained, or a checkpoint directory")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise _refuse(path / "config.json", f"not valid JSON ({e})", "give the directory save_pretrained wrote") from None
    index = path / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = {str(k): path / str(v) for k, v in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _refuse(index, f"not a safetensors index ({type(e).__name__}: {e})",
                          "it must hold {\"weight_map\": {name: shard file}}") from None
        for f in sorted(set(shards.values())):
            if not f.is_file():
                raise _refuse(index, f"names the shard {f.name}, which is not in the directory",
                              "copy every shard the index names (nothing is downloaded)")
        return SafetensorsFiles(path, shards, f"Hugging Face model directory ({len(set(shards.values()))} shards)",
                                config)
    if (path / HF_SINGLE).is_file():
        return SafetensorsFiles(path / HF_SINGLE, None, "Hugging Face model directory", config)
    bins = sorted(p.name for p in path.glob("*.bin"))
    raise _refuse(path, "the Hugging Face model directory has no safetensors weights "
                        f"({HF_SINGLE} or {HF_INDEX})" + (f"; it holds {', '.join(bins)}" if bins else ""),
                  (f"pass the file itself (--init-from {path / bins[0]}: read weights-only) or " if bins else "")
                  + "save the model with save_pretrained(..., safe_serialization=True)")


def open_weights(path: str | Path) -> WeightFile:
    """The weights at `path`: a torch.save file, a .safetensors file, a Hugging Face model
    directory, or a tpc checkpoint directory."""
    p = Path(path)
    if not p.exists():
        raise _refuse(p, "no such file or directory",
                      "give a state_dict .pt, a .safetensors file, a Hugging Face model directory or a "
                      "tpc checkpoint")
    if p.is_dir():
        from tpc.executors.training.checkpoint import LATEST, META_FILE

        if (p / META_FILE).is_file() or (p / LATEST).is_file() or any(p.glob("step_*")):
            return CheckpointWeights(p)
        return hf_directory(p)
    if p.suffix == ".safetensors":
        return SafetensorsFiles(p)
    return TorchFile(p)


def _unsupported(e: Exception) -> str:
    """The line of a weights-only refusal that names what would have run."""
    for line in str(e).splitlines():
        line = line.strip()
        if "Unsupported" in line or "GLOBAL" in line:
            return line.split(" was not an allowed global")[0].removeprefix("WeightsUnpickler error: ")
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
