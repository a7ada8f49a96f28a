"""The exported directory: what is written, how it is stamped, how it is checked before loading, and how it is
written and copied whole or not at all. (The weights file itself: weights_io.py.)

    config.json, generation_config.json, tokenizer files   (Transformers' own formats)
    neuron_config.json   stamp.ExportStamp: NeuronConfig + graphs + decoder spec + versions and backend stamp +
                         every file's size and sha256 + the export hash over all of them (and config.json)
    neuronx_weights.safetensors   the decoder weights (converted: fused, cast), once, shared by every graph; not
                         named model.safetensors, so Transformers never loads an export as a checkpoint
    <backend files>      the compiled graphs (inductor: model.pt2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch

from .backends import Backend
from .configuration import NEURON_CONFIG_NAME, GraphSpec, NeuronConfig
from .digests import file_sha256
from .modeling.spec import DecoderSpec
from .stamp import READABLE_ARTIFACT_FORMATS, BackendStamp, ExportStamp, FileRecord, source_repo
from .tempdirs import process_alive, temporary_directory
from .version import ARTIFACT_FORMAT_VERSION, __version__

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "neuronx_weights.safetensors"
CONFIG_NAME = "config.json"
# Fields of config.json that change with who saved it, not with what was compiled.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


class ArtifactError(ValueError):
    """The directory is not a loadable export of this package (the message says why and what to do)."""


def config_hash(config_dict: dict, meta: dict) -> str:
    """The export's hash over config.json (`config_dict`) and what neuron_config.json (`meta`: an
    `ExportStamp.to_json()`) says was compiled: NeuronConfig (backend included), the graph list, the decoder spec
    (format 8) and every file's size and sha256. Editing any of them without recomputing it is caught at load."""
    hashed = {"model": {k: v for k, v in config_dict.items() if k not in VOLATILE_CONFIG_KEYS},
              "neuron": meta["neuron_config"], "graphs": meta["graphs"], "files": meta["files"]}
    if "model" in meta:
        hashed["decoder"] = meta["model"]
    payload = json.dumps(hashed, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def export_identity(directory: str | Path) -> str:
    """sha256 of the export's neuron_config.json: it names every file's digest, so it identifies the whole export."""
    return file_sha256(Path(directory) / NEURON_CONFIG_NAME)


def check_file_name(directory: Path, name: str) -> Path:
    """`directory / name` for a file name an export lists, refused unless it is a plain file name in `directory`
    (no absolute path, no separator, no `..`, not a symlink)."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", "..") or "\\" in name:
        raise ArtifactError(f"{directory / NEURON_CONFIG_NAME} lists {name!r}, which is not a plain file name of the "
                            f"export directory: refusing to read it.")
    path = Path(directory) / name
    if path.is_symlink():
        # A Hub snapshot's files link to its repo's blobs folder (huggingface_hub's cache layout); nothing else.
        allowed = [Path(directory).resolve()]
        snapshots = Path(directory).absolute().parent
        repo = snapshots.parent
        blobs = repo / "blobs"
        # only a real Hub cache layout: neither the repo folder, its snapshots nor its blobs folder a link elsewhere
        if snapshots.name == "snapshots" and not any(p.is_symlink() for p in (repo, snapshots, blobs)) \
                and blobs.is_dir():
            allowed.append(blobs.resolve())
        if not any(path.resolve().is_relative_to(root) for root in allowed):
            raise ArtifactError(f"{path} is a symbolic link out of the export directory. Refusing to read it.")
    return path


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_neuron_config(directory: Path, *, neuron_config: NeuronConfig, graphs: list[GraphSpec],
                        backend: BackendStamp, model_type: str, spec: DecoderSpec, compile_times: dict[str, float],
                        files: tuple[str, ...], source: dict | None = None) -> ExportStamp:
    """Stamp the export: call last, once config.json and every file in `files` are written."""
    import transformers

    directory = Path(directory)
    stamp = ExportStamp(
        artifact_format=ARTIFACT_FORMAT_VERSION, neuron_config=neuron_config, graphs=tuple(graphs), backend=backend,
        model_type=model_type, spec=spec,
        versions={"optimum_neuronx": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        files={name: FileRecord((directory / name).stat().st_size, file_sha256(directory / name)) for name in files},
        compile_time_s={name: round(t, 3) for name, t in compile_times.items()},
        # The Hub checkpoint the weights come from (repo_id, revision, subfolder): base_model of the model card, and
        # where an export pushed without its weights takes them from.
        source=source, config_hash="")
    meta = stamp.to_json()
    meta["config_hash"] = config_hash(_read_json(directory / CONFIG_NAME), meta)
    raw = json.dumps(meta, indent=2).encode()
    (directory / NEURON_CONFIG_NAME).write_bytes(raw)
    return dataclasses.replace(stamp, config_hash=meta["config_hash"], identity=hashlib.sha256(raw).hexdigest())


def weights_source(directory: str | Path) -> str | None:
    """The Hub checkpoint the weights of the export in `directory` come from (`stamp.source_repo`), read leniently:
    None where its metadata is unreadable (then `read_artifact` says why)."""
    try:
        meta = _read_json(Path(directory) / NEURON_CONFIG_NAME)
    except (OSError, ValueError):
        return None
    return source_repo(meta.get("source") if isinstance(meta, dict) else None)


def read_artifact(directory: str | Path, check_digests: bool | Callable[[str], bool] = False,
                  optional: tuple[str, ...] = ()) -> ExportStamp:
    """Validate an exported directory and return its stamp (neuron_config.json, typed), or raise ArtifactError.

    Every listed file's size is checked; with `check_digests` (an export from a new source, `neuron verify`) its
    sha256 too - a callable is asked with the export's identity (`ExportStamp.identity`: the sha256 of the very
    neuron_config.json bytes parsed here). Files in `optional` may be absent. Whether the compiled graphs can run
    here is another question: `compiled_code_problem`."""
    directory = Path(directory)
    meta_path = directory / NEURON_CONFIG_NAME
    if not meta_path.is_file():
        raise ArtifactError(_not_an_export(directory))
    try:
        raw = meta_path.read_bytes()
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ArtifactError(f"{meta_path} is unreadable ({type(err).__name__}: {str(err)[:200]}). Re-export the "
                            f"model.") from None
    identity = hashlib.sha256(raw).hexdigest()
    foreign = _foreign_export(directory, meta)
    if foreign:
        raise ArtifactError(foreign)
    redo = "Re-export the model with NeuronModelForCausalLM.from_pretrained(model_id, export=True, ...)."
    fmt = meta.get("artifact_format")
    if fmt not in READABLE_ARTIFACT_FORMATS:
        raise ArtifactError(f"{directory} uses artifact format {fmt!r}; this package reads formats "
                            f"{', '.join(map(str, READABLE_ARTIFACT_FORMATS))}. {redo}")
    try:
        stamp = ExportStamp.from_json(meta, identity)
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"{meta_path} is unreadable or incomplete ({err!r}). {redo}") from None
    if callable(check_digests):
        check_digests = check_digests(identity)
    for name, info in stamp.files.items():
        path = check_file_name(directory, name)
        if not path.is_file():
            if name in optional:
                continue
            if name == WEIGHTS_NAME and stamp.source_repo:
                raise ArtifactError(f"{directory} has no {name}: it was pushed without its weights, which come from "
                                    f"{stamp.source_repo}. Load it with NeuronModelForCausalLM.from_pretrained"
                                    f"(repo_id), which fetches and checks them.")
            raise ArtifactError(f"{directory} is missing {name}. {redo}")
        size = path.stat().st_size
        if size != info.size:
            raise ArtifactError(f"{path} has {size} bytes but the export wrote {info.size}: the file is "
                                f"truncated or was replaced. {redo}")
        if check_digests and file_sha256(path) != info.sha256:
            raise ArtifactError(f"{path} does not match its sha256 in {NEURON_CONFIG_NAME}: the file is corrupted "
                                f"or was replaced. {redo}")
    if not check_file_name(directory, CONFIG_NAME).is_file():
        raise ArtifactError(f"{directory} is missing {CONFIG_NAME}. {redo}")
    try:
        expected = config_hash(_read_json(directory / CONFIG_NAME), stamp.to_json())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{directory / CONFIG_NAME} is not JSON ({err}). {redo}") from None
    if stamp.config_hash != expected:
        raise ArtifactError(f"{directory}: config.json or {NEURON_CONFIG_NAME} no longer matches what was compiled "
                            f"(export hash {stamp.config_hash} != {expected}). {redo}")
    return stamp


@contextlib.contextmanager
def verified_copy(directory: str | Path, stamp: ExportStamp, exclude: tuple[str, ...] = (WEIGHTS_NAME,)
                  ) -> Iterator[Path]:
    """A private copy (a 0700 temporary folder) of the export's files but `exclude`, each checked against the sha256
    the stamp lists as it is copied, config.json against the export hash: what is loaded from it is exactly what was
    verified, whatever happens to `directory` meanwhile (a file renamed over after it was hashed)."""
    directory = Path(directory)
    redo = "Re-export the model with NeuronModelForCausalLM.from_pretrained(model_id, export=True, ...)."
    with temporary_directory("verified") as private:
        private = Path(private)
        for name, info in stamp.files.items():
            if name in exclude:
                continue
            digest = _copy_hashing(check_file_name(directory, name), private / name)
            if digest != info.sha256:
                raise ArtifactError(f"{directory / name} does not match its sha256 in {NEURON_CONFIG_NAME}: the file "
                                    f"is corrupted or was replaced. {redo}")
        for name in (CONFIG_NAME, "generation_config.json"):
            if check_file_name(directory, name).is_file():
                _copy_hashing(directory / name, private / name)
        try:
            expected = config_hash(_read_json(private / CONFIG_NAME), stamp.to_json())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{directory / CONFIG_NAME} is unreadable ({err}). {redo}") from None
        if stamp.config_hash != expected:
            raise ArtifactError(f"{directory}: config.json no longer matches what was compiled. {redo}")
        yield private


def _copy_hashing(source: Path, destination: Path) -> str:
    """Copy `source` to `destination` (0600), returning the sha256 of the bytes written."""
    digest = hashlib.sha256()
    with open(source, "rb") as inp, open(os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                                         "wb") as out:
        while chunk := inp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def compiled_code_problem(stamp: ExportStamp, backend: Backend) -> str:
    """Why the compiled graphs of a valid export cannot run here (other package or torch version, CPU lacking the
    instructions they were compiled for), or "" when they can. The export itself stays usable: its config and
    weights rebuild the graphs here."""
    versions = stamp.versions
    if versions.get("optimum_neuronx") != __version__:
        return f"it was exported by optimum-neuronx {versions.get('optimum_neuronx')}; this is {__version__}"
    if versions.get("torch") != torch.__version__:
        return (f"its graphs were compiled with torch {versions.get('torch')}, but torch {torch.__version__} is "
                f"installed (compiled graphs only run on the torch build that compiled them)")
    return backend.missing_target_support(stamp.backend.target)


def _not_an_export(directory: Path) -> str:
    if (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file():
        return (f"{directory} is a Transformers checkpoint, not an exported model. To compile it, call "
                f"NeuronModelForCausalLM.from_pretrained({str(directory)!r}, export=True, ...).")
    config = directory / CONFIG_NAME
    if config.is_file():
        try:
            neuron = _read_json(config).get("neuron")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            neuron = None
        if isinstance(neuron, dict):
            return _optimum_neuron_message(directory, "transformers-neuronx", None)
    return (f"{directory} has no {NEURON_CONFIG_NAME}: it is not an exported model. To compile a Transformers "
            f"checkpoint, call NeuronModelForCausalLM.from_pretrained(model_id, export=True, ...).")


def _foreign_export(directory: Path, meta: dict) -> str:
    """The message for an optimum-neuron export (its neuron_config.json has other fields), or ""."""
    if not isinstance(meta, dict):
        return f"{directory / NEURON_CONFIG_NAME} is not a JSON object. Re-export the model."
    if "artifact_format" in meta:
        return ""
    if "_serialized_key" in meta or "optimum_neuron_version" in meta or "checkpoint_id" in meta:
        return _optimum_neuron_message(directory, "NxD", meta)
    return ""


def _optimum_neuron_message(directory: Path, flavour: str, meta: dict | None) -> str:
    checkpoint = (meta or {}).get("checkpoint_id")
    version = (meta or {}).get("optimum_neuron_version")
    made = f"optimum-neuron {version}" if version else "optimum-neuron"
    source = (f"from_pretrained({checkpoint!r}, export=True, ...)" if checkpoint
              else "from_pretrained(<the checkpoint it was made from>, export=True, ...)")
    return (f"{directory} is an export of {made} ({flavour} graphs for Neuron devices), which optimum-neuronx cannot "
            f"load; it runs with optimum-neuron on an Inferentia / Trainium instance. To use the model with "
            f"optimum-neuronx, export its Transformers checkpoint: NeuronModelForCausalLM.{source}")


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `target`; it becomes `target` only if the block succeeds.

    An existing `target` is swapped out whole (renamed aside, the new folder renamed in, the old one removed), with
    any file of its own the new content lacks linked across: a process killed at any point leaves the old content
    or the new one, never a mix (the next write puts a swapped-out folder back if `target` is missing)."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        yield staging
        if not target.exists():
            os.rename(staging, target)
            return
        if not target.is_dir() or target.is_symlink():
            raise NotADirectoryError(f"Cannot save into {target}: it exists and is not a directory.")
        for entry in target.iterdir():  # a user's own files in the folder stay
            if not (staging / entry.name).exists() and entry.name != NEURON_CONFIG_NAME:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=os.link)
                else:
                    os.link(entry, staging / entry.name, follow_symlinks=False)
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
        os.rename(target, old / "content")
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(target: Path) -> None:
    """Remove staging folders of `target` left by processes that died mid-write (killed: no `finally` ran); put a
    swapped-out old content back where `target` is missing."""
    for kind in ("old", "tmp"):  # a missing target is restored before anything else is removed
        prefix = f".{target.name}.{kind}-"
        for entry in sorted(target.parent.iterdir()):
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or process_alive(int(pid)):
                continue
            if kind == "old" and not target.exists() and (entry / "content").is_dir():
                logger.warning("Restoring %s from %s: a process (%s) was killed while replacing it", target, entry,
                               pid)
                os.rename(entry / "content", target)
            logger.info("Removing %s, left by an interrupted write (process %s)", entry, pid)
            shutil.rmtree(entry, ignore_errors=True)


def copy_artifact_files(source: Path, destination: Path, exclude: tuple[str, ...] = (),
                        include: tuple[str, ...] | None = None, link: bool = True, mode: int | None = None) -> None:
    """Copy the regular files of an artifact directory (only `include`, if given): hard-linked where possible with
    `link`, else copied (into or out of the compile cache: an in-place edit of one must never change the other),
    with permissions `mode` if given."""
    for entry in sorted(Path(source).iterdir()):
        if (entry.is_file() and not entry.name.startswith(".") and entry.name not in exclude
                and (include is None or entry.name in include)):
            dest = destination / entry.name
            real = entry.resolve()  # a Hub snapshot's files are relative links into its blobs folder
            try:
                if not link:
                    raise OSError
                os.link(real, dest)
            except OSError:
                shutil.copyfile(real, dest)
            if mode is not None:
                os.chmod(dest, mode)
