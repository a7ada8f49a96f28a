"""Which exports this machine produced: their compiled graphs (native code) may be loaded without asking.

An export written here (by an export or a compile-cache store) is recorded by its identity, the sha256 of its
neuron_config.json, which names every file's sha256. Loading an export whose identity is not recorded runs none of
its compiled code unless the caller passes `trust_remote_code=True`: the runtime rebuilds the graphs here from the
export's config and weights (data) instead. docs/security.md says what a user trusts in each case.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from .artifacts import export_identity

logger = logging.getLogger(__name__)

PROVENANCE_ENV = "OPTIMUM_NEURONX_PROVENANCE"


def provenance_dir() -> Path:
    """$OPTIMUM_NEURONX_PROVENANCE, else <HF_HOME>/optimum-neuronx/provenance."""
    if os.environ.get(PROVENANCE_ENV):
        return Path(os.environ[PROVENANCE_ENV])
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "optimum-neuronx" / "provenance"


def _record_path(directory: str | Path) -> Path:
    return provenance_dir() / f"{export_identity(directory)}.json"


def record_produced_here(directory: str | Path, how: str) -> None:
    """Record the export in `directory` as produced on this machine (`how`: "export", "cache", "trusted by the
    user"), at this path."""
    root = provenance_dir()
    root.mkdir(parents=True, exist_ok=True)
    record = _record_path(directory)
    try:
        data = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        data = {"how": how, "recorded": time.time(), "paths": []}
    path = str(Path(directory).resolve())
    if path not in data["paths"]:
        data["paths"].append(path)
        temporary = root / f".{record.name}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps(data))
        os.replace(temporary, record)


def provenance(directory: str | Path) -> str:
    """"here": this content was produced (or trusted) on this machine and is at a path it was recorded at;
    "moved": the same content at a new path (its files are checked against their digests before use); "foreign":
    not produced here."""
    try:
        data = json.loads(_record_path(directory).read_text())
    except (OSError, json.JSONDecodeError):
        return "foreign"
    return "here" if str(Path(directory).resolve()) in data.get("paths", []) else "moved"
