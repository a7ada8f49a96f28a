"""Transformers' GenerationMixin drives the compiled graphs: every decoding option matches eager."""

import logging
import subprocess
import sys

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

MODEL = "llama"


@pytest.fixture(scope="module")
def pair(reference_model, compiled_model):
    return reference_model(MODEL), compiled_model(MODEL)


def _both(pair, input_ids, seed=None, **kwargs):
    outputs = []
    for model in pair:
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(model.generate(input_ids=input_ids, **kwargs))
    return outputs


@pytest.mark.parametrize("options", [
    dict(do_sample=True, top_k=20),
    dict(do_sample=True, top_p=0.8, temperature=0.7),
    dict(do_sample=True, top_k=0, temperature=1.3),
], ids=["top_k", "top_p+temperature", "temperature"])
def test_seeded_sampling_matches_eager(pair, left_padded_batch, options):
    input_ids, attention_mask = left_padded_batch
    expected, actual = _both(pair, input_ids, seed=1234, attention_mask=attention_mask, max_new_tokens=30, **options)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2)],
                         ids=["repetition_penalty", "no_repeat_ngram_size"])
def test_penalties_match_eager(pair, left_padded_batch, options):
    input_ids, attention_mask = left_padded_batch
    expected, actual = _both(pair, input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False,
                             **options)
    assert torch.equal(actual, expected)
    if "no_repeat_ngram_size" in options:
        eos, checked = pair[1].generation_config.eos_token_id, 0
        for row in actual.tolist():
            generated = row[input_ids.shape[1]:]
            if eos in generated:  # a finished row is padded after its EOS: pad bigrams repeat
                generated = generated[:generated.index(eos) + 1]
            bigrams = list(zip(generated, generated[1:]))
            assert len(bigrams) == len(set(bigrams))
            checked += len(bigrams)
        assert checked >= 20, actual  # the check above saw real generations, not only rows that ended at once


def test_list_eos_token_id_stops_like_eager(pair):
    prompt = torch.tensor([[11, 22, 33, 44]])
    free = pair[1].generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30)[0, 4:].tolist()
    stop_token = free[9]
    first = free.index(stop_token)
    eos = [255 if stop_token != 255 else 254, stop_token]
    expected, actual = _both(pair, prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(actual, expected)
    assert actual.shape[1] == 4 + first + 1 and actual[0, -1].item() == stop_token


class StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_max_new_tokens(pair):
    prompt = torch.tensor([[3, 4, 5]])
    expected, actual = _both(pair, prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40,
                             stopping_criteria=StoppingCriteriaList([StopAfter(10)]))
    assert torch.equal(actual, expected) and actual.shape[1] == 10
    assert pair[1].generate(prompt, max_new_tokens=7, min_new_tokens=7, do_sample=False).shape[1] == 3 + 7


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_every_token(pair):
    prompt = torch.tensor([[9, 8, 7]])
    streamer = Collect()
    out = pair[1].generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, streamer=streamer)
    assert streamer.ended and streamer.tokens == out[0].tolist()


def test_no_state_leaks_between_calls(pair, left_padded_batch):
    model = pair[1]
    input_ids, attention_mask = left_padded_batch
    short = torch.tensor([[200, 100, 50]])
    first = model.generate(short, max_new_tokens=35, do_sample=False, min_new_tokens=35)
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False)
    torch.manual_seed(0)
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=True)
    again = model.generate(short, max_new_tokens=35, do_sample=False, min_new_tokens=35)
    assert torch.equal(first, again)


def test_beam_search_matches_eager(pair):
    prompt = torch.tensor([[12, 34, 56, 78]])
    expected, actual = _both(pair, prompt, max_new_tokens=20, num_beams=3, do_sample=False, min_new_tokens=20)
    assert torch.equal(actual, expected)


def test_forward_rolls_back_with_crop(pair):
    """The cache handle's crop() rewinds the static cache: re-feeding the same tokens gives the same logits."""
    model = pair[1]
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(ids)
    handle = out.past_key_values
    steps = torch.tensor([[9, 10, 11]])
    first = model(steps, past_key_values=handle, logits_to_keep=0).logits
    assert handle.get_seq_length() == 7
    handle.crop(0)  # Transformers 5: remove nothing
    assert handle.get_seq_length() == 7
    handle.crop(-3)
    again = model(steps, past_key_values=handle, logits_to_keep=0).logits
    assert torch.equal(first, again)
    with torch.no_grad():
        expected = pair[0](torch.cat([ids, steps], 1)).logits[:, -3:]
    assert (again - expected).abs().max().item() < 1e-3


def test_kv_cache_is_written_in_place(pair):
    """The graphs write the runtime's own cache tensors: same storage before and after, new slot filled."""
    model = pair[1]
    cache = model._engine.cache
    pointer = cache.kv.data_ptr()
    handle = model(torch.tensor([[1, 2, 3, 4, 5]])).past_key_values
    model(torch.tensor([[6]]), past_key_values=handle)
    assert cache.kv.data_ptr() == pointer
    assert cache.kv.shape[0] == model.config.num_hidden_layers
    assert all(layer[:, 0, :, 5].abs().sum() > 0 for layer in cache.kv)  # every layer's slot 5: token 6's K and V
    assert handle.get_seq_length() == 6


