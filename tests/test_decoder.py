"""The static decoder itself, eager and as torch.export traces it (no compilation): the layer loop."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_COMMON, TINY_CONFIGS
from optimum_neuronx import NeuronConfig
from optimum_neuronx.exporters import get_export_config
from optimum_neuronx.backends.inductor.lowering import Lowering
from optimum_neuronx.modeling.decoder import StaticDecoder

SEQUENCE = 16


def _decoder(lowering: Lowering = Lowering(), sequence: int = SEQUENCE, **overrides) -> StaticDecoder:
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", **{**TINY_COMMON, **TINY_CONFIGS["llama"], **overrides})
    spec = get_export_config("llama").decoder_spec(config, NeuronConfig(
        sequence_length=sequence, context_buckets=[8], token_buckets=[sequence]))
    torch.manual_seed(0)
    decoder = StaticDecoder(spec, lowering).eval()
    for name, parameter in decoder.named_parameters():
        parameter.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return decoder


def _inputs(decoder: StaticDecoder, tokens: int, window: int, start: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, decoder.spec.vocab_size, (2, tokens), generator=generator)
    positions = torch.arange(start, start + tokens).expand(2, tokens)
    key_valid = torch.ones(2, window, dtype=torch.bool)
    return ids, positions, torch.tensor([start]), key_valid, torch.full((2,), tokens - 1)


def _cache(decoder: StaticDecoder) -> torch.Tensor:
    return torch.zeros(decoder.spec.kv_cache_shape(2, SEQUENCE))


@pytest.mark.parametrize("lowering", [Lowering(), Lowering(attention_tokens=SEQUENCE),
                                      Lowering(attention_tokens=1, attention_kernel=True)],
                         ids=["sdpa", "reduced", "decode_attention"])
def test_several_tokens_into_a_window_match_one_at_a_time(lowering):
    # A graph of T tokens at cache_start inside a wider window attends to the cache and to its new tokens beside it
    # (the token graphs: T = 1); the cache holds the same K and V as after T single steps. Row 1 is left-padded:
    # its first two slots are never attended to.
    decoder = _decoder(lowering)
    prompt = _inputs(decoder, 8, 8, 0)
    key_valid = torch.ones(2, SEQUENCE, dtype=torch.bool)
    key_valid[1, :2] = False
    prompt = (*prompt[:3], key_valid[:, :8], prompt[4])
    together, alone = _cache(decoder), _cache(decoder)
    with torch.no_grad():
        decoder(*prompt, together)
        decoder(*prompt, alone)
        ids, positions, *_ = _inputs(decoder, 3, SEQUENCE, 8, seed=1)
        logits = decoder(ids, positions, torch.tensor([8]), key_valid, torch.full((2,), 2), together)
        for t in range(3):
            last = decoder(ids[:, t:t + 1], positions[:, t:t + 1], torch.tensor([8 + t]), key_valid,
                           torch.zeros(2, dtype=torch.long), alone)
        padded = key_valid.clone()
        padded[1, :2] = True  # the padding's slots hold K/V (of pad tokens); attending to them changes row 1 only
        unmasked = decoder(ids[:, 2:], positions[:, 2:], torch.tensor([10]), padded, torch.zeros(2, dtype=torch.long),
                           _cache(decoder).copy_(alone))
    torch.testing.assert_close(logits, last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert together[:, :, :, :, 8:11].abs().amin(dim=-1).sum() > 0 and not together[:, :, :, :, 11:].any()
    torch.testing.assert_close(unmasked[0], last[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[1], last[1], rtol=1e-3, atol=1e-3)


def test_stacked_layers_compute_what_unrolled_layers_do():
    # Per-layer weights (unrolled, where oneDNN packs them) and stacked weights (one loop) hold the same numbers
    # under different names; both layouts give the same logits and the same cache.
    stacked = _decoder()
    unrolled = _decoder(Lowering(packed_rows=8))
    assert isinstance(unrolled.layers, torch.nn.ModuleList) and not isinstance(stacked.layers, torch.nn.ModuleList)
    with torch.no_grad():
        for name, weight in stacked.named_parameters():
            if name.startswith("layers."):
                for i, layer in enumerate(unrolled.layers):
                    layer.get_parameter(name.removeprefix("layers.")).copy_(weight[i])
            else:
                unrolled.get_parameter(name).copy_(weight)
        caches = _cache(stacked), _cache(unrolled)
        for tokens, window, start in ((8, 8, 0), (1, SEQUENCE, 8)):
            args = _inputs(stacked, tokens, window, start)
            torch.testing.assert_close(stacked(*args, caches[0]), unrolled(*args, caches[1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(*caches, rtol=1e-5, atol=1e-5)


def test_stacked_layers_unrolled_over_their_slices_compute_what_the_loop_does():
    # Kernels.scan_layers False (compilers without `scan`): the same stacked weights, the layers unrolled; no scan
    # in the exported graph.
    from optimum_neuronx.modeling.kernels import Kernels

    class Unrolled(Kernels):
        scan_layers = False

    looped = _decoder(Kernels())
    unrolled = _decoder(Unrolled())
    unrolled.load_state_dict(looped.state_dict())
    caches = _cache(looped), _cache(unrolled)
    with torch.no_grad():
        for tokens, window, start in ((8, 8, 0), (1, SEQUENCE, 8)):
            args = _inputs(looped, tokens, window, start)
            torch.testing.assert_close(looped(*args, caches[0]), unrolled(*args, caches[1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(*caches, rtol=1e-5, atol=1e-5)
    assert caches[0].any()
    program = torch.export.export(unrolled, (*_inputs(unrolled, 1, SEQUENCE, 8), _cache(unrolled)), strict=False)
    assert not any(node.target is torch.ops.higher_order.scan for node in program.graph.nodes)


@pytest.mark.parametrize("tokens, window, start", [(8, 8, 0), (1, SEQUENCE, 8)], ids=["context", "token"])
def test_exported_graph_holds_one_layer_whatever_the_layer_count(tokens, window, start):
    # The layers run as one loop: torch.export traces one layer, whatever num_hidden_layers is, so what Inductor
    # lowers and g++ compiles does not grow with the model's depth.
    def exported_ops(layers: int) -> tuple[list[str], int]:
        decoder = _decoder(num_hidden_layers=layers)
        program = torch.export.export(decoder, (*_inputs(decoder, tokens, window, start), _cache(decoder)),
                                      strict=False)
        loops = [node for node in program.graph.nodes if node.target is torch.ops.higher_order.scan]
        modules = [program.graph_module, *(getattr(program.graph_module, node.args[0].target) for node in loops)]
        nodes = [node for module in modules for node in module.graph.nodes]
        # Static shapes throughout, the loop's body included (Dynamo's first look at the body may be symbolic).
        values = [value for node in nodes for value in torch.utils._pytree.tree_leaves(node.meta.get("val"))]
        assert not any(isinstance(size, torch.SymInt) for value in values if isinstance(value, torch.Tensor)
                       for size in value.shape)
        return sorted(str(node.target) for node in nodes if node.op == "call_function"), len(loops)

    one, loops = exported_ops(1)
    assert loops == 1
    assert exported_ops(4) == (one, 1)


RING_LAYOUTS = {
    # every layer sliding: a ring of 10 slots per layer
    "every-layer": (None, ((0, 0, 10), (1, 0, 10))),
    # layer 1 full: a row of all 32 slots; the three sliding layers' rings side by side in one row (3 fit in 32)
    "some-layers": (["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                    ((1, 0, 10), (0, 0, 32), (1, 10, 10), (1, 20, 10))),
}


@pytest.mark.parametrize("layout", RING_LAYOUTS)
@pytest.mark.parametrize("context, prompt", [(8, 6), (16, 14)], ids=["context-within-ring", "context-past-ring"])
def test_window_ring_cache_computes_what_the_whole_cache_does(context, prompt, layout):
    # Sliding layers keeping only their 10-token window (slot s at s mod 10) give the logits of a cache of all 32
    # slots, through a left-padded, right-padded context and decode steps in windows narrower and wider than the
    # ring.
    import dataclasses

    sequence, window = 32, 10
    layer_types, places = RING_LAYOUTS[layout]
    overrides = dict(num_hidden_layers=len(layer_types), layer_types=layer_types) if layer_types else {}
    ring = _decoder(sequence=sequence, sliding_window=window, **overrides)  # what the llama table makes of it
    assert ring.spec.cache_places == places
    full = StaticDecoder(dataclasses.replace(ring.spec, cache_places=())).eval()
    full.load_state_dict(ring.state_dict())
    spec = full.spec
    full_cache, ring_cache = (torch.zeros(d.spec.kv_cache_shape(2, sequence)) for d in (full, ring))
    assert ring_cache.numel() < full_cache.numel()
    key_valid = torch.zeros(2, sequence, dtype=torch.bool)
    key_valid[0, :prompt] = True
    key_valid[1, 3:prompt] = True  # left padding
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, spec.vocab_size, (2, context), generator=generator)
    positions = (key_valid[:, :context].long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        inputs = (ids, positions, torch.tensor([0]), key_valid[:, :context].clone(), torch.full((2,), prompt - 1))
        torch.testing.assert_close(ring(*inputs, ring_cache), full(*inputs, full_cache))
        for slot in range(prompt, sequence):
            width = next(w for w in (8, 16, 32) if w > slot)
            key_valid[:, slot] = True
            step = (torch.randint(3, spec.vocab_size, (2, 1), generator=generator),
                    key_valid[:, :slot + 1].sum(1, keepdim=True) - 1, torch.tensor([slot]),
                    key_valid[:, :width].clone(), torch.zeros(2, dtype=torch.long))
            torch.testing.assert_close(ring(*step, ring_cache), full(*step, full_cache), msg=f"slot {slot}")


def test_experts_gathered_for_few_tokens_compute_what_every_expert_mixed_does():
    # One token picking 2 of 8 experts runs those 2 experts' gathered weights; 8 tokens run every expert, mixed.
    import dataclasses

    from optimum_neuronx.modeling.layers import mixture_of_experts

    spec = dataclasses.replace(_decoder().spec, mlp="moe", num_experts=8, experts_per_token=2, intermediate_size=24)
    generator = torch.Generator().manual_seed(0)
    hidden = spec.hidden_size
    weights = {"router.weight": torch.randn(8, hidden, generator=generator),
               "experts_gate_up.weight": torch.randn(8, 48, hidden, generator=generator) * 0.1,
               "experts_down.weight": torch.randn(8, hidden, 24, generator=generator) * 0.1}
    x = torch.randn(1, 8, hidden, generator=generator)
    every_expert = mixture_of_experts(x, weights, spec)  # 8 tokens x 2 >= 8 experts: all run
    for t in range(8):
        torch.testing.assert_close(mixture_of_experts(x[:, t:t + 1], weights, spec), every_expert[:, t:t + 1])


# A cache of every slot; sliding rings of 6 on every layer; rings of 10 packed beside a full layer.
CACHE_LAYOUTS = [{}, dict(sliding_window=6),
                 dict(sliding_window=10, num_hidden_layers=4,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])]


def _greedy_alone(decoder, prompt: torch.Tensor, steps: int, sequence: int) -> list[int]:
    """`steps` greedy tokens of `prompt` run alone at batch 1 (one context call, then one token a call)."""
    cache, n = torch.zeros(decoder.spec.kv_cache_shape(1, sequence)), len(prompt)
    valid = torch.ones(1, sequence, dtype=torch.bool)
    with torch.no_grad():
        logits = decoder(prompt[None], torch.arange(n)[None], torch.tensor([0]), valid[:, :n].clone(),
                         torch.tensor([n - 1]), cache)
        tokens = []
        for i in range(steps):
            tokens.append(int(logits.argmax()))
            logits = decoder(torch.tensor([[tokens[-1]]]), torch.tensor([[n + i]]), torch.tensor([n + i]),
                             valid.clone(), torch.tensor([0]), cache)
    return tokens


def _three_rows(overrides: dict, seed: int, sequence: int):
    """A tiny decoder with `overrides`, three random prompts (5, 11 and 20 tokens), an empty three-row cache and its
    key_valid."""
    decoder = _decoder(sequence=sequence, **overrides)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, decoder.spec.vocab_size, (n,), generator=generator) for n in (5, 11, 20)]
    return (decoder, prompts, torch.zeros(decoder.spec.kv_cache_shape(3, sequence)),
            torch.zeros(3, sequence, dtype=torch.bool))


def _decode_together(decoder, tokens: list[list[int]], lengths: list[int], valid, cache, steps: int) -> None:
    """`steps` decode calls of every row at its own length (`lengths`), each row's greedy token appended."""
    rows = len(tokens)
    for _ in range(steps):
        starts = torch.tensor(lengths)
        valid[torch.arange(rows), starts] = True
        logits = decoder(torch.tensor([[t[-1]] for t in tokens]), starts[:, None], starts, valid.clone(),
                         torch.zeros(rows, dtype=torch.long), cache)
        for row in range(rows):
            tokens[row].append(int(logits[row].argmax()))
            lengths[row] += 1


