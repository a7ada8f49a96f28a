"""Which exports this machine produced: their compiled graphs (native code) may be loaded without asking.

An export written here (by an export or a compile-cache store) is recorded by its identity, the sha256 of its
neuron_config.json, which names every file's sha256. Loading an export whose identity is not recorded runs none of
its compiled code unless the caller passes `trust_remote_code=True`: the runtime rebuilds the graphs here from the
export's config and weights (data) instead. docs/security.md says what a user trusts in each case.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from .artifacts import compiled_code_problem, export_identity, read_artifact
from .backends import Backend, get_backend
from .digests import file_sha256
from .stamp import ExportStamp

logger = logging.getLogger(__name__)

PROVENANCE_ENV = "OPTIMUM_NEURONX_PROVENANCE"


def provenance_dir() -> Path:
    """$OPTIMUM_NEURONX_PROVENANCE, else <HF_HOME>/optimum-neuronx/provenance."""
    if os.environ.get(PROVENANCE_ENV):
        return Path(os.environ[PROVENANCE_ENV])
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "optimum-neuronx" / "provenance"


def private_directory(path: Path) -> Path:
    """`path` created if needed, readable and writable by this user only (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except PermissionError:  # another user's folder: nothing planted there is taken (see cache_entry_recorded)
            logger.warning("%s belongs to another user and stays readable by others.", path)
    return path


def _record_path(directory: str | Path) -> Path:
    return provenance_dir() / f"{export_identity(directory)}.json"


def _file_stats(directory: Path) -> dict[str, list[int]]:
    """Each regular file of the export directory: [inode, size, ctime in ns]. No user can set a ctime back, so a file
    with the same three was not written, replaced or renamed over since."""
    stats = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or not entry.is_file() or entry.is_symlink():
            continue
        info = entry.stat()
        stats[entry.name] = [info.st_ino, info.st_size, info.st_ctime_ns]
    return stats


def record_produced_here(directory: str | Path, how: str, identity: str | None = None) -> None:
    """Record the export in `directory` as produced on this machine (`how`: "export", "cache", "trusted by the
    user"), at this path, with every file's inode, size and ctime (`provenance`). `identity`: the export's, as read
    (default: its neuron_config.json's sha256 now)."""
    root = private_directory(provenance_dir())
    directory = Path(directory)
    record = root / f"{identity or export_identity(directory)}.json"
    try:
        data = json.loads(record.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("paths"), dict):
            raise ValueError
    except (OSError, ValueError):
        data = {"how": how, "recorded": time.time(), "paths": {}}
    data["paths"][str(directory.resolve())] = _file_stats(directory)
    temporary = root / f".{record.name}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(data))
    os.replace(temporary, record)


def provenance(directory: str | Path, identity: str | None = None) -> str:
    """"here": this content was produced (or trusted) on this machine and is at a path it was recorded at, every
    file unchanged since (inode, size, ctime); "moved": the same export identity at a new path, or with files changed
    since (its files are checked against their digests before use); "foreign": not produced here. `identity`: the
    export's, from the neuron_config.json bytes the caller read (default: read now)."""
    directory = Path(directory)
    try:
        data = json.loads((provenance_dir() / f"{identity or export_identity(directory)}.json").read_text())
    except (OSError, ValueError):
        return "foreign"
    paths = data.get("paths") if isinstance(data, dict) else None
    recorded = paths.get(str(directory.resolve())) if isinstance(paths, dict) else None
    return "here" if recorded is not None and recorded == _file_stats(directory) else "moved"

def _entry_record(entry_dir: Path, entry_meta: Path) -> Path:
    return provenance_dir() / "cache-entries" / f"{file_sha256(entry_meta)}.json"


def record_cache_entry(entry_dir: str | Path, entry_meta: str | Path) -> None:
    """Record a compile-cache entry this user stored (its `cache_entry.json` names every file's sha256)."""
    records = private_directory(provenance_dir() / "cache-entries")
    record = _entry_record(Path(entry_dir), Path(entry_meta))
    temporary = records / f".{record.name}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps({"entry": str(Path(entry_dir).resolve()), "recorded": time.time()}))
    os.replace(temporary, record)


def cache_entry_recorded(entry_dir: str | Path, entry_meta: str | Path) -> bool:
    """Whether this user stored the compile-cache entry at `entry_dir` with this `cache_entry.json`."""
    try:
        data = json.loads(_entry_record(Path(entry_dir), Path(entry_meta)).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("entry") == str(Path(entry_dir).resolve())


@dataclasses.dataclass(frozen=True)
class TrustDecision:
    """What loading does with an export's compiled graphs: "load" them, or "rebuild" them here from its config and
    weights. `cannot_run`: why its graphs cannot run on this machine ("" if they can: then a rebuild means they are
    not trusted). `stamp`: the export as read for the decision; `backend`: the one it names."""

    action: str
    cannot_run: str
    stamp: ExportStamp
    backend: Backend


def trust_decision(artifact_dir: Path, downloaded: bool, trust_remote_code: bool) -> TrustDecision:
    """Load the graphs of an export this machine produced (or the caller trusts) that can run here; rebuild any
    other's. Digests are checked for an export from a new source (a download, a path it was not recorded at, one not
    produced here); a damaged export raises ArtifactError."""
    origins = []  # the provenance of the neuron_config.json bytes read_artifact parses

    def digests_needed(identity: str) -> bool:
        origins.append(provenance(artifact_dir, identity))
        return downloaded or origins[-1] != "here"

    stamp = read_artifact(artifact_dir, check_digests=digests_needed)
    backend = get_backend(stamp.neuron_config.backend)
    problem = compiled_code_problem(stamp, backend)
    if problem:
        return TrustDecision("rebuild", problem, stamp, backend)
    if origins[-1] != "foreign":
        record_produced_here(artifact_dir, "copied", stamp.identity)
        return TrustDecision("load", "", stamp, backend)
    if trust_remote_code:
        record_produced_here(artifact_dir, "trusted by the user", stamp.identity)
        return TrustDecision("load", "", stamp, backend)
    return TrustDecision("rebuild", "", stamp, backend)
