"""The exported directory: what is written, how it is stamped, and how it is checked before loading.

    config.json, generation_config.json, tokenizer files   (Transformers' own formats)
    neuron_config.json   NeuronConfig + graphs + versions + config hash + file sizes
    model.safetensors    the decoder weights, once, shared by every graph
    <backend files>      the compiled graphs (inductor: model.pt2)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import torch

from .backends import get_backend
from .configuration import NEURON_CONFIG_NAME, GraphSpec, NeuronConfig
from .version import ARTIFACT_FORMAT_VERSION, __version__

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Fields of config.json that change with who saved it, not with what was compiled.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


class ArtifactError(ValueError):
    """The directory is not a loadable export of this package (the message says why and what to do)."""


def config_hash(config_dict: dict, neuron_config: NeuronConfig) -> str:
    """Hash of everything that determines the compiled graphs: model config, NeuronConfig, backend."""
    model = {k: v for k, v in config_dict.items() if k not in VOLATILE_CONFIG_KEYS}
    payload = json.dumps({"model": model, "neuron": neuron_config.to_dict()}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_neuron_config(
    directory: Path, neuron_config: NeuronConfig, graphs: list[GraphSpec], compiler: dict,
    compile_times: dict[str, float], files: tuple[str, ...],
) -> dict:
    """Stamp the export: call last, once config.json and every file in `files` are written."""
    import transformers

    directory = Path(directory)
    meta = {
        "artifact_format": ARTIFACT_FORMAT_VERSION,
        "neuron_config": neuron_config.to_dict(),
        "graphs": [{"kind": g.kind, "tokens": g.tokens, "window": g.window} for g in graphs],
        "versions": {
            "optimum_neuronx": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compiler": {"name": neuron_config.backend, **compiler},  # version, target
        },
        "config_hash": config_hash(_read_json(directory / CONFIG_NAME), neuron_config),
        "files": {name: {"size": (directory / name).stat().st_size} for name in files},
        "compile_time_s": {name: round(t, 3) for name, t in compile_times.items()},
    }
    with open(directory / NEURON_CONFIG_NAME, "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def read_artifact(directory: str | Path) -> tuple[NeuronConfig, dict]:
    """Validate an exported directory and return its NeuronConfig and metadata, or raise ArtifactError."""
    directory = Path(directory)
    meta_path = directory / NEURON_CONFIG_NAME
    if not meta_path.is_file():
        raise ArtifactError(
            f"{directory} has no {NEURON_CONFIG_NAME}: it is not an exported model. To compile a Transformers "
            f"checkpoint, call NeuronModelForCausalLM.from_pretrained(model_id, export=True, ...)."
        )
    try:
        meta = _read_json(meta_path)
        fmt = meta["artifact_format"]
        neuron_config = NeuronConfig.from_dict(meta["neuron_config"])
        versions = meta["versions"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"{meta_path} is unreadable or incomplete ({err}). Re-export the model.") from None
    redo = "Re-export the model with NeuronModelForCausalLM.from_pretrained(model_id, export=True, ...)."
    if fmt != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(f"{directory} uses artifact format {fmt}; this package reads format "
                            f"{ARTIFACT_FORMAT_VERSION}. {redo}")
    if versions.get("optimum_neuronx") != __version__:
        raise ArtifactError(f"{directory} was exported by optimum-neuronx {versions.get('optimum_neuronx')}; this is "
                            f"{__version__}. {redo}")
    if versions.get("torch") != torch.__version__:
        raise ArtifactError(f"{directory} was compiled with torch {versions.get('torch')}, but torch "
                            f"{torch.__version__} is installed; compiled graphs only run on the torch build that "
                            f"compiled them. {redo}")
    try:
        missing = get_backend(neuron_config.backend).missing_target_support(versions["compiler"].get("target", ""))
    except (KeyError, AttributeError) as err:
        raise ArtifactError(f"{meta_path} is unreadable or incomplete ({err!r}). {redo}") from None
    if missing:
        raise ArtifactError(f"{directory} cannot run on this machine: {missing}. Export it on this machine "
                            f"(or one like it). {redo}")
    for name, info in meta.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{directory} is missing {name}. {redo}")
        size = path.stat().st_size
        if size != info["size"]:
            raise ArtifactError(f"{path} has {size} bytes but the export wrote {info['size']}: the file is "
                                f"truncated or was replaced. {redo}")
    if not (directory / CONFIG_NAME).is_file():
        raise ArtifactError(f"{directory} is missing {CONFIG_NAME}. {redo}")
    expected = config_hash(_read_json(directory / CONFIG_NAME), neuron_config)
    if meta.get("config_hash") != expected:
        raise ArtifactError(f"{directory}: config.json or {NEURON_CONFIG_NAME} no longer matches what was compiled "
                            f"(config hash {meta.get('config_hash')} != {expected}). {redo}")
    return neuron_config, meta


WEIGHTS_ALIGNMENT = 64  # bytes: one cache line, the width of an AVX-512 load
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def save_weights(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write `tensors` as a safetensors file whose tensors start on WEIGHTS_ALIGNMENT-byte boundaries.

    Loading maps the file, so a tensor's address modulo 64 is its file offset's; `safetensors.torch.save_file`
    pads its header to 8 bytes only, and a misaligned weight makes every 64-byte load span two cache lines. The
    format allows spaces after the header's JSON (the
    library adds them itself) but no gaps between tensors, so tensors whose size is a whole number of lines go
    first, in name order, and the header is padded so that the data starts on a line. Readers are the
    library's own."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, order = 0, sorted(tensors, key=lambda name: (tensors[name].nbytes % WEIGHTS_ALIGNMENT != 0, name))
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"Cannot save weight {name!r} of dtype {tensor.dtype}: safetensors weights are one of "
                            f"{sorted(str(d) for d in _SAFETENSORS_DTYPES)}.")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % WEIGHTS_ALIGNMENT)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name in order:
            f.write(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def load_weights(directory: str | Path, meta: dict, huge_pages: bool = False) -> dict[str, torch.Tensor]:
    """The export's weights, those its stamp lists as packable reordered by its backend.

    Plain weights stay memory-mapped or, with `huge_pages`, are read into memory in 2 MiB pages (see
    huge_pages.py). Each packable one is mapped on its own and unmapped once packed, so the load never holds a
    plain and a packed copy of every weight at once.
    """
    from safetensors import safe_open

    path = str(Path(directory) / WEIGHTS_NAME)
    compiler = meta["versions"]["compiler"]
    packable = set(compiler.get("packable_weights", ()))
    if huge_pages:
        weights = _read_into_huge_pages(path, exclude=packable)
    else:
        with safe_open(path, framework="pt") as f:
            weights = {name: f.get_tensor(name) for name in f.keys() if name not in packable}
    if packable:
        backend, rows = get_backend(meta["neuron_config"]["backend"]), compiler["lowering"]["packed_rows"]
        with _reading_ahead(path):
            for name in sorted(packable):  # file order: safetensors writes tensors sorted by name
                with safe_open(path, framework="pt") as f:
                    weights[name] = backend.pack_weight(f.get_tensor(name), rows)
    return weights


# Below this share of huge pages the loader asks the kernel for more: a collapse, then, where memory is short, the
# file's page cache given back first (its folios are the free 2 MiB blocks the collapse needs).
HUGE_PAGE_TARGET = 0.98
# Below this share after that the load logs how much of the copy decode streams from 4 KiB pages. It keeps the
# copy: the mapped file, whose page cache was just given back, would fault in from storage into small pages.
MIN_HUGE_PAGE_SHARE = 0.9


def _read_into_huge_pages(path: str, exclude: set, chunk_bytes: int = 64 << 20) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path` but `exclude`, read into one huge_page_buffer, each starting
    on a WEIGHTS_ALIGNMENT boundary, as many of its pages in huge pages as the kernel gives after a collapse and,
    where short, another with the file's page cache dropped (memory full and fragmented: 880 MiB of 2.1 GB on this
    host with a second copy loaded, before the drop); logged below MIN_HUGE_PAGE_SHARE. Chunks of `chunk_bytes`
    are read by a few threads: the copy out of the page cache and the kernel's zeroing of fresh pages take one
    core each (4.2 GB in ~0.3 s on 2 cores, cached)."""
    from concurrent.futures import ThreadPoolExecutor

    from .huge_pages import huge_page_buffer, settle

    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes))
    dtypes = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
    file_size, data_start = os.path.getsize(path), 8 + header_bytes
    layout, size = {}, 0  # name -> (file offset, bytes, buffer offset)
    for name, info in header.items():
        if name == "__metadata__" or name in exclude:
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in dtypes or not 0 <= begin <= end <= file_size - data_start:
            raise ArtifactError(f"{path}: weight {name!r} ({info['dtype']}, bytes {begin}-{end}) is not readable "
                                f"from a file of {file_size} bytes. Re-export the model.")
        size += -size % WEIGHTS_ALIGNMENT
        layout[name] = (data_start + begin, end - begin, size)
        size += end - begin
    buffer = huge_page_buffer(size)
    chunks = [(offset + at, count, start + at, min(chunk_bytes, count - at))
              for offset, count, start in layout.values() for at in range(0, count, chunk_bytes)]
    view = memoryview(buffer.numpy())
    descriptor = os.open(path, os.O_RDONLY)
    try:
        def read(chunk: tuple) -> None:
            offset, _, start, count = chunk
            done = 0
            while done < count:
                got = os.preadv(descriptor, [view[start + done:start + count]], offset + done)
                if got <= 0:
                    raise ArtifactError(f"{path} ended at byte {offset + done} while reading its weights: the "
                                        f"file is truncated. Re-export the model.")
                done += got

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            list(pool.map(read, chunks))
    finally:
        os.close(descriptor)
    share = settle(buffer, HUGE_PAGE_TARGET, make_room=lambda: _drop_cached(path))
    if share < MIN_HUGE_PAGE_SHARE:
        logger.warning("Only %.0f%% of %s's weights got 2 MiB pages (memory full or fragmented): decode streams the "
                       "rest from 4 KiB pages, up to ~20%% slower. Loading with more memory free gives it more.",
                       100 * share, path)
    return {name: buffer[start:start + count].view(dtypes[header[name]["dtype"]]).view(header[name]["shape"])
            for name, (_, count, start) in layout.items()}