@pytest.mark.parametrize("overrides", CACHE_LAYOUTS, ids=["full-cache", "rings", "packed-rings"])
def test_rows_prefilled_in_chunks_then_stepped_together_match_each_row_alone(overrides):
    # Continuous batching's graph inputs: each row's prompt written into its cache row by a one-row graph (seq_ids)
    # in chunks of 8 from slot 0 (a chunk of 8 is wider than the 6-slot ring, the last chunk padded), then every row
    # decoded in one call at its own cache_start. Each row's greedy tokens equal the row run alone at batch 1.
    sequence, chunk = 32, 8
    decoder, prompts, cache, valid = _three_rows(overrides, seed=0, sequence=sequence)
    lengths, tokens = [len(p) for p in prompts], []
    with torch.no_grad():
        expected = [_greedy_alone(decoder, p, 6, sequence) for p in prompts]
        for row, prompt in enumerate(prompts):
            for start in range(0, len(prompt), chunk):
                k = min(chunk, len(prompt) - start)
                ids = torch.zeros(1, chunk, dtype=torch.long)
                ids[0, :k] = prompt[start:start + k]
                valid[row, :start + k] = True
                logits = decoder(ids, torch.arange(start, start + chunk)[None], torch.tensor([start]),
                                 valid[row:row + 1].clone(), torch.tensor([k - 1]), cache, torch.tensor([row]))
            tokens.append([int(logits.argmax())])
        _decode_together(decoder, tokens, lengths, valid, cache, steps=5)
    assert tokens == expected


