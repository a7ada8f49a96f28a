"""Temporary folders named after the process that made them, so that those of a killed process (SIGKILL runs no
cleanup) are removed by the next one: an export's staging copy of the weights never stays in the temp folder."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "optimum-neuronx-"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temporary_directory(kind: str) -> tempfile.TemporaryDirectory:
    """A private (0700) temporary folder `optimum-neuronx-<kind>-<pid>-*`, after removing the folders of this kind
    left by processes that no longer run."""
    prefix = f"{PREFIX}{kind}-"
    root = Path(tempfile.gettempdir())
    for entry in root.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)) and entry.is_dir() \
                and not entry.is_symlink() and entry.stat().st_uid == os.getuid():
            logger.info("Removing %s, left by process %s, which was killed mid-way", entry, pid)
            shutil.rmtree(entry, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-")
