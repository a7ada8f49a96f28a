"""On-device sampling: the graphs pick the next token (greedy, temperature, top-k, top-p) as Transformers would."""

import logging

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from optimum_neuronx import NeuronModelForCausalLM
from optimum_neuronx.configuration import NeuronConfig
from optimum_neuronx.modeling.sampling import MAX_TOP_K, sample_tokens

from conftest import assert_staggered_requests_match_generate_alone, left_padded_prompts, tiny_export

MODEL = "llama"


def transformers_probabilities(logits, top_k, top_p, temperature):
    """Transformers' sampling distribution: its own warpers (temperature, top-k, top-p), then softmax."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return torch.softmax(warpers(None, logits.clone()), dim=-1)


@pytest.mark.parametrize("top_k, top_p, temperature", [(5, 1.0, 1.0), (50, 0.8, 0.7), (0, 1.0, 1.3), (20, 0.5, 1.0),
                                                       (1, 1.0, 1.0), (MAX_TOP_K, 0.95, 0.9)])
def test_sample_tokens_draws_transformers_distribution(top_k, top_p, temperature):
    """Inverse transform sampling over an even grid of 20000 uniforms: each token's share of the grid is its
    probability under Transformers' warpers, to within the grid's step (exact, not a statistical bound)."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 3
    grid = 20000
    uniform = (torch.arange(grid) + 0.5) / grid
    sampling = torch.tensor([top_k, top_p, temperature, 0.0]).repeat(grid, 1)
    sampling[:, 3] = uniform
    tokens = sample_tokens(logits.expand(grid, -1), sampling)
    shares = torch.bincount(tokens, minlength=logits.numel()).double() / grid
    expected = transformers_probabilities(logits[None], top_k, top_p, temperature)[0].double()
    assert (shares - expected).abs().max().item() <= 2 / grid
    greedy = sample_tokens(logits[None], torch.tensor([[top_k, top_p, 0.0, 0.7]]))
    assert greedy.item() == logits.argmax().item()


