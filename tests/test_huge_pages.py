"""Weights read into memory in huge pages (optimum_neuronx/huge_pages.py) instead of memory-mapped."""

import logging
import mmap

import pytest
import torch

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx import weights_io as artifacts_module
from optimum_neuronx import huge_pages as huge_pages_module
from optimum_neuronx.artifacts import ArtifactError, read_artifact
from optimum_neuronx.backends import get_backend
from optimum_neuronx.weights_io import load_weights, read_into_huge_pages, save_weights
from optimum_neuronx.huge_pages import HUGE_PAGE_BYTES, huge_page_buffer, huge_page_share, transparent_huge_pages

BACKEND = get_backend("inductor")

linux_only = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="MADV_HUGEPAGE is Linux's")


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never"), ("", "")])
def test_transparent_huge_page_mode_is_read_from_the_kernel_setting(tmp_path, text, mode):
    setting = tmp_path / "enabled"
    setting.write_text(text)
    assert transparent_huge_pages(setting) == mode
    assert transparent_huge_pages(tmp_path / "absent") == ""


@linux_only
def test_buffer_starts_on_a_huge_page_and_is_zeroed():
    buffer = huge_page_buffer(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.numel() == 3 * HUGE_PAGE_BYTES + 5 and buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not buffer.any()


@linux_only
def test_huge_page_share_is_read_from_the_buffers_mapping(tmp_path):
    buffer = huge_page_buffer(4 * HUGE_PAGE_BYTES)
    low, high = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()

    def share(huge_kib: int, field: str = "AnonHugePages", of=buffer) -> float:
        smaps = tmp_path / "smaps"
        smaps.write_text(f"1000-2000 r-xp 00000000 fe:00 1 /usr/bin/python\nAnonHugePages:    4096 kB\n"
                         f"{low:x}-{high:x} rw-p 00000000 00:00 0\nSize:   8192 kB\n\n{field}: {huge_kib} kB\n")
        return huge_page_share(of, smaps)

    assert share(8192) == 1.0 and share(4096) == 0.5 and share(0) == 0.0
    assert share(4096, "FilePmdMapped") == 0.5  # a file mapping's huge folios count too
    assert share(4096, of=buffer.view(torch.float32)) == 0.5  # bytes, not elements
    assert huge_page_share(buffer[:4096], tmp_path / "absent") == 1.0  # less than a huge page: nothing to lose
    assert huge_page_share(buffer, tmp_path / "absent") == 0.0


@linux_only
def test_weights_in_huge_pages_equal_the_mapped_ones(saved_tiny_llama):
    stamp = read_artifact(saved_tiny_llama)
    mapped = load_weights(saved_tiny_llama, BACKEND, stamp.backend)
    read = load_weights(saved_tiny_llama, BACKEND, stamp.backend, huge_pages=True)
    assert read.keys() == mapped.keys()
    for name, weight in mapped.items():
        assert read[name].dtype == weight.dtype and read[name].shape == weight.shape, name
        assert torch.equal(read[name], weight), name
        assert read[name].data_ptr() % 64 == 0, name  # one buffer, every weight on a cache line
    assert min(w.data_ptr() for w in read.values()) % HUGE_PAGE_BYTES == 0


def _huge_page_shares(monkeypatch, shares: list) -> tuple[list, list]:
    """Make the kernel report `shares` (the last one from then on) and record collapses and page-cache drops."""
    collapsed, dropped = [], []
    monkeypatch.setattr(huge_pages_module, "huge_page_share",
                        lambda buffer: shares.pop(0) if len(shares) > 1 else shares[0])
    monkeypatch.setattr(huge_pages_module, "collapse", collapsed.append)
    monkeypatch.setattr(artifacts_module, "_drop_cached", dropped.append)
    return collapsed, dropped


@linux_only
def test_too_few_huge_pages_keep_the_read_copy_and_say_so(saved_tiny_llama, monkeypatch, caplog):
    collapsed, dropped = _huge_page_shares(monkeypatch, [0.5])
    stamp = read_artifact(saved_tiny_llama)
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        weights = load_weights(saved_tiny_llama, BACKEND, stamp.backend, huge_pages=True)
    # asked for huge pages twice, the second time with the file's page cache given back; the file mapped now would
    # fault in from storage into small pages, so the copy stays
    assert len(collapsed) == 2 and dropped == [str(saved_tiny_llama / "neuronx_weights.safetensors")]
    assert "Only 50% of" in caplog.text and "4 KiB pages" in caplog.text
    assert min(w.data_ptr() for w in weights.values()) % HUGE_PAGE_BYTES == 0  # the read buffer, not the file
    mapped = load_weights(saved_tiny_llama, BACKEND, stamp.backend)
    assert all(torch.equal(weights[name], weight) for name, weight in mapped.items())


@linux_only
@pytest.mark.parametrize("shares, collapses, drops", [([1.0], 0, 0), ([0.93, 1.0], 1, 0), ([0.93, 0.95, 0.99], 2, 1)])
def test_a_short_share_of_huge_pages_is_collapsed_then_given_room(saved_tiny_llama, monkeypatch, shares, collapses,
                                                                 drops):
    collapsed, dropped = _huge_page_shares(monkeypatch, shares)
    stamp = read_artifact(saved_tiny_llama)
    weights = load_weights(saved_tiny_llama, BACKEND, stamp.backend, huge_pages=True)
    assert (len(collapsed), len(dropped)) == (collapses, drops)
    # kept in the read buffer (one allocation, 2 MiB aligned), not mapped from the file
    assert min(w.data_ptr() for w in weights.values()) % HUGE_PAGE_BYTES == 0


@linux_only
def test_dropping_the_page_cache_keeps_the_file(tmp_path):
    path = tmp_path / "weights"
    path.write_bytes(b"x" * 8192)
    artifacts_module._drop_cached(str(path))
    assert path.read_bytes() == b"x" * 8192


@linux_only
def test_generation_is_the_same_from_huge_pages(saved_tiny_llama, left_padded_batch, monkeypatch):
    monkeypatch.setattr(huge_pages_module, "transparent_huge_pages", lambda *_: "madvise")
    input_ids, attention_mask = left_padded_batch
    outputs = []
    for huge_pages in (False, True):
        model = NeuronModelForCausalLM.from_pretrained(saved_tiny_llama, huge_pages=huge_pages)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        outputs.append(out)
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    for mapped, read in zip(outputs[0].scores, outputs[1].scores):
        assert torch.equal(mapped, read)


def test_huge_pages_where_the_kernel_has_none(saved_tiny_llama, monkeypatch):
    monkeypatch.setattr(huge_pages_module, "transparent_huge_pages", lambda *_: "never")
    with pytest.raises(ValueError, match=r"huge_pages=True needs Linux transparent huge pages, but .* says 'never'.*"
                                         r"Pass huge_pages=False"):
        NeuronModelForCausalLM.from_pretrained(saved_tiny_llama, huge_pages=True)
    loaded = []
    monkeypatch.setattr("optimum_neuronx.loading.load_weights",
                        lambda directory, backend, stamp, huge_pages: loaded.append(huge_pages)
                        or load_weights(directory, backend, stamp))
    NeuronModelForCausalLM.from_pretrained(saved_tiny_llama)  # the default: memory-mapped, no error
    assert loaded == [False]


@linux_only
def test_weights_beyond_the_end_of_the_file_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    save_weights({"a": torch.ones(64, 64), "b": torch.ones(8)}, path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 16)
    with pytest.raises(ArtifactError, match=r"the tensors cover 16416 bytes of data, the file holds 16400"):
        read_into_huge_pages(str(path), exclude=set())
