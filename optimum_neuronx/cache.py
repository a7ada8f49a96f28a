"""Compile cache: finished exports stored under a key, so the same export never compiles twice.

The key hashes everything that determines an artifact: the model config, the identity of the weights
(sha256 of the converted decoder weights), the NeuronConfig (shapes, buckets, dtype, backend) and the
package / torch / compiler versions. Entries are whole artifact directories plus `cache_entry.json`
(the key's fields and the sha256 of every file, checked on use: a corrupted entry is evicted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from .digests import file_sha256
from .trust import record_produced_here
from .artifacts import VOLATILE_CONFIG_KEYS, ArtifactError, atomic_directory, copy_artifact_files, read_artifact

logger = logging.getLogger(__name__)

CACHE_ENV = "OPTIMUM_NEURONX_CACHE"
CACHE_REPO_ENV = "OPTIMUM_NEURONX_CACHE_REPO"  # optional Hub model repo shared as a remote cache
ENTRY_META = "cache_entry.json"
# A live config (the key is computed before config.json is written) also carries load-time fields.
_VOLATILE = (*VOLATILE_CONFIG_KEYS, "architectures", "dtype", "torch_dtype")


def default_cache_dir() -> Path:
    """$OPTIMUM_NEURONX_CACHE, else <HF_HOME>/optimum-neuronx/compile-cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "optimum-neuronx" / "compile-cache"


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    fields: dict  # {"model": ..., "weights": ..., "neuron_config": ..., "versions": ...}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_key(config_dict: dict, weights_sha: str, neuron_config_dict: dict, versions: dict) -> CacheKey:
    model = {k: v for k, v in config_dict.items() if k not in _VOLATILE}
    fields = {"model": model, "weights": weights_sha, "neuron_config": neuron_config_dict, "versions": versions}
    # Normalised through JSON, the form entries are stored in (e.g. integer dict keys become strings).
    return CacheKey(json.loads(json.dumps(fields, sort_keys=True, default=str)))


def _differences(cached: dict, wanted: dict, prefix: str = "") -> list[str]:
    out = []
    for name in sorted(set(cached) | set(wanted)):
        a, b = cached.get(name), wanted.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(f"{prefix}{name}: cached {a!r}, requested {b!r}")
    return out


class CompileCache:
    """Local entries under `root`; with `hub_repo` (or $OPTIMUM_NEURONX_CACHE_REPO), a Hub model repo whose
    folders `<key>/` are entries too: fetched on a local miss, pushed after a new export."""

    def __init__(self, root: Optional[str | Path] = None, hub_repo: Optional[str] = None,
                 token: Optional[str] = None):
        self.root = Path(root) if root else default_cache_dir()
        self.hub_repo = hub_repo or os.environ.get(CACHE_REPO_ENV) or None
        self.token = token

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / "entries" / key.digest

    def lock(self, key: CacheKey):
        """Held while one process looks up, compiles and stores `key`; a second exporter waits, then hits."""
        from huggingface_hub.utils import WeakFileLock

        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        return WeakFileLock(str(self.root / "locks" / f"{key.digest}.lock"))

    def entries(self) -> Iterator[tuple[Path, dict]]:
        base = self.root / "entries"
        for entry in sorted(base.iterdir()) if base.is_dir() else []:
            try:
                yield entry, json.loads((entry / ENTRY_META).read_text())
            except (OSError, json.JSONDecodeError):
                continue

    def lookup(self, key: CacheKey) -> Optional[Path]:
        """The entry for `key` if present and intact; a damaged entry is evicted (with a warning)."""
        entry = self.entry_dir(key)
        if not entry.is_dir():
            return None
        problem = self._check(entry)
        if problem:
            logger.warning("Compile cache entry %s is corrupted (%s): evicted, recompiling.", key.digest, problem)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return entry

    def _check(self, entry: Path) -> Optional[str]:
        try:
            meta = json.loads((entry / ENTRY_META).read_text())
            read_artifact(entry)
        except (OSError, json.JSONDecodeError, ArtifactError) as err:
            return str(err)
        for name, sha in meta["sha256"].items():
            if not (entry / name).is_file() or file_sha256(entry / name) != sha:
                return f"{name} does not match its sha256"
        return None

    def miss_reason(self, key: CacheKey) -> str:
        """Which fields differ from the nearest cached entry."""
        nearest = None
        for _, meta in self.entries():
            diff = _differences(meta["fields"], key.fields)
            if nearest is None or len(diff) < len(nearest):
                nearest = diff
        if nearest is None:
            return "the cache is empty"
        shown = "; ".join(nearest[:3]) + (f"; +{len(nearest) - 3} more" if len(nearest) > 3 else "")
        return f"nearest entry differs in {shown}"

    def store(self, key: CacheKey, artifact_dir: Path) -> Path:
        entry = self.entry_dir(key)
        with atomic_directory(entry) as staging:
            copy_artifact_files(artifact_dir, staging)
            sha = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
            meta = {"fields": key.fields, "digest": key.digest, "created": time.time(), "sha256": sha}
            (staging / ENTRY_META).write_text(json.dumps(meta, indent=1, default=str))
        record_produced_here(entry, "cache")
        return entry

    def fetch(self, key: CacheKey) -> Optional[Path]:
        """Copy entry `key` from the Hub cache repo into the local cache; None if it is not there."""
        if not self.hub_repo:
            return None
        import tempfile

        from huggingface_hub import snapshot_download

        with tempfile.TemporaryDirectory(dir=self._mkdir()) as tmp:
            try:
                snapshot_download(self.hub_repo, allow_patterns=[f"{key.digest}/*"], local_dir=tmp, token=self.token)
            except Exception as err:  # a remote cache must never break an export: compile instead
                logger.warning("Could not fetch %s from the Hub cache repo %s (%s): compiling.", key.digest,
                               self.hub_repo, err)
                return None
            fetched = Path(tmp) / key.digest
            if not (fetched / ENTRY_META).is_file():
                return None
            with atomic_directory(self.entry_dir(key)) as staging:
                copy_artifact_files(fetched, staging)
        logger.info("Fetched compile cache entry %s from the Hub repo %s", key.digest, self.hub_repo)
        return self.lookup(key)  # checks every file's sha256; a damaged download is evicted

    def push(self, key: CacheKey) -> None:
        """Upload local entry `key` to the Hub cache repo (one commit), if one is configured."""
        if not self.hub_repo:
            return
        from huggingface_hub import HfApi

        api = HfApi(token=self.token)
        try:
            api.create_repo(self.hub_repo, exist_ok=True)
            api.upload_folder(repo_id=self.hub_repo, folder_path=str(self.entry_dir(key)), path_in_repo=key.digest,
                              commit_message=f"Add compile cache entry {key.digest}")
        except Exception as err:  # the export itself succeeded; sharing it is best effort
            logger.warning("Could not push %s to the Hub cache repo %s: %s", key.digest, self.hub_repo, err)
            return
        logger.info("Pushed compile cache entry %s to the Hub repo %s", key.digest, self.hub_repo)

    def _mkdir(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    def clear(self) -> int:
        count = sum(1 for _ in self.entries())
        shutil.rmtree(self.root / "entries", ignore_errors=True)
        return count
