"""The greedy verdict shared by `optimum-cli neuron verify` and the benchmark: exact, near-tie or different."""

from types import SimpleNamespace

import pytest
import torch

from optimum_neuronx.verification import compare_generation


class Scripted:
    """A model whose greedy generation is given: `tokens` per row, with these logits at every step."""

    def __init__(self, tokens, logits, dtype):
        self.tokens, self.logits, self.dtype = torch.tensor(tokens), logits, dtype

    def generate(self, input_ids, attention_mask=None, **kwargs):
        return SimpleNamespace(sequences=torch.cat([input_ids, self.tokens], 1),
                               logits=[step for step in self.logits.unbind(1)])


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
