"""One static-shape decoder for every supported family (DecoderSpec holds what they differ on), in plain PyTorch.

A single forward serves both graphs:

    forward(input_ids[B, T], position_ids[B, T], cache_start[B], key_valid[B, W], last_index[B], kv_cache,
            seq_ids[B]) -> logits[B, V] (float32)
    (with on-device sampling, a last input sampling[B, 4] and the picked tokens [B] returned after the logits)

* context encoding: T = W = prompt bucket, cache_start = 0;
* token generation: T = 1, W = token-generation bucket, cache_start = the slot each row's token is written to;
* verification (speculative decoding): T = drafted tokens + 1 over a token bucket, last_index [B, T]: logits
  [B, T, V] at every new token;
* prefill (continuous batching): B = 1 row of the cache, the row `seq_ids` names, T = a chunk of its prompt
  written from slot cache_start (> 0: a later chunk, attending to what the row holds), W = the whole cache;
* fused (continuous batching): input_ids [1, B + C] holds one token for each of the cache's B rows, then a chunk of
  C for the row seq_ids[B]; the other inputs have B + 1 rows (the rows', then the chunk's), logits [B + 1, V]. Both
  are projected together (the weights read once) and attend apart.

Row b's T new tokens are written at cache slots cache_start[b] .. cache_start[b] + T - 1 of the preallocated cache
`kv_cache[layers, 2 (k/v), B, kv_heads, S, head_dim]`, all layers with one in-place write after the last layer;
each layer's attention reads slots 0 .. W - 1 of its cache as they were before the step, and its new tokens'
K and V beside them (sliding layers may keep only their window, `DecoderSpec.cache_places`: a ring, slot s at s
mod the window). Query t may see slot k when `key_valid[b, k]` and `k <= cache_start + t` (causal). The
layers' weights are stacked along a leading layer axis and run as one loop (`torch._higher_order_ops.scan`), so a
compiler sees one layer. Only the hidden state at `last_index` goes through the final norm and the LM head.

How projections, attention and the cache write are computed are the extension points of `Kernels`; a backend
passes its own subclass (backends/inductor/lowering.py), and every other backend gets plain PyTorch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._higher_order_ops.scan import scan

from .attention import AttentionPlan, CacheLayout, RowGroup, attention_plan, cache_layout, joined_rows, write_new_kv
from .kernels import Kernels
from .layers import DecoderLayer, Norm, Weights, residual, rotation
from .layout import tile_weight
from .sampling import SAMPLING_FIELDS, sample_tokens
from .spec import DecoderSpec


class StaticDecoder(nn.Module):
    """Inference only: parameters never require grad (a layer loop cannot be exported through autograd)."""

    def __init__(self, spec: DecoderSpec, kernels: Kernels | None = None, quantization: str | None = None):
        super().__init__()
        self.spec, self.quantization = spec, quantization
        self.kernels = kernels = Kernels() if kernels is None else kernels
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        quantized = quantization is not None  # the layers' projections int8 (modeling/quantization.py)
        if kernels.stacked_layers:
            self.layers = DecoderLayer(spec, kernels, layers=spec.num_layers, quantized=quantized)
        else:
            self.layers = nn.ModuleList(DecoderLayer(spec, kernels, quantized=quantized)
                                        for _ in range(spec.num_layers))
        if spec.positions == "learned":
            self.embed_positions = nn.Embedding(spec.max_positions, spec.hidden_size)
        self.norm = Norm(spec.hidden_size, spec.rms_norm_eps, spec.norm)
        if not spec.tie_word_embeddings:
            self.lm_head = Weights((spec.vocab_size, spec.hidden_size), tile=kernels.weight_tile_for(spec.vocab_size))
        # Explicit device: the decoder is built on the meta device at export and only this buffer is real.
        self.register_buffer("rope_inv_freq", torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device="cpu"))
        if spec.rope_long_inv_freq:
            self.register_buffer("rope_long_inv_freq", torch.tensor(spec.rope_long_inv_freq, dtype=torch.float32,
                                                                    device="cpu"))
        if spec.rope_local_inv_freq:
            self.register_buffer("rope_local_inv_freq", torch.tensor(spec.rope_local_inv_freq, dtype=torch.float32,
                                                                     device="cpu"))
        if self._mixed_windows:  # 1 where a layer attends through the sliding window, 0 where to every key
            sliding = [1.0 if i in spec.sliding_layers else 0.0 for i in range(spec.num_layers)]
            self.register_buffer("sliding_layer_flags", torch.tensor(sliding, dtype=torch.float32, device="cpu"))
        self.requires_grad_(False)

    @property
    def _mixed_windows(self) -> bool:
        """Some layers slide their window and others do not: each layer picks its masks in the loop."""
        return bool(self.spec.sliding_window) and 0 < len(self.spec.sliding_layers) < self.spec.num_layers

    def parameter_names(self) -> list[str]:
        """Names filled from the checkpoint (the RoPE buffer is derived from the config, quantization scales from
        the weights)."""
        return [name for name, _ in self.named_parameters() if not name.endswith(".scale")]

    def tiled_weights(self) -> dict[str, int]:
        """The parameters stored tiled (`Kernels.weight_tile_for`), with their tile: what `arrange_weights` tiles."""
        return {f"{name}.weight": module.tile for name, module in self.named_modules()
                if isinstance(module, Weights) and module.tile}

    def arrange_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain checkpoint weights (names as `parameter_names`) in this decoder's layout: tiled where it tiles."""
        tiled = self.tiled_weights()
        return {name: tile_weight(w, tiled[name]) if name in tiled else w for name, w in weights.items()}

    # forward's inputs, in order: every graph takes them so. seq_ids [B]: the cache rows a row-targeted graph (fewer
    # rows than the cache) serves; in a full-batch graph, rows of one static batch share an id (LongRoPE picks its
    # frequencies per batch, as Transformers does), slots have their own. (on-device sampling graphs take "sampling"
    # too: modeling/sampling.py)
    INPUT_NAMES = ("input_ids", "position_ids", "cache_start", "key_valid", "last_index", "kv_cache", "seq_ids",
                   "sampling")

    @staticmethod
    def example_inputs(batch_size: int, tokens: int, window: int, kv_cache: torch.Tensor,
                       logits_positions: int = 1, sampling: bool = False) -> tuple:
        """Inputs of the graph for `tokens` new tokens of `batch_size` sequences over a `window` of the cache
        (INPUT_NAMES); `logits_positions` > 1: last_index [B, positions], logits at each (a verification graph);
        `sampling`: the graph picks each row's next token too (on-device sampling)."""
        last_index = torch.zeros(batch_size, *((logits_positions,) if logits_positions > 1 else ()), dtype=torch.long)
        inputs = (
            torch.zeros(batch_size, tokens, dtype=torch.long),  # input_ids
            torch.zeros(batch_size, tokens, dtype=torch.long),  # position_ids
            torch.zeros(batch_size, dtype=torch.long),  # cache_start
            torch.ones(batch_size, window, dtype=torch.bool),  # key_valid
            last_index,
            kv_cache,
            torch.zeros(batch_size, dtype=torch.long),  # seq_ids
        )
        return (*inputs, torch.zeros(batch_size, len(SAMPLING_FIELDS))) if sampling else inputs

    @classmethod
    def graph_inputs(cls, graph, batch_size: int, kv_cache: torch.Tensor, on_device_sampling: bool) -> tuple:
        """`example_inputs` of the graph a configuration.GraphSpec describes, in an export of `batch_size` rows that
        samples on the device or not."""
        if graph.kind == "fused":  # one row of batch_size tokens and the chunk; the rest per row and for the chunk
            rows = batch_size + 1
            inputs = cls.example_inputs(rows, 1, graph.window, kv_cache, sampling=graph.samples(on_device_sampling))
            flat = torch.zeros(1, batch_size + graph.tokens, dtype=torch.long)
            return (flat, flat.clone(), *inputs[2:])
        return cls.example_inputs(graph.rows(batch_size), graph.tokens, graph.window, kv_cache,
                                  graph.logits_positions, graph.samples(on_device_sampling))

    def forward(self, input_ids, position_ids, cache_start, key_valid, last_index, kv_cache, seq_ids=None,
                sampling=None):
        rows, width = input_ids.shape
        if rows == 1 and cache_start.shape[0] > 1:
            # A fused graph: one new token for each of the cache's B rows (their write slots cache_start[:B]), then
            # a chunk of width - B tokens for the row seq_ids[B] from cache_start[B]. Their K and V are written in
            # that order: the chunk's write wins where the row's own token slot lies in it.
            B = cache_start.shape[0] - 1
            groups = [RowGroup(B, 1, position_ids[:, :B].reshape(B, 1), cache_start[:B], key_valid[:B], last_index[:B],
                            seq_ids[:B], targeted=False),
                      RowGroup(1, width - B, position_ids[:, B:], cache_start[B:], key_valid[B:], last_index[B:],
                            seq_ids[B:], targeted=True)]
        else:
            if cache_start.shape[0] != rows:  # one start for every row (eager callers)
                cache_start = cache_start.expand(rows)
            # Fewer rows than the cache holds: a row-targeted graph, its rows the cache rows `seq_ids` (read as a
            # copy, written in place); otherwise row b is cache row b and seq_ids is not read.
            targeted = rows != kv_cache.shape[2]
            if targeted and seq_ids is None:
                raise ValueError(f"{rows} rows for a cache of {kv_cache.shape[2]}: pass seq_ids, the cache rows they "
                                 f"are")
            groups = [RowGroup(rows, width, position_ids, cache_start, key_valid, last_index, seq_ids, targeted)]
        dtype = self.embed_tokens.weight.dtype
        h = residual(self.embed_tokens(input_ids), self.spec.embedding_multiplier)
        cos = sin = None
        if self.spec.positions == "learned":  # padding slots' positions may be anything: clamped into the table
            h = h + self.embed_positions(position_ids.clamp(0, self.spec.max_positions - 1))
        else:
            rotations = [self._rotations(group, dtype) for group in groups]
            cos, sin = rotations[0] if len(groups) == 1 else (joined_rows([r[0] for r in rotations]),
                                                              joined_rows([r[1] for r in rotations]))
        layout = cache_layout(self.spec, kv_cache)
        plans = [attention_plan(self.spec, self.kernels, group, kv_cache, layout, dtype) for group in groups]
        h, new_kv = self._layers(h, cos, sin, plans, layout)
        offset = 0
        for group in groups:  # in order: the chunk's write after the rows' own
            write_new_kv(self.spec, self.kernels, kv_cache, new_kv, group, layout, offset if len(groups) > 1 else None)
            offset += group.rows * group.tokens

        if len(groups) > 1:  # each row's token, then the chunk's last
            h = h[0, torch.cat((torch.arange(B, device=h.device), B + last_index[B:]))]
        else:
            index = torch.arange(rows, device=h.device)
            h = h[index[:, None] if last_index.dim() == 2 else index, last_index]  # [B, hidden], or [B, P, hidden]
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        logits = self.kernels.lm_head(h, weight, self.spec.tie_word_embeddings)
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_logit_softcapping
        logits = (torch.tanh(logits / cap) * cap if cap else logits).float()
        return logits if sampling is None else (logits, sample_tokens(logits, sampling))

    def _rotations(self, group: RowGroup, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin for `group`'s tokens, [B, T, 1, D] (per layer [L, B, T, 1, D] where layers differ)."""
        s, position_ids = self.spec, group.position_ids
        inv_freq = self.rope_inv_freq
        if s.rope_long_inv_freq:
            # One set per group of rows with equal seq_ids (a static batch: all of them, as Transformers picks it
            # for a batch; slots: each row alone), picked by the group's largest position.
            ids = group.seq_ids if group.seq_ids is not None else torch.zeros(group.rows, dtype=torch.long,
                                                                               device=position_ids.device)
            past = position_ids.max(dim=1).values + 1 > s.rope_long_after  # [B]
            long = ((ids[:, None] == ids[None, :]) & past[None, :]).any(dim=1)[:, None, None]  # [B, 1, 1]
            inv_freq = torch.where(long, self.rope_long_inv_freq, inv_freq)
        cos, sin = rotation(position_ids, inv_freq, s.rope_attention_scaling, dtype)
        if not (s.nope_layers or s.rope_local_layers):
            return cos, sin
        # per layer: NoPE layers the identity (cos 1, sin 0), local ones their own frequencies
        rotations = {"global": (cos, sin), "none": (torch.ones_like(cos), torch.zeros_like(sin))}
        if s.rope_local_layers:
            rotations["local"] = rotation(position_ids, self.rope_local_inv_freq, s.rope_local_attention_scaling,
                                           dtype)
        kinds = ["none" if i in s.nope_layers else "local" if i in s.rope_local_layers else "global"
                 for i in range(s.num_layers)]
        return (torch.stack([rotations[kind][0] for kind in kinds]),
                torch.stack([rotations[kind][1] for kind in kinds]))

    def _layers(self, h, cos, sin, plans: list[AttentionPlan], layout: CacheLayout):
        """Every layer over h: (h, the new K and V, stacked [L, ...] from the loop or a list per layer)."""
        s, L = self.spec, self.spec.num_layers
        mixed = self._mixed_windows
        per_layer = bool(s.nope_layers or s.rope_local_layers)

        def groups(layer_masks, caches):
            return [(plan.rows, plan.tokens, *masks, cache) for plan, masks, cache in zip(plans, layer_masks, caches)]

        stacked = isinstance(self.layers, DecoderLayer)
        caches = tuple(plan.cache_rows for plan in plans)
        if stacked and self.kernels.scans(s) and not layout.packed:
            # One loop over the stacked layers: the compiler traces, lowers and compiles one layer, not num_layers.
            layer = self.layers
            if per_layer or mixed:  # per-layer inputs ride along with the weights
                extra = {"cos": cos, "sin": sin} if per_layer else {}
                if mixed:
                    extra["sliding"] = self.sliding_layer_flags

                def body(h, xs):
                    weights, layer_caches, x = xs
                    masks = [plan.layer_masks(x.get("sliding"), mixed) for plan in plans]
                    return layer.step(weights, h, x.get("cos", cos), x.get("sin", sin), groups(masks, layer_caches))

                return scan(body, h, (layer.weights(), caches, extra))
            masks = [plan.sets[plan.kinds[0]] for plan in plans]  # every layer alike

            def body(h, xs):
                weights, layer_caches = xs
                return layer.step(weights, h, cos, sin, groups(masks, layer_caches))

            return scan(body, h, (layer.weights(), caches))
        # unrolled: one module per layer, or the stacked weights' slices (Kernels.scans False, packed caches)
        weights = self.layers.weights() if stacked else None
        new_kv = []
        for i in range(L):
            layer = self.layers if stacked else self.layers[i]
            layer_weights = {name: w[i] for name, w in weights.items()} if stacked else layer.weights()
            layer_cos, layer_sin = (cos[i], sin[i]) if per_layer else (cos, sin)
            row, first, n = layout.places[i]
            layer_caches = [cache[row, :, :, :, first:first + n] for cache in caches]
            h, layer_kv = layer.step(layer_weights, h, layer_cos, layer_sin,
                                     groups([plan.sets[plan.kinds[i]] for plan in plans], layer_caches))
            new_kv.append(layer_kv)
        return h, new_kv
