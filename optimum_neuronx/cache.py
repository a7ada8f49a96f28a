"""Compile cache: compiled graphs stored under a key, so the same graphs never compile twice.

The key hashes what the graphs depend on: the decoder the model config describes (model_type and the decoder's
shape: layers, heads, sizes, RoPE...), the NeuronConfig (shapes, buckets, dtype, backend) and the package / torch /
compiler versions - never the weight values, so a fine-tune of a cached model compiles nothing. Entries hold the
graph files only (no weights) plus `cache_entry.json` (the key's fields, the compile times and the sha256 of every
file, checked on use: a corrupted entry is evicted).
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

from .artifacts import atomic_directory, check_file_name, copy_artifact_files
from .digests import file_sha256
from .trust import cache_entry_recorded, private_directory, record_cache_entry

logger = logging.getLogger(__name__)

CACHE_ENV = "OPTIMUM_NEURONX_CACHE"
CACHE_REPO_ENV = "OPTIMUM_NEURONX_CACHE_REPO"  # optional Hub model repo shared as a remote cache
CUSTOM_CACHE_REPO_ENV = "CUSTOM_CACHE_REPO"  # optimum-neuron's name for it
ENTRY_META = "cache_entry.json"
_DIGEST_CHARS = set("0123456789abcdef")


def default_cache_dir() -> Path:
    """$OPTIMUM_NEURONX_CACHE, else <HF_HOME>/optimum-neuronx/compile-cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "optimum-neuronx" / "compile-cache"


def _cache_repo_file() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "optimum-neuronx" / "cache_repo"


def set_default_cache_repo(repo_id: str) -> Path:
    """`optimum-cli neuron cache set`: the Hub cache repo used when no option or variable names one."""
    path = _cache_repo_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(repo_id + "\n")
    return path