@pytest.mark.parametrize("top_p", [0.0, 1e-9, 1e-3, 1.0])
@pytest.mark.parametrize("top_k", [1, 5, MAX_TOP_K])
def test_top_p_edge_values_keep_the_most_likely_token(top_k, top_p):
    """top_p at or near 0 keeps the most likely candidate, as Transformers' TopPLogitsWarper (min_tokens_to_keep=1):
    every draw over the uniform grid matches its distribution, including uniforms at the grid's ends."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    uniform = torch.tensor([0.0, 1e-7, 0.25, 0.5, 0.999999, 0.9999999])
    for row in logits:
        sampling = torch.tensor([top_k, top_p, 1.0, 0.0]).repeat(len(uniform), 1)
        sampling[:, 3] = uniform
        tokens = sample_tokens(row.expand(len(uniform), -1), sampling)
        expected = transformers_probabilities(row[None], top_k, top_p, 1.0)[0]
        assert (expected[tokens] > 0).all(), (tokens, expected.topk(3))
        if top_p < 1e-2 or top_k == 1:
            assert (tokens == row.argmax()).all()


@pytest.fixture(scope="module")
def sampling_model(tiny_checkpoint):
    """The tiny Llama (batch 3, buckets 32 and 64) whose context and token graphs also pick the next token."""
    return NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL), export=True, **tiny_export(MODEL),
                                                  on_device_sampling=True)


def _served_on_device(model, monkeypatch):
    """Count the generate calls that ran with on-device sampling (the request the graphs got)."""
    from optimum_neuronx import generation

    requests = []

    def record(*args, **kwargs):
        requests.append(generation.on_device_sampler(*args, **kwargs))
        return requests[-1]

    monkeypatch.setattr("optimum_neuronx.runtime.on_device_sampler", record)
    return requests


def test_greedy_tokens_equal_the_logits_path(sampling_model, compiled_model, reference_model, monkeypatch):
    """Greedy, picked inside the graphs: 40 new tokens across the 32 -> 64 bucket, 3 left-padded prompts, equal to
    the logits path of the same export, to an export without sampling graphs, and to Transformers."""
    requests = _served_on_device(sampling_model, monkeypatch)
    input_ids, attention_mask = left_padded_prompts([16, 11, 5], seed=7)
    options = dict(attention_mask=attention_mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    on_device = sampling_model.generate(input_ids, **options)
    assert requests[-1] == (0.0, 1.0, 0.0)
    logits_path = sampling_model.generate(input_ids, on_device_sampling=False, **options)
    assert requests[-1] is None
    assert torch.equal(on_device, logits_path)
    assert torch.equal(on_device, compiled_model(MODEL).generate(input_ids, **options))
    assert torch.equal(on_device, reference_model(MODEL).generate(input_ids, **options))


@pytest.mark.parametrize("options", [dict(top_k=4), dict(top_k=30, top_p=0.7, temperature=0.8),
                                     dict(top_k=0, temperature=1.5)], ids=["top_k", "top_k+top_p+temp", "temperature"])
def test_sampled_first_tokens_follow_transformers_distribution(sampling_model, reference_model, monkeypatch,
                                                               options):
    """600 seeded draws of the first new token (3 rows x 200 generate calls) on the graphs: the frequencies match
    Transformers' distribution from eager logits (chi-square over the tokens it gives >= 2% mass, the rest pooled;
    a seeded test, so no flakiness: 0.1% level)."""
    requests = _served_on_device(sampling_model, monkeypatch)
    prompt = torch.tensor([[5, 9, 13, 17, 21, 25]]).repeat(3, 1)
    torch.manual_seed(0)
    draws = torch.cat([sampling_model.generate(prompt, max_new_tokens=1, do_sample=True, **options)[:, -1]
                       for _ in range(200)])
    assert requests[-1] is not None
    with torch.no_grad():
        logits = reference_model(MODEL)(prompt[:1]).logits[:, -1]
    probs = transformers_probabilities(logits, options.get("top_k", 50), options.get("top_p", 1.0),
                                       options.get("temperature", 1.0))[0].double()
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0  # never a token Transformers would never draw
    major = probs >= 0.02
    observed = torch.cat([counts[major], counts[~major].sum()[None]])
    expected = torch.cat([probs[major], probs[~major].sum()[None]]) * draws.numel()
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    dof = int(keep.sum()) - 1
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3  # chi-square 99.9% (Wilson-Hilferty)
    assert statistic < critical, (statistic, observed, expected)


@pytest.mark.parametrize("top_k", [None, 0, 10])
def test_top_p_zero_generates_greedy_tokens(sampling_model, reference_model, top_k):
    """do_sample with top_p 0 (with or without top_k): greedy, on the graphs (top_k 10) or the logits (no top_k),
    equal to Transformers' own sampling with the same options."""
    input_ids, attention_mask = left_padded_prompts([16, 11, 5], seed=7)
    options = dict(attention_mask=attention_mask, max_new_tokens=12, eos_token_id=None, do_sample=True, top_p=0.0,
                   top_k=top_k)
    greedy = reference_model(MODEL).generate(input_ids, attention_mask=attention_mask, max_new_tokens=12,
                                             eos_token_id=None, do_sample=False)
    torch.manual_seed(0)
    assert torch.equal(sampling_model.generate(input_ids, **options), greedy)
    torch.manual_seed(0)
    assert torch.equal(reference_model(MODEL).generate(input_ids, **options), greedy)


def test_seeded_sampling_repeats(sampling_model):
    prompt, mask = left_padded_prompts([9, 4, 12], seed=3)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(sampling_model.generate(prompt, attention_mask=mask, do_sample=True, top_k=20, top_p=0.9,
                                            max_new_tokens=20, eos_token_id=None))
    assert torch.equal(*outs)


