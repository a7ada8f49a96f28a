"""The greedy verdict shared by `optimum-cli neuron verify` and the benchmark: exact, near-tie or different."""

from types import SimpleNamespace

import pytest
import torch

from optimum_neuronx.verification import compare_generation


class Scripted:
    """A model whose greedy generation is given: `tokens` per row, with these logits at every step. Its float32
    copy (`float()`) returns the same logits plus `float32_shift` after any prefix, and records the prefixes."""

    def __init__(self, tokens, logits, dtype, float32_shift=0.0):
        self.tokens, self.logits, self.dtype = torch.tensor(tokens), logits, dtype
        self.float32_shift, self.prefixes = float32_shift, []

    def generate(self, input_ids, attention_mask=None, **kwargs):
        return SimpleNamespace(sequences=torch.cat([input_ids, self.tokens], 1),
                               logits=[step for step in self.logits.unbind(1)])

    def __deepcopy__(self, memo):  # the copy records into the same list
        twin = Scripted(self.tokens.tolist(), self.logits, self.dtype, self.float32_shift)
        twin.prefixes = self.prefixes
        return twin

    def float(self):
        self.dtype = torch.float32
        return self

    def __call__(self, input_ids):
        self.prefixes.append(input_ids[0].tolist())
        logits = self.logits[0, 0] + self.float32_shift
        return SimpleNamespace(logits=logits.expand(1, input_ids.shape[1], -1))


def _logits(rows=2, steps=3, vocab=5, top=(20.0, 19.0)):
    # Token 0 is the reference's greedy choice everywhere; token 1 is `top[0] - top[1]` below it.
    logits = torch.zeros(rows, steps, vocab)
    logits[..., 0], logits[..., 1] = top
    return logits


@pytest.mark.parametrize("gap, dtype, verdict", [
    (0.0625, torch.bfloat16, "near-tie"),  # 20 - 19.9375: half a bf16 unit at 20 (0.125)
    (1.0, torch.bfloat16, "NO"),           # a real gap: not a rounding tie
    (0.0625, torch.float32, "NO"),         # float32 has no excuse
])
def test_verdict_tells_rounding_ties_from_real_mismatches(gap, dtype, verdict):
    prompt = torch.tensor([[7, 8], [9, 10]])
    logits = _logits(top=(20.0, 20.0 - gap))
    reference = Scripted([[0, 0, 0], [0, 0, 0]], logits, dtype)
    ours = Scripted([[0, 0, 0], [0, 1, 3]], logits, dtype)  # row 1 leaves the path at step 1, token 1
    assert compare_generation(reference, reference, prompt).verdict == "yes"
    result = compare_generation(reference, ours, prompt)
    assert not result.tokens_match and result.verdict == verdict
    assert ("DIFFER" in result.summary()) == (verdict == "NO")


@pytest.mark.parametrize("float32_shift, verdict", [
    (1.5, "near-tie"),  # the reference is itself 1.5 off float32 here: a gap of 1.0 is within its own rounding
    (0.5, "NO"),        # it rounds only 0.5 away: a gap of 1.0 is a real difference
])
def test_near_tie_allows_the_references_own_rounding(float32_shift, verdict):
    # Left-padded prompts; row 1 leaves the path at its second new token (step 1), to a token 1.0 below.
    prompt, mask = torch.tensor([[7, 8], [0, 10]]), torch.tensor([[1, 1], [0, 1]])
    logits = _logits(top=(20.0, 19.0))
    reference = Scripted([[0, 0, 0], [0, 0, 0]], logits, torch.bfloat16, float32_shift)
    ours = Scripted([[0, 0, 0], [0, 1, 3]], logits, torch.bfloat16)
    result = compare_generation(reference, ours, prompt, mask)
    assert result.verdict == verdict
    # The float32 copy saw row 1's own tokens (no padding) up to the divergent step; the reference kept its dtype
    assert reference.prefixes == [[10, 0]] and reference.dtype == torch.bfloat16


def test_rounding_error_of_a_real_half_precision_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_neuronx.verification import _RoundingError

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    exact = LlamaForCausalLM(config).eval()
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(exact.state_dict())
    reference.to(torch.bfloat16)
    exact.load_state_dict({name: value.to(torch.bfloat16).float() for name, value in exact.state_dict().items()})
    prefix = torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        half = reference(input_ids=prefix[None]).logits[0, -1].float()
        expected = (half - exact(input_ids=prefix[None]).logits[0, -1]).abs().max().item()
    padded = torch.cat([torch.zeros(2, dtype=torch.long), prefix])  # two pads, dropped by the mask
    error = _RoundingError(reference, torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]))(padded, 1, half)
    assert 0 < error == pytest.approx(expected, rel=0.05)  # (rotary frequencies rounded to bf16 in the copy)
    assert next(reference.parameters()).dtype == torch.bfloat16