def default_cache_repo() -> Optional[str]:
    """$OPTIMUM_NEURONX_CACHE_REPO, else optimum-neuron's $CUSTOM_CACHE_REPO, else the repo `cache set` chose."""
    for name in (CACHE_REPO_ENV, CUSTOM_CACHE_REPO_ENV):
        if os.environ.get(name):
            return os.environ[name]
    try:
        return _cache_repo_file().read_text().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class CacheKey:
    fields: dict  # {"model": ..., "neuron_config": ..., "versions": ...}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_key(model: dict, neuron_config_dict: dict, versions: dict) -> CacheKey:
    """`model`: the decoder the graphs compute (model_type + DecoderSpec fields), not the weights."""
    fields = {"model": model, "neuron_config": neuron_config_dict, "versions": versions}
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
        self.hub_repo = hub_repo or default_cache_repo()
        self.token = token

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / "entries" / key.digest

    def lock(self, key: CacheKey):
        """Held while one process looks up, compiles and stores `key`; a second exporter waits, then hits."""
        from huggingface_hub.utils import WeakFileLock

        private_directory(self._mkdir() / "locks")
        return WeakFileLock(str(self.root / "locks" / f"{key.digest}.lock"))

    def entries(self) -> Iterator[tuple[Path, dict]]:
        """Every local entry with its metadata; one whose cache_entry.json is unreadable or malformed is skipped
        with a warning."""
        base = self.root / "entries"
        for entry in sorted(base.iterdir()) if base.is_dir() else []:
            try:
                meta = read_entry_meta(entry)
            except FileNotFoundError:
                continue  # being written, or not an entry
            except (OSError, ValueError) as err:
                logger.warning("Compile cache entry %s skipped: %s", entry.name, err)
                continue
            yield entry, meta

    def lookup(self, key: CacheKey, trusted: bool = False) -> Optional[Path]:
        """The entry for `key` if present and intact, and stored by this user (its provenance records it) or
        `trusted` (trust_remote_code); a damaged entry is evicted (with a warning), an unrecorded one ignored."""
        entry = self.entry_dir(key)
        if not entry.is_dir():
            return None
        problem = self._check(entry)
        if problem:
            logger.warning("Compile cache entry %s is corrupted (%s): evicted, recompiling.", key.digest, problem)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        if not trusted and not cache_entry_recorded(entry, entry / ENTRY_META):
            logger.info("Compile cache entry %s was not stored by this user (no provenance record): its compiled "
                        "code is ignored and the graphs recompiled (trust_remote_code=True would use it).", entry)
            return None
        return entry

    def _check(self, entry: Path) -> Optional[str]:
        try:
            meta = read_entry_meta(entry)
            names = list(meta["sha256"])
            for name in names:
                path = check_file_name(entry, name)
                if not path.is_file() or file_sha256(path) != meta["sha256"][name]:
                    return f"{name} does not match its sha256"
        except (OSError, ValueError, KeyError, TypeError) as err:
            return str(err)
        extra = sorted(p.name for p in entry.iterdir() if p.name != ENTRY_META and p.name not in names)
        return f"it holds unlisted files {extra}" if extra else None

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

    def store(self, key: CacheKey, artifact_dir: Path, graph_files: tuple[str, ...],
              compile_times: dict[str, float]) -> Path:
        """Keep copies of the compiled graph files of the export in `artifact_dir` (never its weights) under `key`,
        private to this user (0600 files in 0700 folders), and record the entry in this user's provenance."""
        entry = self.entry_dir(key)
        private_directory(self._mkdir())
        private_directory(entry.parent)
        if entry.exists() and not cache_entry_recorded(entry, entry / ENTRY_META):
            shutil.rmtree(entry, ignore_errors=True)  # not ours (planted, or damaged): replaced whole
        with atomic_directory(entry) as staging:
            copy_artifact_files(artifact_dir, staging, include=graph_files, link=False, mode=0o600)
            sha = {name: file_sha256(staging / name) for name in graph_files}
            meta = {"fields": key.fields, "digest": key.digest, "created": time.time(), "sha256": sha,
                    "compile_time_s": compile_times}
            (staging / ENTRY_META).write_text(json.dumps(meta, indent=1, default=str))
            os.chmod(staging / ENTRY_META, 0o600)
        record_cache_entry(entry, entry / ENTRY_META)
        return entry

    def matching_model(self, model: dict) -> list[tuple[Path, dict]]:
        """Local entries compiled for the decoder `model` describes (any NeuronConfig, any version)."""
        model = json.loads(json.dumps(model, sort_keys=True, default=str))  # in the form entries store it
        return [(entry, meta) for entry, meta in self.entries() if meta["fields"].get("model") == model]

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
        return self.lookup(key, trusted=True)  # checks every file's sha256; a damaged download is evicted

    def push(self, key: CacheKey) -> None:
        """Upload local entry `key` to the Hub cache repo (one commit), if one is configured."""
        if not self.hub_repo:
            return
        from huggingface_hub import HfApi

        api = HfApi(token=self.token)
        try:
            create_cache_repo(self.hub_repo, self.token)
            api.upload_folder(repo_id=self.hub_repo, folder_path=str(self.entry_dir(key)), path_in_repo=key.digest,
                              commit_message=f"Add compile cache entry {key.digest}")
        except Exception as err:  # the export itself succeeded; sharing it is best effort
            logger.warning("Could not push %s to the Hub cache repo %s: %s", key.digest, self.hub_repo, err)
            return
        logger.info("Pushed compile cache entry %s to the Hub repo %s", key.digest, self.hub_repo)

    def hub_entries(self) -> list[str]:
        """The digests of the entries in the Hub cache repo (empty when none is configured)."""
        if not self.hub_repo:
            return []
        from huggingface_hub import HfApi

        names = HfApi(token=self.token).list_repo_files(self.hub_repo)
        return sorted({name.split("/", 1)[0] for name in names if name.endswith("/" + ENTRY_META)})

    def hub_entry_metas(self) -> list[dict]:
        """The `cache_entry.json` of every entry in the Hub cache repo (their key fields: no graph is downloaded)."""
        import json as _json

        from huggingface_hub import hf_hub_download

        metas = []
        for digest in self.hub_entries():
            path = hf_hub_download(self.hub_repo, f"{digest}/{ENTRY_META}", token=self.token)
            metas.append(_json.loads(Path(path).read_text()))
        return metas

    def synchronize(self) -> list[str]:
        """Push every local entry the Hub cache repo lacks, in one commit; return their digests."""
        if not self.hub_repo:
            raise ValueError(f"No Hub cache repo to synchronize with: pass one (--cache_repo) or set {CACHE_REPO_ENV}.")
        from huggingface_hub import CommitOperationAdd, HfApi

        create_cache_repo(self.hub_repo, self.token)
        remote = set(self.hub_entries())
        missing = [(entry, meta) for entry, meta in self.entries() if meta["digest"] not in remote
                   and self._check(entry) is None]
        if missing:
            operations = [CommitOperationAdd(f"{meta['digest']}/{p.name}", str(p))
                          for entry, meta in missing for p in sorted(entry.iterdir()) if p.is_file()]
            HfApi(token=self.token).create_commit(self.hub_repo, operations,
                                                  commit_message=f"Add {len(missing)} compile cache entries")
        return [meta["digest"] for _, meta in missing]

    def _mkdir(self) -> Path:
        return private_directory(self.root)

    def clear(self) -> int:
        """Remove every local entry (folders named by a key's digest; anything else there is left, with a warning);
        return how many there were."""
        base = self.root / "entries"
        removed = 0
        for entry in sorted(base.iterdir()) if base.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink() and len(entry.name) == 32 and set(entry.name) <= _DIGEST_CHARS:
                shutil.rmtree(entry)
                removed += 1
            else:
                logger.warning("%s is not a compile cache entry: left in place.", entry)
        return removed


def read_entry_meta(entry: Path) -> dict:
    """An entry's cache_entry.json, checked for the fields the cache reads (ValueError naming what is wrong)."""
    path = Path(entry) / ENTRY_META
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not JSON ({type(err).__name__})") from None
    fields = meta.get("fields") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), dict):
        raise ValueError(f"{path} does not list its files")
    if not isinstance(fields, dict) or not all(isinstance(fields.get(k), dict) for k in ("model", "neuron_config",
                                                                                         "versions")):
        raise ValueError(f"{path} does not hold the key's fields (model, neuron_config, versions)")
    if not isinstance(meta.get("digest"), str) or not isinstance(meta.get("created"), (int, float)) \
            or not isinstance(meta.get("compile_time_s"), dict):
        raise ValueError(f"{path} lacks its digest, creation time or compile times")
    return meta


def create_cache_repo(repo_id: str, token: Optional[str] = None, private: bool = True) -> str:
    """Create the Hub model repo that serves as a shared compile cache: private unless asked (its entries hold what
    a model's config says about it); an existing repo is left as it is."""
    from huggingface_hub import HfApi

    return str(HfApi(token=token).create_repo(repo_id, private=private, exist_ok=True))
