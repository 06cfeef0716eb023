"""Policy versions as HF model folders: config.json, tokenizer.json and safetensors shards.

``runs/<run>/policy/v<k>/`` is loadable by transformers' ``from_pretrained``. Each pipeline rank
writes its own shard (``model-0000i-of-0000p.safetensors``) in parallel; :func:`finalize_policy`
then writes the shard index and the manifest with the content hash of the shards and the sha256
of every other file (optimiser state, config, tokenizer, generation defaults). A version without
its manifest is incomplete and is never loaded; one whose files no longer hash to it is refused
(:meth:`PolicyStore.verify`).

Beside the shards, each training rank writes its AdamW state (``optim/rank<r>.safetensors``)
before the manifest, so a published version holds everything the next step needs: a resumed run
continues from it exactly as an uninterrupted one would. With train.keep_optimizer_state=latest
(the default) a run deletes a version's AdamW state once the step after the one starting from it
is logged, as no resume starts from that version again (:meth:`PolicyStore.drop_optimizer_state`).

A dropped rank's file is kept as that rank's spare (``policy/.spare/optim-rank<r>``, one per rank)
and the rank's next state is written over it in place, when it holds the same tensors (names,
dtypes, shapes: every step of a run): the header safetensors wrote stays, and the payload goes
at the offsets it records. A write into pages the file already has costs a fraction of one into a
new file on a VM that faults in every page it has not touched (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from storage.model_folder import ModelFolderError, load_hf_config, read_tokenizer_files, weight_files

__all__ = ["PolicyStoreError", "PolicyRef", "PolicyStore", "load_model_folder", "load_tokenizer_json"]

_OPTIM_DIR = "optim"
_SPARE_DIR = ".spare"
# safetensors' dtype names of the dtypes optimiser state holds (an unknown dtype: a fresh file).
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32"}

_MANIFEST = "grpoflow.json"
# Files of a source HF folder a version carries over, so that a tokenizer (chat template, special
# tokens) and generation defaults can be rebuilt from the version alone.
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


class PolicyStoreError(RuntimeError):
    """A policy version could not be written or read; the message names the version."""


@dataclass(frozen=True)
class PolicyRef:
    path: str
    version: int
    sha256: str = ""
    num_bytes: int = 0


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _overwrite_payload(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Write ``tensors`` into the safetensors file ``path`` in place, at the offsets of its header,
    if the header lists exactly these names, dtypes and shapes (and ``metadata``) and the file ends
    with the last tensor; else change nothing and return False."""
    with open(path, "r+b") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return False
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(fh.read(n))
            if header.pop("__metadata__", None) != metadata or header.keys() != tensors.keys():
                return False
            offsets, end = {}, 0
            for name, t in tensors.items():
                entry = header[name]
                begin, stop = (int(x) for x in entry["data_offsets"])
                if (entry["dtype"] != _SAFETENSORS_DTYPES.get(t.dtype) or entry["shape"] != list(t.shape)
                        or stop - begin != t.numel() * t.element_size()):
                    return False
                offsets[name], end = begin, max(end, stop)
        except (ValueError, KeyError, TypeError, AttributeError):  # not a header this writer knows
            return False
        if os.fstat(fh.fileno()).st_size != 8 + n + end:
            return False
        for name, t in tensors.items():
            fh.seek(8 + n + offsets[name])
            fh.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return True


