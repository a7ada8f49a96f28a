"""neuronx_weights.safetensors: written with every tensor on a cache-line boundary, read back memory-mapped or into huge
pages (huge_pages.py), with the weights a backend packs reordered at load while the file is read ahead."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Iterator

import torch

from .artifacts import WEIGHTS_NAME, ArtifactError
from .backends import Backend
from .stamp import BackendStamp

logger = logging.getLogger(__name__)
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


def load_weights(directory: str | Path, backend: Backend, stamp: BackendStamp,
                 huge_pages: bool = False) -> dict[str, torch.Tensor]:
    """The export's weights, those its `stamp` lists as packable reordered by `backend`.

    Plain weights stay memory-mapped or, with `huge_pages`, are read into memory in 2 MiB pages (see
    huge_pages.py). Each packable one is mapped on its own and unmapped once packed, so the load never holds a
    plain and a packed copy of every weight at once.
    """
    from safetensors import safe_open

    path = str(Path(directory) / WEIGHTS_NAME)
    packable = set(stamp.packable_weights)
    if huge_pages:
        weights = read_into_huge_pages(path, exclude=packable)
    else:
        with safe_open(path, framework="pt") as f:
            weights = {name: f.get_tensor(name) for name in f.keys() if name not in packable}
    if packable:
        rows = stamp.packed_rows
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


def read_into_huge_pages(path: str, exclude: set, chunk_bytes: int = 64 << 20) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path` but `exclude`, read into one huge_page_buffer, each starting
    on a WEIGHTS_ALIGNMENT boundary, as many of its pages in huge pages as the kernel gives after a collapse and,
    where short, another with the file's page cache dropped (memory full and fragmented: 880 MiB of 2.1 GB on this
    host with a second copy loaded, before the drop); logged below MIN_HUGE_PAGE_SHARE. Chunks of `chunk_bytes`
    are read by a few threads: the copy out of the page cache and the kernel's zeroing of fresh pages take one
    core each (4.2 GB in ~0.3 s on 2 cores, cached)."""
    from concurrent.futures import ThreadPoolExecutor

    from .huge_pages import huge_page_buffer, settle

    header, data_start = read_safetensors_header(path)
    dtypes = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
    layout, size = {}, 0  # name -> (file offset, bytes, buffer offset)
    for name, info in header.items():
        if name == "__metadata__" or name in exclude:
            continue
        begin, end = info["data_offsets"]
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


# The safetensors library's own limit on a header's size.
MAX_HEADER_BYTES = 100 << 20


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The header of the safetensors file at `path` and where its data starts, checked as strictly as the safetensors
    library checks it: a JSON object of tensors with known dtypes and non-negative shapes whose byte ranges tile the
    data exactly (in order from 0, no gap, no overlap, each dtype size x elements long, ending at the file's end).
    ArtifactError naming the tensor otherwise: bytes are never read past the file or reinterpreted."""
    redo = "The file is corrupted or was edited: re-export the model."
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        if not 2 <= header_bytes <= min(MAX_HEADER_BYTES, file_size - 8):
            raise ArtifactError(f"{path}: a header of {header_bytes} bytes does not fit a {file_size}-byte file. {redo}")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ArtifactError(f"{path}: the header is not JSON ({err}). {redo}") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: the header is not a JSON object. {redo}")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ArtifactError(f"{path}: __metadata__ must map names to strings. {redo}")
    sizes = {code: torch.empty(0, dtype=dtype).element_size() for dtype, code in _SAFETENSORS_DTYPES.items()}
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if dtype not in sizes or not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{path}: tensor {name!r} has a malformed entry {info!r}. {redo}") from None
        elements = 1
        for n in shape:
            elements *= n
        if end - begin != elements * sizes[dtype]:
            raise ArtifactError(f"{path}: tensor {name!r} ({dtype}, shape {shape}) needs {elements * sizes[dtype]} "
                                f"bytes but its data_offsets {[begin, end]} span {end - begin}. {redo}")
        ranges.append((begin, end, name))
    at, data_size = 0, file_size - 8 - header_bytes
    for begin, end, name in sorted(ranges):
        if begin != at:
            raise ArtifactError(f"{path}: tensor {name!r} starts at byte {begin} of the data, expected {at} "
                                f"({'a gap' if begin > at else 'an overlap'} between tensors). {redo}")
        at = end
    if at != data_size:
        raise ArtifactError(f"{path}: the tensors cover {at} bytes of data, the file holds {data_size}. {redo}")
    return header, 8 + header_bytes


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

    Linux reads at most the device's read-ahead window per call, so this asks for the start of each chunk, not all
    of it, which would take many window-sized calls."""
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