@pytest.mark.parametrize("assistant", ["prompt_lookup", "same_model", "other_model"])
def test_assisted_generation_matches_plain_greedy(pair, reference_model, assistant):
    """Drafts accepted (the eager twin drafts: the first pass verifies several tokens at once) and rejected (another
    random model drafts: crop() rolls the cache back), and n-gram drafts from the prompt: all give plain greedy."""
    prompt = torch.tensor([[21, 22, 23, 24, 25, 21, 22, 23, 24, 25, 21, 22]])
    options = {"prompt_lookup": dict(prompt_lookup_num_tokens=3), "same_model": dict(assistant_model=pair[0]),
               "other_model": dict(assistant_model=reference_model("qwen2"))}[assistant]
    expected = pair[0].generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    actual = pair[1].generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, **options)
    assert torch.equal(actual, expected)


def test_forward_returns_more_positions_when_asked(pair):
    """logits_to_keep=0 (all) or k on a fresh context: the prompt's head is encoded, its tail fed as decode steps."""
    reference, model = pair
    ids = torch.tensor([[7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29]])
    with torch.no_grad():
        expected = reference(ids).logits
    everything = model(ids, logits_to_keep=0).logits
    assert everything.shape == expected.shape
    assert (everything - expected).abs().max().item() < 1e-3
    assert (model(ids, logits_to_keep=3).logits - expected[:, -3:]).abs().max().item() < 1e-3
    assert model(ids).logits.shape == (1, 1, expected.shape[-1])  # the default: the last position only


@pytest.mark.parametrize("options", [dict(use_cache=False), dict(cache_implementation="static")],
                         ids=["use_cache=False", "cache_implementation=static"])
def test_cache_options_are_ignored_with_a_warning(pair, left_padded_batch, caplog, options):
    input_ids, attention_mask = left_padded_batch
    plain = pair[1].generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        actual = pair[1].generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
                                  **options)
    assert torch.equal(actual, plain)
    assert f"{next(iter(options))}=" in caplog.text and "ignored" in caplog.text


THREADS_SCRIPT = """
import sys, threading, torch
from optimum_neuronx import NeuronModelForCausalLM
model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
prompts = [torch.tensor([[5 + i, 6, 7, 8, 9]]) for i in range(4)]
expected = [model.generate(p, max_new_tokens=40, min_new_tokens=40, do_sample=False) for p in prompts]
results = [[] for _ in prompts]
def run(i):
    for _ in range(3):
        results[i].append(model.generate(prompts[i], max_new_tokens=40, min_new_tokens=40, do_sample=False))
threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
for t in threads: t.start()
for t in threads: t.join()
print(all(torch.equal(out, e) for outs, e in zip(results, expected) for out in outs), sum(map(len, results)))
"""


def test_generate_from_several_threads(saved_tiny_llama):
    """Threads sharing one model take turns: each gets its own tokens, and nothing deadlocks (without the model's
    lock the AOTInductor runner waited for a graph with the GIL held). A subprocess, so a deadlock fails the test
    at the timeout instead of hanging the session."""
    result = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(saved_tiny_llama)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "12"]


def test_a_checkpoints_own_cache_choice_is_dropped_quietly(pair, saved_tiny_llama, tmp_path, caplog):
    """A generation_config.json that names a Transformers cache (models ship "hybrid", "static", ...) must not warn
    on every generate: the export keeps its own cache."""
    import json
    import shutil

    from optimum_neuronx import NeuronModelForCausalLM

    directory = shutil.copytree(saved_tiny_llama, tmp_path / "export")
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "cache_implementation": "static"}))
    model = NeuronModelForCausalLM.from_pretrained(directory)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with caplog.at_level(logging.WARNING, logger="optimum_neuronx"):
        actual = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert "ignored" not in caplog.text
    assert torch.equal(actual, pair[1].generate(prompt, max_new_tokens=8, do_sample=False))


def test_right_padded_batches_continue_from_each_rows_last_token(compiled_model, reference_model):
    """optimum-neuron's habit: right padding. Each row continues from its own last real token (positions and keys
    from the mask): its new tokens equal the same prompt generated alone, and Transformers' for that prompt."""
    import torch

    from conftest import left_padded_prompts

    left_ids, left_mask = left_padded_prompts([16, 11, 5], seed=7)
    right_ids, right_mask = torch.zeros_like(left_ids), torch.zeros_like(left_mask)
    for row in range(3):
        n = int(left_mask[row].sum())
        right_ids[row, :n], right_mask[row, :n] = left_ids[row, -n:], 1
    model = compiled_model("llama")
    out = model.generate(right_ids, attention_mask=right_mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    for row in range(3):
        n = int(right_mask[row].sum())
        alone = right_ids[row:row + 1, :n]
        expected = reference_model("llama").generate(alone, attention_mask=torch.ones_like(alone), max_new_tokens=20,
                                                     do_sample=False, eos_token_id=None)[0, n:]
        assert torch.equal(out[row, right_ids.shape[1]:], expected), row


def test_attention_mask_values_other_than_0_and_1_are_refused(compiled_model):
    import pytest
    import torch

    ids = torch.tensor([[5, 6, 7]])
    for mask in (torch.tensor([[0, 1, 2]]), torch.tensor([[0.5, 1.0, 1.0]]), torch.tensor([[-1, 1, 1]])):
        with pytest.raises(ValueError, match=r"attention_mask must hold 0 \(padding\) and 1 \(a real token\) only"):
            compiled_model("llama")(ids, attention_mask=mask)


def test_optimum_neuron_vllm_runner_arguments_are_refused(compiled_model):
    import pytest
    import torch

    ids = torch.tensor([[5, 6, 7]])
    for name, value in (("position_ids", torch.arange(3)[None]), ("seq_ids", torch.tensor([0])),
                        ("sampling_params", torch.ones(1, 3))):
        with pytest.raises(ValueError, match=rf"forward\({name}=...\): optimum-neuron's vLLM runner call is not"):
            compiled_model("llama")(ids, **{name: value})
