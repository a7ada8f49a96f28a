"""Check a compiled model against Transformers eager: logits and greedy tokens on the same inputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Comparison:
    max_logit_diff: float  # over every generated step
    min_top2_gap: float  # smallest top-1/top-2 logit gap along the reference path (numerical headroom)
    tokens_match: bool
    new_tokens: int
    # Half precision only: the tokens differ, but only where two correct implementations may round differently -
    # at the first new token where each differing row leaves the reference's path, the reference's logits for
    # its token and ours are within its own rounding: 2 units in the last place of its dtype, or, where more, the
    # most its logits there differ from the same model's in float32 (a CPU without half-precision dot products
    # rounds every product; the reference is then no closer to float32 than we are).
    near_tie: bool = False

    @property
    def verdict(self) -> str:
        return "yes" if self.tokens_match else "near-tie" if self.near_tie else "NO"

    def summary(self) -> str:
        tokens = {"yes": "match", "near-tie": "differ only at rounding-level ties", "NO": "DIFFER"}[self.verdict]
        return (f"max |logit diff| {self.max_logit_diff:.2e}, smallest top-1/top-2 gap {self.min_top2_gap:.2e}, "
                f"greedy tokens {tokens} over {self.new_tokens} new tokens")


def compare_generation(reference, compiled, input_ids, attention_mask=None, **kwargs) -> Comparison:
    """Greedy-generate with both models and compare the logits of every step and the tokens."""
    kwargs = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    expected = reference.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    actual = compiled.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    steps = min(len(expected.logits), len(actual.logits))
    ref = torch.stack(expected.logits[:steps], 1).float()
    ours = torch.stack(actual.logits[:steps], 1).float()
    top2 = ref.topk(2, dim=-1).values
    tokens_match = torch.equal(actual.sequences, expected.sequences)
    return Comparison(
        max_logit_diff=(ours - ref).abs().max().item(),
        min_top2_gap=(top2[..., 0] - top2[..., 1]).min().item(),
        tokens_match=tokens_match,
        new_tokens=actual.sequences.shape[1] - input_ids.shape[1],
        near_tie=not tokens_match and _diverges_only_at_ties(
            expected, actual, input_ids.shape[1], reference.dtype, _RoundingError(reference, attention_mask)),
    )


def _diverges_only_at_ties(expected, actual, start: int, dtype: torch.dtype, rounding_error) -> bool:
    if dtype not in (torch.bfloat16, torch.float16) or expected.sequences.shape != actual.sequences.shape:
        return False
    for row in range(expected.sequences.shape[0]):
        differs = (actual.sequences[row, start:] != expected.sequences[row, start:]).nonzero()
        if not len(differs):
            continue
        step = differs[0].item()
        logits = expected.logits[step][row].float()
        theirs = logits[expected.sequences[row, start + step]]
        ours = logits[actual.sequences[row, start + step]]
        gap = (theirs - ours).item()
        if gap > 2 * torch.finfo(dtype).eps * max(abs(theirs.item()), 1.0) and gap > rounding_error(
                expected.sequences[row, : start + step], row, logits):
            return False
    return True


class _RoundingError:
    """The most a half-precision reference's logits after a prefix differ from the same weights' in float32.

    The float32 copy is made on first use only (a differing row in half precision) and kept for the other rows."""

    def __init__(self, reference, attention_mask):
        self.reference, self.attention_mask, self.exact = reference, attention_mask, None

    def __call__(self, prefix: torch.Tensor, row: int, logits: torch.Tensor) -> float:
        if self.attention_mask is not None:  # left padding: the row's own tokens, at the positions generate gave them
            prefix = prefix[int((self.attention_mask[row] == 0).sum()):]
        if self.exact is None:
            self.exact = copy.deepcopy(self.reference).float()
        with torch.no_grad():
            exact = self.exact(input_ids=prefix[None]).logits[0, -1].float()
        return (logits - exact).abs().max().item()


def reference_from_artifact(artifact_dir: str | Path):
    """Rebuild the Transformers model (float32) from an export's own weights: no original checkpoint needed."""
    from transformers import AutoModelForCausalLM

    from .exporters.export import artifact_state_dict
    from .exporters.registry import load_model_config

    config = load_model_config(artifact_dir)
    restored = artifact_state_dict(artifact_dir, config)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.load_state_dict(restored, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        reference.tie_weights()
    return reference


def verification_prompts(neuron_config, vocab_size: int, seed: int = 0):
    """Up to 3 left-padded prompts of different lengths (as many as the compiled batch allows).

    The longest takes a quarter of the cache, leaving the rest for a generation that crosses token buckets.
    """
    longest = min(neuron_config.context_buckets[-1], max(1, neuron_config.sequence_length // 4))
    lengths = sorted({longest, max(1, longest // 2), max(1, longest // 4)}, reverse=True)
    lengths = lengths[: neuron_config.batch_size]
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), lengths[0], dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, lengths[0] - n:] = torch.randint(3, vocab_size, (n,), generator=generator)
        attention_mask[row, lengths[0] - n:] = 1
    return input_ids, attention_mask