def _drop_cached(path: str) -> None:
    """Ask the kernel to drop `path`'s clean, unmapped pages from the page cache (a later load reads it from disk)."""
    if hasattr(os, "posix_fadvise"):  # not on macOS or Windows
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def _reading_ahead(path: str, chunk_bytes: int = 64 << 20) -> Iterator[None]:
    """Have the kernel read `path` front to back in large requests from a thread while the block runs. Packing
    reads each weight through page faults, in the order the reorder walks it, and waits on each: from storage
    that is not cached, reading ahead overlaps the disk with the packing.

    Linux reads at most the device's read-ahead window per call (8 MiB on the machine measured), so this asks
    for the start of each chunk, not all of it; asking for all of it, in window-sized calls, loaded slower there."""
    if not hasattr(os, "posix_fadvise"):  # not on macOS or Windows
        yield
        return
    done = threading.Event()

    def read_ahead() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, chunk_bytes):
                if done.is_set():
                    break
                os.posix_fadvise(fd, offset, min(chunk_bytes, size - offset), os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    thread = threading.Thread(target=read_ahead, name="optimum-neuronx-read-ahead", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `target`; move its files into `target` only if the block succeeds.

    An interrupted export leaves no partial `target` behind, only nothing (the temporary is removed).
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        if not target.exists():
            os.rename(staging, target)
            return
        if not target.is_dir():
            raise NotADirectoryError(f"Cannot save into {target}: it exists and is not a directory.")
        # Saving into an existing directory: stale stamps go first so a crash can't pair old files with them.
        (target / NEURON_CONFIG_NAME).unlink(missing_ok=True)
        names = sorted(os.listdir(staging), key=lambda n: n == NEURON_CONFIG_NAME)
        for name in names:
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_artifact_files(source: Path, destination: Path, exclude: tuple[str, ...] = ()) -> None:
    """Copy (hard-link where possible) the regular files of an artifact directory."""
    for entry in sorted(Path(source).iterdir()):
        if entry.is_file() and not entry.name.startswith(".") and entry.name not in exclude:
            dest = destination / entry.name
            try:
                os.link(entry, dest)
            except OSError:
                shutil.copy2(entry, dest)