def _file_sha256(path: Path) -> str:
    """sha256 of a file, read in chunks (no copy of the whole file in memory)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


class PolicyStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def version_path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def save_shard(self, version: int, index: int, count: int, tensors: dict[str, torch.Tensor]) -> int:
        """Write one rank's tensors (HF names); returns the bytes written."""
        path = self.version_path(version)
        path.mkdir(parents=True, exist_ok=True)
        target = path / _shard_name(index, count)
        tmp = target.with_suffix(".tmp")
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, target)
        except Exception as exc:
            raise PolicyStoreError(f"cannot write shard {index} of policy v{version}: {exc}") from exc
        return target.stat().st_size

    def optimizer_path(self, version: int, rank: int) -> Path:
        return self.version_path(version) / _OPTIM_DIR / f"rank{rank}.safetensors"

    def spare_path(self, rank: int) -> Path:
        """Where a dropped version's optimiser file of ``rank`` waits to be written over (module docstring)."""
        return self.root / _SPARE_DIR / f"optim-rank{rank}"

    def save_optimizer_state(self, version: int, rank: int, tensors: dict[str, torch.Tensor]) -> int:
        """Write training rank ``rank``'s optimiser state after the step that made ``version``, over
        the rank's spare file where it holds the same tensors; returns the bytes written."""
        target = self.optimizer_path(version, rank)
        tmp = target.with_suffix(".tmp")
        metadata = {"format": "pt"}
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(self.spare_path(rank), tmp)  # claim the spare: one rename, no other writer sees it
                reused = _overwrite_payload(tmp, tensors, metadata)
            except FileNotFoundError:
                reused = False
            if not reused:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
            os.replace(tmp, target)
        except Exception as exc:
            raise PolicyStoreError(f"cannot write the optimiser state of rank {rank} of policy v{version}: {exc}") from exc
        return target.stat().st_size

    def optimizer_ranks(self, version: int) -> int:
        """Training ranks whose optimiser state the version's manifest records (0: fresh, e.g. v0)."""
        return int(self._manifest(version).get("optimizer_ranks", 0))

    def load_optimizer_state(self, version: int, rank: int) -> dict[str, torch.Tensor] | None:
        """Rank ``rank``'s optimiser state saved with ``version``; None when the version has none (v0).
        Raises :class:`PolicyStoreError` for a version whose state :meth:`drop_optimizer_state` deleted."""
        meta = self._manifest(version)
        if meta.get("optimizer_dropped"):
            raise PolicyStoreError(f"policy v{version} no longer holds its optimiser state (deleted once a later "
                                   "step was logged, train.keep_optimizer_state=latest): training cannot restart "
                                   "from it; resume the run from its latest step or start with --new")
        if int(meta.get("optimizer_ranks", 0)) == 0:
            return None
        path = self.optimizer_path(version, rank)
        try:
            return load_file(str(path))
        except Exception as exc:
            raise PolicyStoreError(f"policy v{version}: cannot read the optimiser state {path}: {exc}") from exc

    def finalize_policy(self, version: int, hf_config: dict, tokenizer_json: str, count: int,
                        extra: dict | None = None, source: str | Path | None = None) -> PolicyRef:
        """Write the index, config and tokenizer next to the shards, then the manifest (last).
        ``source``: an HF folder whose tokenizer_config.json, special_tokens_map.json and
        generation_config.json, where present, are copied into the version."""
        path = self.version_path(version)
        # Every training rank wrote its optimiser state before this point (the train stage's gate).
        # Their files are hashed on a second thread while the shards are (hashlib lets go of the
        # GIL): together they are ~3x the weights' bytes.
        optim = sorted((path / _OPTIM_DIR).glob("rank*.safetensors"))
        with ThreadPoolExecutor(max_workers=1) as pool:
            optim_futures = {p.stem: pool.submit(_file_sha256, p) for p in optim}
            weight_map, total, digest = {}, 0, hashlib.sha256()
            for i in range(count):
                shard = path / _shard_name(i, count)
                if not shard.exists():
                    raise PolicyStoreError(f"policy v{version} lacks shard {shard.name}")
                data = shard.read_bytes()
                digest.update(data)
                total += len(data)
                with safe_open(str(shard), "pt") as f:  # the header's names, no tensor read
                    for name in f.keys():
                        weight_map[name] = shard.name
            optim_sha = {stem: f.result() for stem, f in optim_futures.items()}
        _atomic_write_text(path / "model.safetensors.index.json",
                           json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        _atomic_write_text(path / "config.json", json.dumps(hf_config, indent=1))
        _atomic_write_text(path / "tokenizer.json", tokenizer_json)
        for name in _SIDE_FILES if source is not None else ():
            if (Path(source) / name).exists():
                _atomic_write_text(path / name, (Path(source) / name).read_text())
        ref = PolicyRef(str(path), version, digest.hexdigest(), total)
        files = {name: _file_sha256(path / name) for name in ("config.json", "tokenizer.json", *_SIDE_FILES)
                 if (path / name).exists()}
        _atomic_write_text(path / _MANIFEST, json.dumps({"version": version, "sha256": ref.sha256,
                                                         "num_bytes": total, "optimizer_ranks": len(optim),
                                                         "optimizer_sha256": optim_sha, "files_sha256": files,
                                                         **(extra or {})}))
        return ref

    def save_policy(self, version: int, hf_config: dict, tokenizer_json: str,
                    tensors: dict[str, torch.Tensor], extra: dict | None = None,
                    source: str | Path | None = None) -> PolicyRef:
        """A whole policy in one shard (the base policy, tests); ``source`` as in :meth:`finalize_policy`."""
        self.save_shard(version, 0, 1, tensors)
        return self.finalize_policy(version, hf_config, tokenizer_json, 1, extra, source)

    def is_complete(self, version: int) -> bool:
        return (self.version_path(version) / _MANIFEST).exists()

    def latest_version(self) -> int | None:
        versions = [int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit()
                    and self.is_complete(int(p.name[1:]))]
        return max(versions) if versions else None

    def _manifest(self, version: int) -> dict:
        if not self.is_complete(version):
            raise PolicyStoreError(f"policy v{version} at {self.version_path(version)} is incomplete or missing")
        path = self.version_path(version) / _MANIFEST
        try:
            meta = json.loads(path.read_text())
            _ = meta["sha256"], meta["num_bytes"]
        except Exception as exc:
            raise PolicyStoreError(f"policy v{version}: unreadable manifest {path}: {exc}") from exc
        return meta

    def ref(self, version: int) -> PolicyRef:
        meta = self._manifest(version)
        if meta.get("dropped"):
            raise PolicyStoreError(f"policy v{version}: its weights were deleted (train.keep_versions); only "
                                   f"its manifest, config and tokenizer remain in {self.version_path(version)}")
        return PolicyRef(str(self.version_path(version)), version, meta["sha256"], meta["num_bytes"])

    def verify(self, version: int) -> PolicyRef:
        """The version's ref once its shards, optimiser files, config, tokenizer and side files hash
        to what its manifest records; raises :class:`PolicyStoreError` naming the first file that
        does not."""
        meta = self._manifest(version)
        path = self.version_path(version)
        for name, sha in meta.get("files_sha256", {}).items():  # config, tokenizer, generation defaults
            f = path / name
            if not f.is_file() or _file_sha256(f) != sha:
                raise PolicyStoreError(f"policy v{version}: {f} is missing or does not match the manifest's "
                                       "sha256 (edited or truncated); restore it, or start with --new")
        if meta.get("dropped"):  # published, then deleted by train.keep_versions: no weights left to check
            return PolicyRef(str(path), version, meta["sha256"], meta["num_bytes"])
        index = path / "model.safetensors.index.json"
        try:
            files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                     else [_shard_name(0, 1)])
        except Exception as exc:
            raise PolicyStoreError(f"policy v{version}: unreadable shard index {index}: {exc}") from exc
        digest, total = hashlib.sha256(), 0
        for name in files:
            try:
                data = (path / name).read_bytes()
            except OSError as exc:
                raise PolicyStoreError(f"policy v{version}: shard {path / name} is missing: {exc}") from exc
            digest.update(data)
            total += len(data)
        if digest.hexdigest() != meta["sha256"] or total != meta["num_bytes"]:
            raise PolicyStoreError(f"policy v{version}: the shards in {path} do not match the manifest's sha256 "
                                   f"(changed or truncated); delete the run folder or start with --new")
        for stem, sha in meta.get("optimizer_sha256", {}).items():
            f = path / _OPTIM_DIR / f"{stem}.safetensors"
            if not f.exists() or _file_sha256(f) != sha:
                raise PolicyStoreError(f"policy v{version}: optimiser state {f} is missing or does not match "
                                       "the manifest's sha256; delete the run folder or start with --new")
        return PolicyRef(str(path), version, meta["sha256"], meta["num_bytes"])

    def drop_optimizer_state(self, version: int) -> int:
        """Delete ``version``'s optimiser state (train.keep_optimizer_state=latest: a run that has
        logged steps ``version`` and ``version`` + 1 never resumes from it again); returns the bytes
        taken out of the version. The manifest says so first, so that :meth:`verify` stops looking
        for the files and :meth:`load_optimizer_state` refuses the version instead of starting a
        fresh optimiser. A rank's file becomes its spare where it has none (module docstring)."""
        meta = self._manifest(version)
        ranks = int(meta.get("optimizer_ranks", 0))
        if ranks == 0:
            return 0
        folder = self.version_path(version) / _OPTIM_DIR
        freed = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        _atomic_write_text(self.version_path(version) / _MANIFEST, json.dumps(
            {**meta, "optimizer_ranks": 0, "optimizer_sha256": {}, "optimizer_dropped": ranks}))
        (self.root / _SPARE_DIR).mkdir(exist_ok=True)
        for rank in range(ranks):
            spare = self.spare_path(rank)
            if not spare.exists():
                try:
                    os.replace(self.optimizer_path(version, rank), spare)
                except FileNotFoundError:  # a drop cut short earlier moved it already
                    pass
        shutil.rmtree(folder, ignore_errors=True)
        return freed

    def is_dropped(self, version: int) -> bool:
        """Whether ``version`` was published and its weights deleted since (:meth:`drop_version`)."""
        return self.is_complete(version) and bool(self._manifest(version).get("dropped"))

    def drop_version(self, version: int) -> int:
        """Delete ``version``'s weights and optimiser state (train.keep_versions), keeping its
        manifest (marked dropped: a resume still counts the version published), config and
        tokenizer files; returns the bytes freed. The manifest says so first, so a drop cut short
        leaves a version that is refused as dropped, never one half read."""
        meta = self._manifest(version)
        if meta.get("dropped"):
            return 0
        path = self.version_path(version)
        weights = [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]
        freed = sum(p.stat().st_size for p in weights if p.exists())
        freed += sum(p.stat().st_size for p in (path / _OPTIM_DIR).glob("*.safetensors"))
        _atomic_write_text(path / _MANIFEST, json.dumps({**meta, "dropped": True, "optimizer_ranks": 0,
                                                         "optimizer_sha256": {}}))
        for p in weights:
            p.unlink(missing_ok=True)
        shutil.rmtree(path / _OPTIM_DIR, ignore_errors=True)
        return freed

    def remove_from(self, version: int) -> None:
        """Drop versions >= ``version`` (a resumed run regenerates them)."""
        for p in self.root.glob("v*"):
            if p.name[1:].isdigit() and int(p.name[1:]) >= version:
                shutil.rmtree(p)