def test_requests_the_graphs_cannot_do_fall_back_to_the_logits(sampling_model, reference_model, monkeypatch, caplog):
    """Beam search, a repetition penalty, min_new_tokens, top_k past MAX_TOP_K, top_p without top_k: the logits path
    runs (a debug log names why), with Transformers' results; asked for explicitly, each is an error naming it."""
    requests = _served_on_device(sampling_model, monkeypatch)
    prompt = torch.tensor([[5, 9, 13, 17]])
    for options, named in [(dict(num_beams=2), "num_beams=2"), (dict(repetition_penalty=1.3), "repetition_penalty=1.3"),
                           (dict(min_new_tokens=5), "min_new_tokens=5"),
                           (dict(do_sample=True, top_k=0, top_p=0.9), "top_p=0.9 without top_k")]:
        with caplog.at_level(logging.DEBUG, logger="optimum_neuronx"):
            torch.manual_seed(3)
            actual = sampling_model.generate(prompt, max_new_tokens=6, **options)
        assert requests[-1] is None and named in caplog.text
        torch.manual_seed(3)
        expected = reference_model(MODEL).generate(prompt, max_new_tokens=6, **options)
        if not options.get("do_sample"):
            assert torch.equal(actual, expected)
        with pytest.raises(ValueError, match=rf"on_device_sampling=True, but the graphs cannot do .*{named}"):
            sampling_model.generate(prompt, max_new_tokens=6, on_device_sampling=True, **options)


def test_top_k_past_the_graphs_candidates_runs_on_the_logits():
    from transformers import GenerationConfig

    from optimum_neuronx.generation import on_device_blockers

    config = GenerationConfig(do_sample=True, top_k=MAX_TOP_K + 1)
    assert on_device_blockers(config, {}, vocab_size=1000) == [f"top_k={MAX_TOP_K + 1} (more than {MAX_TOP_K})"]
    assert on_device_blockers(config, {}, vocab_size=MAX_TOP_K + 1) == []  # the whole vocabulary: no top-k at all
    assert on_device_blockers(GenerationConfig(do_sample=True, top_k=40, top_p=0.9, temperature=0.6), {}, 1000) == []
    assert on_device_blockers(GenerationConfig(), {"logits_processor": [object()]}, 1000) == ["logits_processor"]


def test_on_device_sampling_errors(compiled_model):
    with pytest.raises(ValueError, match=r"this export's graphs return logits only. Re-export with "
                                         r"on_device_sampling=True"):
        compiled_model(MODEL).generate(torch.tensor([[5, 6]]), max_new_tokens=2, on_device_sampling=True)
    with pytest.raises(ValueError, match=r"on_device_sampling must be True or False, got 'yes'"):
        NeuronConfig(on_device_sampling="yes")


@pytest.mark.slow
@pytest.mark.pjrt
def test_sampling_graphs_on_the_neuron_backend(tiny_checkpoint, compiled_model, monkeypatch):
    """The same graphs lowered to StableHLO: greedy tokens picked on the (XLA) device equal the inductor export's;
    through the engine's slots only the picked token ids come back to the host."""
    model = NeuronModelForCausalLM.from_pretrained(tiny_checkpoint(MODEL), export=True, **tiny_export(MODEL),
                                                   backend="neuron", on_device_sampling=True)
    input_ids, attention_mask = left_padded_prompts([16, 11, 5], seed=7)
    options = dict(attention_mask=attention_mask, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(model.generate(input_ids, on_device_sampling=True, do_sample=False, **options),
                       compiled_model(MODEL).generate(input_ids, do_sample=False, **options))
    greedy = compiled_model(MODEL).generate(input_ids, do_sample=False, **options)
    for top_p in (0.0, 1e-9):  # no candidate but the most likely survives: greedy, as in Transformers
        torch.manual_seed(1)
        assert torch.equal(model.generate(input_ids, on_device_sampling=True, do_sample=True, top_k=10,
                                          top_p=top_p, **options), greedy)
    torch.manual_seed(1)
    sampled = model.generate(input_ids, on_device_sampling=True, do_sample=True, top_k=10, **options)
    assert not torch.equal(sampled, greedy)  # drawn, not argmax (seeded: the same draws every run)

    from optimum_neuronx.backends.neuron import backend as neuron_backend

    copied, to_torch = [], neuron_backend.to_torch
    monkeypatch.setattr(neuron_backend, "to_torch", lambda array: copied.append(tuple(array.shape)) or to_torch(array))
    assert_staggered_requests_match_generate_alone(model)
    # generate (greedy on the device) and the slots alike: token ids only, [rows]
    assert copied and all(len(shape) == 1 for shape in copied), copied