@pytest.mark.parametrize("overrides", CACHE_LAYOUTS, ids=["full-cache", "rings", "packed-rings"])
def test_a_prompt_prefilled_in_fused_steps_while_other_rows_decode_matches_each_row_alone(overrides):
    # The fused graph's inputs: one token for each cache row, then a chunk of 8 for one row, in one call. Rows 0 and
    # 1 decode while row 2's prompt of 20 is prefilled in three such steps (row 2's own token is written at the
    # chunk's first slot, which the chunk then overwrites); then all three decode together.
    sequence, chunk, window = 32, 8, 32
    decoder, prompts, cache, valid = _three_rows(overrides, seed=1, sequence=sequence)
    rows, vocab = len(prompts), decoder.spec.vocab_size
    lengths, tokens = [0] * rows, [[] for _ in range(rows)]
    with torch.no_grad():
        expected = [_greedy_alone(decoder, p, 6 if row < 2 else 4, sequence) for row, p in enumerate(prompts)]
        for row in (0, 1):  # each prompt in one chunk of its own
            n = len(prompts[row])
            valid[row, :n] = True
            logits = decoder(prompts[row][None], torch.arange(n)[None], torch.tensor([0]), valid[row:row + 1].clone(),
                             torch.tensor([n - 1]), cache, torch.tensor([row]))
            tokens[row].append(int(logits.argmax()))
            lengths[row] = n
        prompt, start = prompts[2], 0
        while start < len(prompt):  # rows 0 and 1 step while row 2 is prefilled
            k = min(chunk, len(prompt) - start)
            lengths[2] = start  # what the row holds: its own token's slot is the chunk's first
            starts = torch.tensor(lengths)
            valid[[0, 1], starts[:2]] = True
            valid[2, start:start + k] = True
            ids = torch.zeros(1, rows + chunk, dtype=torch.long)
            ids[0, :2] = torch.tensor([tokens[0][-1], tokens[1][-1]])
            ids[0, rows:rows + k] = prompt[start:start + k]
            positions = torch.cat((starts, torch.arange(start, start + chunk)))[None]
            logits = decoder(ids, positions, torch.cat((starts, torch.tensor([start]))),
                             valid[[0, 1, 2, 2], :window].clone(), torch.tensor([0, 0, 0, k - 1]), cache,
                             torch.tensor([0, 1, 2, 2]))
            assert logits.shape == (rows + 1, vocab)
            for row in (0, 1):
                tokens[row].append(int(logits[row].argmax()))
                lengths[row] += 1
            start += k
        tokens[2].append(int(logits[rows].argmax()))
        lengths[2] = len(prompt)
        _decode_together(decoder, tokens, lengths, valid, cache, steps=3)
    assert [t[:len(e)] for t, e in zip(tokens, expected)] == expected