def load_model_folder(path: str | Path, names: set[str] | None = None) -> tuple[dict, str, dict[str, torch.Tensor]]:
    """(HF config dict, tokenizer.json text, tensors) of an HF model folder; ``names`` limits the
    tensors read to those a pipeline stage needs."""
    path = Path(path)
    try:
        hf_config = load_hf_config(path, label=f"cannot load the model folder {path}")
    except ModelFolderError as exc:
        raise PolicyStoreError(str(exc)) from exc
    try:
        tokenizer_json = read_tokenizer_files(path, ("tokenizer.json",)).get("tokenizer.json", b"").decode()
        tensors: dict[str, torch.Tensor] = {}
        for f in weight_files(path):
            if names is None:
                tensors.update(load_file(str(path / f)))
                continue
            with safe_open(str(path / f), "pt") as fh:  # only the named tensors are read
                tensors.update({k: fh.get_tensor(k) for k in fh.keys() if k in names})
    except Exception as exc:
        raise PolicyStoreError(f"cannot load the model folder {path}: {exc}") from exc
    return hf_config, tokenizer_json, tensors


def load_tokenizer_json(path: str | Path) -> str:
    """The tokenizer.json text of a policy version (or any HF model folder)."""
    tok_path = Path(path) / "tokenizer.json"
    try:
        return tok_path.read_text()
    except Exception as exc:
        raise PolicyStoreError(f"cannot read the tokenizer {tok_path}: {exc}") from exc

