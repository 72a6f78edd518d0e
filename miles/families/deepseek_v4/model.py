"""DeepSeek-V4's layers as transformers' DeepseekV4 (5.24) computes them, as megatron-style modules.

megatron-core 0.16.1 has none of DeepSeek-V4's own pieces: the hyper-connections (several
residual streams mixed by a Sinkhorn-normalised matrix), the hybrid attention (one shared K=V
head with partial interleaved rope on its last dims, a sliding window, compressed keys pooled
over windows of 4 or 128 tokens, a top-k indexer over the 4-token ones, per-head sinks, a
grouped low-rank output projection), sqrt-softplus routing with a selection-only expert bias,
and routing by a token-id table. This module builds them; the experts, the shared expert and
their clamped SwiGLU are megatron-core's own (`SequentialMLP` / `SharedExpertMLP` with
`activation_func_clamp_value`, whose unfused gated path clamps the gate from above and the up
projection on both sides, as `DeepseekV4Experts._apply_gate` does).

Every op keeps transformers' order and float32 casts (the indexer's top-k is discontinuous, so a
last-bit difference in its scores could pick another key). Parameters transformers keeps in
float32 (`_keep_in_fp32_modules_strict`: the hyper-connections, sinks, compressor position
biases, every norm) are float32 here whatever the model's dtype.

Tensor parallelism splits the attention heads: `wq_b` and the sinks by heads, `wo_a` by output
groups (TP must divide `o_groups`), `wo_b` by its input; the shared K=V head, the compressors and
the indexer are whole on every rank. Layouts follow megatron-core: hidden states [s, b, d], the
hyper-connection streams [s, b, n, d]; inside the attention, transformers' [b, s, ...] layout,
so that the indexer's scores are computed on tensors of the shapes transformers uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter

from miles.megatron.blocks import DuplicatedLinear
from miles.megatron.routing import replayed_picks

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
RENORM_EPS = 1e-20  # DeepseekV4TopKRouter / DeepseekV4HashRouter: weights / (sum + 1e-20)


# --- norms and rope --------------------------------------------------------------------------


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepseekV4UnweightedRMSNorm: x scaled in its own dtype by a float32 rsqrt."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(MegatronModule):
    """DeepseekV4RMSNorm: normalised in float32, times a float32 weight, cast back once."""

    def __init__(self, config, size: int, eps: float):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def inv_freq(theta: float, dim: int, rope: Mapping[str, Any] | None = None) -> torch.Tensor:
    """One inverse frequency per rotated pair (dim // 2 of them). With `rope` of type "yarn", the
    YaRN blend of interpolated (divided by `factor`) and original frequencies over the correction
    range of `beta_fast`/`beta_slow` rotations in `original_max_position_embeddings` positions
    (transformers' modeling_rope_utils._compute_yarn_parameters). DeepSeek-V4 fixes YaRN's
    attention factor at 1 (DeepseekV4Config.__post_init__), so cos/sin are never scaled."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    plain = 1.0 / (theta**exponents)
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind == "default":
        return plain
    if kind != "yarn":
        raise ValueError(f"DeepSeek-V4 compress rope: rope_type {kind!r} is not built (default or yarn)")
    if float(rope.get("attention_factor", 1.0)) != 1.0:
        raise ValueError(
            f"DeepSeek-V4 compress rope: attention_factor {rope['attention_factor']} scales cos/sin, which "
            "DeepSeek-V4 never does (transformers forces 1.0); remove it from rope_parameters"
        )
    factor = float(rope["factor"])
    original = float(rope["original_max_position_embeddings"])
    fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original frequency
    pos_freqs = theta**exponents
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def cos_sin(
    positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [*positions.shape, pairs] at integer positions, in `dtype` (DeepseekV4RotaryEmbedding)."""
    angles = positions[..., None].float() * freqs.to(device=positions.device, dtype=torch.float)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * pairs channels of x by interleaved pairs (channel 2i with 2i+1), in float32;
    `cos`/`sin` [..., pairs] broadcast against x[..., -rope:] (DeepSeek-V4's apply_rotary_pos_emb)."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    width = cos.shape[-1]
    nope, rope = x[..., :-width], x[..., -width:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (turned.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


# --- hyper-connections -------------------------------------------------------------------------


def _fp32_parameter(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


class HyperConnection(MegatronModule):
    """The mix around one sublayer (DeepseekV4HyperConnection). From the n streams X [s, b, n, d]
    it computes `pre` (collapses the streams into the sublayer's input), `post` (spreads the
    sublayer's output over the streams) and the doubly-stochastic `comb` (mixes the streams:
    stream k of the result takes sum_j comb[j, k] * X_j). Parameters `fn` [(2+n)n, n*d],
    `base` [(2+n)n], `scale` [3] (pre, post, comb), all float32 (a layer holds two: hc_attn and
    hc_ffn; the checkpoint names them hc_attn_fn, ...). Each token's mix is its own, so under sequence
    parallelism every rank mixes its slice and the gradients are summed over the TP group
    (`sequence_parallel` on the parameters)."""

    def __init__(self, config, hidden: int, streams: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__(config=config)
        self.n, self.iters, self.hc_eps, self.norm_eps = streams, iters, hc_eps, norm_eps
        width = (2 + streams) * streams
        self.fn = _fp32_parameter(width, streams * hidden)
        self.base = _fp32_parameter(width)
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
        for param in (self.fn, self.base, self.scale):
            param.sequence_parallel = config.sequence_parallel

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [s, b, n], comb [s, b, n, n], collapsed [s, b, d]) of streams [s, b, n, d]."""
        n = self.n
        flat = unweighted_rms(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(*comb_w.shape[:-1], n, n)
        comb = torch.softmax(comb * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)  # columns first, then rows and columns
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


def hc_merge(
    output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a sublayer: post_k * output + sum_j comb[j, k] * streams_j (comb transposed)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(MegatronModule):
    """The final collapse of the streams before the last norm (DeepseekV4HyperHead): a sigmoid
    weight per stream from `hc_head_fn` [n, n*d], `hc_head_base` [n], `hc_head_scale` [1]."""

    def __init__(self, config, hidden: int, streams: int, hc_eps: float, norm_eps: float):
        super().__init__(config=config)
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_head_fn = _fp32_parameter(streams, streams * hidden)
        self.hc_head_base = _fp32_parameter(streams)
        self.hc_head_scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
        for param in (self.hc_head_fn, self.hc_head_base, self.hc_head_scale):
            param.sequence_parallel = config.sequence_parallel

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_head_fn.float())
        pre = torch.sigmoid(mixes * self.hc_head_scale.float() + self.hc_head_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


# --- attention -----------------------------------------------------------------------------------


class Compressor(MegatronModule):
    """Pools every `ratio` tokens into one key (DeepseekV4HCACompressor; with `overlap`, the CSA
    compressor's two series, entry w pooling window w-1's first half-channels with window w's
    second). Weights: wkv, wgate [c*dim, d], ape [ratio, c*dim] (float32, added to the gate
    logits), norm [dim]; c = 2 with overlap. Without a cache only whole windows are pooled; entry w
    sits at position w * ratio for its rope."""

    def __init__(
        self, config, hidden: int, dim: int, ratio: int, overlap: bool, freqs: torch.Tensor, eps: float
    ):
        super().__init__(config=config)
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = (2 if overlap else 1) * dim
        self.wkv = DuplicatedLinear(hidden, width, config=config, init_method=config.init_method)
        self.wgate = DuplicatedLinear(hidden, width, config=config, init_method=config.init_method)
        self.ape = _fp32_parameter(ratio, width)
        self.norm = RMSNorm(config, dim, eps)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The compressed keys [b, T, dim] of hidden states x [b, s, d] (T = s // ratio)."""
        batch, seq, _ = x.shape
        kv, gate = self.wkv(x)[0], self.wgate(x)[0]
        windows, m = seq // self.ratio, self.ratio
        if windows == 0:
            return kv.new_zeros((batch, 0, self.dim))
        kv = kv[:, : windows * m].view(batch, windows, m, -1)
        gate = gate[:, : windows * m].view(batch, windows, m, -1) + self.ape
        if self.overlap:
            d = self.dim
            pooled_kv = kv.new_zeros((batch, windows, 2 * m, d))
            pooled_gate = gate.new_full((batch, windows, 2 * m, d), float("-inf"))
            pooled_kv[:, :, m:] = kv[..., d:]
            pooled_gate[:, :, m:] = gate[..., d:]
            if windows > 1:
                pooled_kv[:, 1:, :m] = kv[:, :-1, :, :d]
                pooled_gate[:, 1:, :m] = gate[:, :-1, :, :d]
            kv, gate = pooled_kv, pooled_gate
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        positions = (torch.arange(windows, device=x.device) * m).unsqueeze(0).expand(batch, -1)
        cos, sin = cos_sin(positions, self.freqs, pooled.dtype)
        return rope_tail(pooled.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1)).squeeze(1)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries each query [b, s] may see: entry w only once its window is whole."""
    return (positions + 1) // ratio


class Indexer(MegatronModule):
    """Picks the `index_topk` compressed keys of a CSA layer each query attends to
    (DeepseekV4Indexer): its own compressor at `index_head_dim`, queries from the q latent
    (linear_wq_b), `sum_h w_h * relu(q_h . k)` with head weights from the hidden states
    (linear_weights_proj). It returns indices, no values: transformers gives it no gradient, so
    it is frozen here (and the optimizer must not decay it)."""

    def __init__(
        self, config, hidden: int, q_lora: int, heads: int, dim: int, topk: int, ratio: int, freqs, eps
    ):
        super().__init__(config=config)
        self.heads, self.dim, self.topk, self.ratio = heads, dim, topk, ratio
        self.linear_wq_b = DuplicatedLinear(
            q_lora, heads * dim, config=config, init_method=config.init_method
        )
        self.linear_weights_proj = DuplicatedLinear(
            hidden, heads, config=config, init_method=config.init_method
        )
        self.compressor = Compressor(config, hidden, dim, ratio, True, freqs, eps)
        self.register_buffer("freqs", freqs, persistent=False)
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Top-k entry indices [b, s, k] (-1 where a query has fewer visible entries than k) for
        hidden states x [b, s, d], the normalised q latent [b, s, q_lora] and positions [b, s]."""
        batch, seq, _ = x.shape
        keys = self.compressor(x)
        cos, sin = cos_sin(positions, self.freqs, x.dtype)
        q = self.linear_wq_b(q_latent)[0].view(batch, seq, -1, self.dim).transpose(1, 2)
        q = rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1)).transpose(1, 2)  # [b, s, heads, dim]
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [b, s, heads, T]
        scores = F.relu(scores) * self.dim**-0.5
        weights = self.linear_weights_proj(x)[0].float() * self.heads**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, T]
        entries = keys.shape[1]
        k = min(self.topk, entries)
        if entries == 0:
            return scores.topk(k, dim=-1).indices
        visible = visible_entries(positions, self.ratio).unsqueeze(-1)
        future = torch.arange(entries, device=x.device).view(1, 1, -1) >= visible
        picks = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
        return torch.where(picks >= visible, torch.full_like(picks, -1), picks)


class Attention(MegatronModule):
    """One DeepSeek-V4 attention (DeepseekV4Attention) of kind `kind` (sliding_attention,
    compressed_sparse_attention, heavily_compressed_attention). Weights, by the checkpoint's
    names: wq_a [q_lora, d], q_norm, wq_b [H*D, q_lora] (TP: heads), wkv [D, d], kv_norm,
    wo_a [G*o_lora, H*D/G] (TP: groups), wo_b [d, G*o_lora] (TP: input), attn_sink [H] (TP:
    heads); a compressor on CSA and HCA layers and an indexer on CSA layers.

    Query t sees the keys t-W < j <= t (W = sliding_window), the compressed entries its position
    has closed (on CSA layers, only those its indexer picked) and a per-head sink that takes a
    share of the softmax and gives nothing. Keys are values: the output carries the keys' rope,
    which is turned back at the query's position before the grouped output projection."""

    def __init__(self, config, hf: Mapping[str, Any], kind: str):
        super().__init__(config=config)
        if kind not in (SLIDING, CSA, HCA):
            raise ValueError(f"DeepSeek-V4 attention kind {kind!r} is not one of {SLIDING}, {CSA}, {HCA}")
        self.kind = kind
        d, heads, dim = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["head_dim"])
        groups, o_lora, q_lora = int(hf["o_groups"]), int(hf["o_lora_rank"]), int(hf["q_lora_rank"])
        eps = float(hf["rms_norm_eps"])
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if heads % groups or groups % tp:
            raise ValueError(
                f"DeepSeek-V4 attention: o_groups {groups} must divide num_attention_heads {heads} and "
                f"be divisible by the tensor-parallel size {tp}; pick --tensor-model-parallel-size dividing {groups}"
            )
        self.heads, self.local_heads, self.dim = heads, heads // tp, dim
        self.groups, self.local_groups, self.o_lora = groups, groups // tp, o_lora
        self.window, self.eps = int(hf["sliding_window"]), eps
        rope = rope_tables(hf)
        self.register_buffer("freqs", rope["main" if kind == SLIDING else "compress"], persistent=False)
        init = config.init_method
        self.wq_a = DuplicatedLinear(d, q_lora, config=config, init_method=init)
        self.q_norm = RMSNorm(config, q_lora, eps)
        inner = _no_sequence_parallel(config)  # their inputs are whole sequences already
        self.wq_b = ColumnParallelLinear(
            q_lora, heads * dim, config=inner, init_method=init, bias=False, gather_output=False
        )
        self.wkv = DuplicatedLinear(d, dim, config=config, init_method=init)
        self.kv_norm = RMSNorm(config, dim, eps)
        self.wo_a = ColumnParallelLinear(
            heads * dim // groups,
            groups * o_lora,
            config=inner,
            init_method=init,
            bias=False,
            gather_output=False,
        )
        self.wo_b = RowParallelLinear(
            groups * o_lora, d, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip
        self.attn_sink = torch.nn.Parameter(torch.zeros(self.local_heads, dtype=torch.float32))
        self.attn_sink.tensor_model_parallel, self.attn_sink.partition_dim, self.attn_sink.partition_stride = (
            True, 0, 1,
        )  # fmt: skip
        self.compressor = self.indexer = None
        if kind != SLIDING:
            ratio = int(hf["compress_rates"][kind])
            self.ratio = ratio
            self.compressor = Compressor(config, d, dim, ratio, kind == CSA, rope["compress"], eps)
        if kind == CSA:
            self.indexer = Indexer(
                config, d, q_lora, int(hf["index_n_heads"]), int(hf["index_head_dim"]), int(hf["index_topk"]),
                self.ratio, rope["compress"], eps,
            )  # fmt: skip

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The attention output [s(/tp), b, d] of hidden states [s(/tp), b, d] (this rank's slice under
        sequence parallelism) at positions [b, s]."""
        group = parallel_state.get_tensor_model_parallel_group()
        if self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=group
            )
        x = hidden.transpose(0, 1)  # [b, s, d], transformers' layout
        batch, seq, _ = x.shape
        cos, sin = cos_sin(positions, self.freqs, x.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads: [b, 1, s, pairs]
        q_latent = self.q_norm(self.wq_a(x)[0])
        q = self.wq_b(q_latent)[0].view(batch, seq, -1, self.dim).transpose(1, 2)  # [b, heads, s, D]
        q = rope_tail(unweighted_rms(q, self.eps), cos, sin)
        kv = self.kv_norm(self.wkv(x)[0]).view(batch, seq, 1, self.dim).transpose(1, 2)
        kv = rope_tail(kv, cos, sin)  # [b, 1, s, D]
        j = torch.arange(seq, device=x.device)
        window = (j.view(1, -1) <= j.view(-1, 1)) & (j.view(1, -1) > j.view(-1, 1) - self.window)
        bias = torch.zeros(seq, seq, dtype=q.dtype, device=x.device).masked_fill(~window, float("-inf"))
        bias = bias.view(1, 1, seq, seq).expand(batch, 1, seq, seq)
        if self.compressor is not None:
            entries = self.compressor(x)  # [b, T, D]
            count = entries.shape[1]
            if count:
                kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
                bias = torch.cat([bias, self._entry_bias(x, q_latent, positions, count, q.dtype)], dim=-1)
        kv = copy_to_tensor_model_parallel_region(kv, group=group)  # each rank's heads give it a gradient
        logits = torch.matmul(q, kv.transpose(2, 3)) * self.dim**-0.5 + bias
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(batch, -1, seq, -1)
        logits = torch.cat([logits, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
        out = torch.matmul(probs, kv)  # [b, heads, s, D]
        # the keys' rope, carried by the values, turned back at the query's position: [b, s, heads, D]
        out = rope_tail(out, cos, -sin).transpose(1, 2)
        out = self._grouped_down(out.reshape(batch, seq, self.local_groups, -1))
        out, _ = self.wo_b(out.flatten(2).transpose(0, 1).contiguous())
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """As megatron-core's default, with the sinks split over the tensor-parallel ranks by head."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(
            make_sharded_tensors_for_checkpoint(
                {"attn_sink": self.attn_sink}, prefix, {"attn_sink": 0}, sharded_offsets
            )
        )
        return out

    def _entry_bias(self, x, q_latent, positions, count: int, dtype) -> torch.Tensor:
        """0 / -inf [b, 1, s, T] over the compressed entries: closed windows, and on CSA layers the indexer's picks."""
        visible = visible_entries(positions, self.ratio).unsqueeze(-1)  # [b, s, 1]
        if self.indexer is None:
            closed = torch.arange(count, device=x.device).view(1, 1, -1) < visible
            bias = torch.zeros(closed.shape, dtype=dtype, device=x.device)
            return bias.masked_fill(~closed, float("-inf")).unsqueeze(1)
        picks = self.indexer(x.detach(), q_latent.detach(), positions)
        safe = torch.where(picks >= 0, picks, torch.full_like(picks, count))
        bias = torch.full((*picks.shape[:2], count + 1), float("-inf"), dtype=dtype, device=x.device)
        return bias.scatter_(-1, safe, 0.0)[..., :count].unsqueeze(1)

    def _grouped_down(self, grouped: torch.Tensor) -> torch.Tensor:
        """wo_a per group: [b, s, groups, H*D/G] -> [b, s, groups, o_lora] (DeepseekV4GroupedLinear)."""
        shape, width = grouped.shape[:-2], grouped.shape[-1]
        weight = self.wo_a.weight.view(self.local_groups, -1, width).transpose(1, 2)
        flat = grouped.reshape(-1, self.local_groups, width).transpose(0, 1)
        return torch.bmm(flat, weight).transpose(0, 1).reshape(*shape, self.local_groups, -1)


def _no_sequence_parallel(config):
    import copy

    inner = copy.copy(config)
    inner.sequence_parallel = False
    return inner


def rope_tables(hf: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse frequencies of the two rope tables: "main" (sliding layers, rope_theta, never
    scaled) and "compress" (CSA/HCA layers and their compressors and indexer: compress_rope_theta,
    with YaRN where rope_parameters say so), over the last qk_rope_head_dim channels."""
    dim = int(hf["head_dim"])
    params = hf.get("rope_parameters") or {}
    nested = isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping)
    main = params["main"] if nested else {"rope_theta": hf.get("rope_theta", 10000.0)}
    compress = (
        params["compress"] if nested else {**params, "rope_theta": hf.get("compress_rope_theta", 160000.0)}
    )
    factor = compress.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rope = int(hf["qk_rope_head_dim"]) if factor is None else int(dim * float(factor))
    return {
        "main": inv_freq(float(main["rope_theta"]), rope),
        "compress": inv_freq(float(compress["rope_theta"]), rope, compress),
    }


# --- routing -------------------------------------------------------------------------------------


def _renormalised(
    scores: torch.Tensor, picks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) [tokens, experts] of the picked experts' scores, renormalised even at top-1."""
    weights = scores.gather(1, picks)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS) * scale
    probs = torch.zeros_like(scores).scatter(1, picks, weights)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, picks, True)
    return probs, routing_map


class SqrtSoftplusRouter(TopKRouter):
    """DeepseekV4TopKRouter: scores sqrt(softplus(logits)); the top-k of scores + expert_bias picks
    the experts (the bias only selects: the weights are the picked scores, renormalised, times
    moe_router_topk_scaling_factor). `expert_bias` [E] is a float32 buffer nothing updates, as in
    transformers (megatron-core's own expert bias is sigmoid-only and updated by token counts)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.expert_bias is not None:
            raise ValueError(
                "DeepSeek-V4 keeps its expert bias fixed (transformers never updates it): "
                "drop --moe-router-enable-expert-bias"
            )
        del self.expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(F.softplus(logits.view(-1, self.config.num_moe_experts)))

    replays_routing = True  # `routing` takes a replay hook's experts (miles.megatron.routing.install)

    def routing(self, logits: torch.Tensor, padding_mask=None):
        scores = self._scores(logits)
        choice = scores + self.expert_bias
        picks = torch.topk(choice, self.topk, dim=-1, sorted=False).indices
        picks = replayed_picks(self, choice, picks)  # the rollout's experts under routing replay
        return _renormalised(scores, picks, self.config.moe_router_topk_scaling_factor or 1.0)


class HashRouter(SqrtSoftplusRouter):
    """DeepseekV4HashRouter: the experts of a token are the row of `tid2eid` [vocab, k] (int64) at
    its token id; the weights are their sqrt-softplus scores, renormalised and scaled. The layer
    sets `token_ids` ([s, b], as the hidden states) before each forward. A row naming an expert
    twice cannot be routed (the routing map holds each expert once; transformers would count it
    twice) and is refused. Routing replay has nothing to replay here: the engine's experts of a
    hash layer are the same table's (and it records none for them)."""

    def __init__(self, config, pg_collection=None, vocab_size: int = 0):
        super().__init__(config=config, pg_collection=pg_collection)
        del self.expert_bias
        self.expert_bias = None
        self.register_buffer("tid2eid", torch.zeros(vocab_size, config.moe_router_topk, dtype=torch.long))
        self.token_ids: torch.Tensor | None = None

    def routing(self, logits: torch.Tensor, padding_mask=None):
        if self.token_ids is None:
            raise RuntimeError("hash routing needs the token ids: set router.token_ids before the forward")
        scores = self._scores(logits)
        picks = self.tid2eid[self.token_ids.reshape(-1)].long()
        sorted_picks = picks.sort(dim=-1).values
        if bool((sorted_picks[:, 1:] == sorted_picks[:, :-1]).any()):
            raise ValueError(
                "hash routing: a tid2eid row names the same expert twice; a routing map cannot send a "
                "token to one expert twice (fix the table: every row needs distinct experts)"
            )
        return _renormalised(scores, picks, self.config.moe_router_topk_scaling_factor or 1.0)


# --- layer and model -----------------------------------------------------------------------------


def moe_spec(tc, hf: Mapping[str, Any], mlp_kind: str):
    """megatron-core's MoE layer spec (local experts and shared expert) with DeepSeek-V4's router."""
    import functools

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    if mlp_kind not in (HASH_MOE, MOE):
        raise ValueError(f"DeepSeek-V4 MLP kind {mlp_kind!r} is not one of {HASH_MOE}, {MOE}")
    spec = get_moe_module_spec(use_te=False, num_experts=tc.num_moe_experts)
    spec.submodules.router = (
        SqrtSoftplusRouter
        if mlp_kind == MOE
        else functools.partial(HashRouter, vocab_size=int(hf["vocab_size"]))
    )
    return spec


class Layer(MegatronModule):
    """One DeepSeek-V4 decoder layer (DeepseekV4DecoderLayer) on the hyper-connection streams
    [s, b, n, d]: hc_attn mixes them around input_layernorm and self_attention, hc_ffn around
    pre_mlp_layernorm and the MoE mlp."""

    def __init__(self, tc, hf: Mapping[str, Any], layer_number: int, kind: str, mlp_kind: str):
        from megatron.core.transformer.spec_utils import build_module

        super().__init__(config=tc)
        self.layer_number = layer_number  # global, from 1
        d, n, eps = int(hf["hidden_size"]), int(hf["hc_mult"]), float(hf["rms_norm_eps"])
        hc = (d, n, int(hf["hc_sinkhorn_iters"]), float(hf["hc_eps"]), eps)
        self.hc_attn = HyperConnection(tc, *hc)
        self.input_layernorm = RMSNorm(tc, d, eps)
        self.self_attention = Attention(tc, hf, kind)
        self.hc_ffn = HyperConnection(tc, *hc)
        self.pre_mlp_layernorm = RMSNorm(tc, d, eps)
        for norm in (self.input_layernorm, self.pre_mlp_layernorm):
            norm.weight.sequence_parallel = tc.sequence_parallel
        self.hashed = mlp_kind == HASH_MOE
        self.mlp = build_module(moe_spec(tc, hf, mlp_kind), config=tc, layer_number=layer_number)
        self.mlp.set_layer_number(layer_number)  # its router's decoder layer, as TransformerLayer sets it

    def forward(
        self, streams: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
    ) -> torch.Tensor:
        """The streams after the layer; token_ids [s(/tp), b] are laid out as the streams' tokens."""
        post, comb, collapsed = self.hc_attn(streams)
        out = self.self_attention(self.input_layernorm(collapsed), positions)
        streams = hc_merge(out, streams, post, comb)
        post, comb, collapsed = self.hc_ffn(streams)
        if self.hashed:
            self.mlp.router.token_ids = token_ids
        out, _ = self.mlp(self.pre_mlp_layernorm(collapsed))
        return hc_merge(out, streams, post, comb)


class Block(MegatronModule):
    """This pipeline stage's decoder layers (keys decoder.layers.{global index}); on the last stage
    also the streams' collapse (hc_head) and the final norm (final_layernorm). Between stages the
    streams travel as [s, b * n, d] (megatron's p2p carries [s, b, d] tensors)."""

    def __init__(self, tc, hf: Mapping[str, Any], post_process: bool, vp_stage: int | None = None):
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        super().__init__(config=tc)
        offset = get_transformer_layer_offset(tc, vp_stage=vp_stage)
        count = get_num_layers_to_build(tc, vp_stage=vp_stage)
        kinds, mlp_kinds = list(hf["layer_types"]), list(hf["mlp_layer_types"])
        self.layers = torch.nn.ModuleList(
            Layer(tc, hf, offset + i + 1, kinds[offset + i], mlp_kinds[offset + i]) for i in range(count)
        )
        self.streams = int(hf["hc_mult"])
        self.post_process = post_process
        self.input_tensor = None
        if post_process:
            d, eps = int(hf["hidden_size"]), float(hf["rms_norm_eps"])
            self.hc_head = HyperHead(tc, d, self.streams, float(hf["hc_eps"]), eps)
            self.final_layernorm = RMSNorm(tc, d, eps)
            self.final_layernorm.weight.sequence_parallel = tc.sequence_parallel

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Every layer under its global number (decoder.layers.{i}), whichever stage holds it."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import sharded_state_dict_default

        out = {}
        for local, layer in enumerate(self.layers):
            here, there = f"{prefix}layers.{local}.", f"{prefix}layers.{layer.layer_number - 1}."
            part = layer.sharded_state_dict(prefix=here, sharded_offsets=(), metadata=metadata)
            replace_prefix_for_sharding(part, here, there)
            out.update(part)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        return out

    def forward(
        self,
        hidden: torch.Tensor | None,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        keep_streams: bool = False,
    ):
        """The last stage's normed output [s(/tp), b, d] (with `keep_streams`, and the streams
        [s(/tp), b, n, d] before their collapse, which the MTP layers read); an earlier stage's
        streams as [s, b * n, d]."""
        if hidden is not None:  # the first stage: n copies of the embedding
            streams = hidden.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        else:
            s, bn, d = self.input_tensor.shape
            streams = self.input_tensor.view(s, bn // self.streams, self.streams, d)
        for layer in self.layers:
            streams = layer(streams, positions, token_ids)
        if not self.post_process:
            return streams.flatten(1, 2)
        out = self.final_layernorm(self.hc_head(streams))
        return (out, streams) if keep_streams else out


class MTPLayer(MegatronModule):
    """One multi-token-prediction layer of the checkpoint (mtp.{k}.*). Its decoder layer is built as
    the published model's MTP layer is (sliding-window attention, top-k routing). Weights: enorm,
    hnorm, e_proj, h_proj [d, d], hc_head, final_layernorm [norm], transformer_layer. Frozen unless
    the trainer trains it (`Model.train_mtp`).

    The forward is SGLang 0.5.23's DeepseekV4ModelNextN.forward (python/sglang/srt/models/
    deepseek_v4_nextn.py): the streams it reads (the policy's last streams before their collapse,
    or the previous MTP layer's) each go through hnorm and h_proj, the next token's embedding
    through enorm and e_proj is added to every stream, and the decoder layer runs on the sum; its
    output streams collapse through the layer's own hc_head, then the final norm, before the
    policy's output layer."""

    def __init__(self, tc, hf: Mapping[str, Any], layer_number: int, kind: str, mlp_kind: str):
        super().__init__(config=tc)
        d, n, eps = int(hf["hidden_size"]), int(hf["hc_mult"]), float(hf["rms_norm_eps"])
        self.enorm, self.hnorm = RMSNorm(tc, d, eps), RMSNorm(tc, d, eps)
        self.e_proj = DuplicatedLinear(d, d, config=tc, init_method=tc.init_method)
        self.h_proj = DuplicatedLinear(d, d, config=tc, init_method=tc.init_method)
        self.hc_head = HyperHead(tc, d, n, float(hf["hc_eps"]), eps)
        self.final_layernorm = RMSNorm(tc, d, eps)
        # under sequence parallelism each rank sees its slice of the tokens: these gradients are
        # partial sums, which megatron adds over the tensor-parallel ranks (as the decoder's norms')
        for module in (self.enorm, self.hnorm, self.e_proj, self.h_proj, self.final_layernorm):
            module.weight.sequence_parallel = tc.sequence_parallel
        self.transformer_layer = Layer(tc, hf, layer_number, kind, mlp_kind)
        self.requires_grad_(False)

    def forward(self, streams: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer's output streams [s(/tp), b, n, d] from the streams it reads [s(/tp), b, n, d]
        and the embedding [s(/tp), b, d] of the token after each position."""
        e = self.e_proj(self.enorm(embedded))[0]
        h = self.h_proj(self.hnorm(streams))[0]
        return self.transformer_layer(e.unsqueeze(2) + h, positions, None)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What the output layer reads from the layer's streams: hc_head, then the final norm."""
        return self.final_layernorm(self.hc_head(streams))


class MTPBlock(MegatronModule):
    """The carried MTP layers (keys mtp.layers.{k}.*), on the last pipeline stage."""

    def __init__(self, tc, hf: Mapping[str, Any], kinds: Mapping[str, str]):
        super().__init__(config=tc)
        count, first = int(hf.get("num_nextn_predict_layers") or 0), int(hf["num_hidden_layers"])
        self.layers = torch.nn.ModuleList(
            MTPLayer(tc, hf, first + k + 1, kinds["layer_types"], kinds["mlp_layer_types"])
            for k in range(count)
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each layer's own (its sinks and experts split as a decoder layer's are)."""
        out = {}
        for k, layer in enumerate(self.layers):
            out.update(layer.sharded_state_dict(f"{prefix}layers.{k}.", sharded_offsets, metadata))
        return out


def _sequence_slice(tokens: torch.Tensor, config) -> torch.Tensor:
    """Token ids [b, s] laid out as this rank's hidden states: [s, b], its sequence slice under SP."""
    ids = tokens.transpose(0, 1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if config.sequence_parallel and tp > 1:
        rows = ids.shape[0] // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        ids = ids[rank * rows : (rank + 1) * rows]
    return ids.contiguous()


class Model(LanguageModule):
    """DeepSeek-V4 (DeepseekV4ForCausalLM) of one pipeline stage: embedding (first stage), Block,
    output_layer (last stage, untied). forward(input_ids, position_ids, attention_mask) returns
    logits [b, s, vocab/tp] as GPTModel does; the mask must be None (the model builds its own)."""

    def __init__(self, tc, hf: Mapping[str, Any], vocab_size: int, pre_process: bool, post_process: bool,
                 vp_stage: int | None = None, mtp_kinds: Mapping[str, str] | None = None):  # fmt: skip
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

        super().__init__(config=tc)
        if hf.get("tie_word_embeddings"):
            raise ValueError(
                "DeepSeek-V4 with tie_word_embeddings: the published model unties them; not built"
            )
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder  # what megatron's schedules ask of a model
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.vocab_size = vocab_size
        self.share_embeddings_and_output_weights = False
        self.parallel_output = True
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=tc, vocab_size=vocab_size, max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
                position_embedding_type="none",
            )  # fmt: skip
        self.decoder = Block(tc, hf, post_process, vp_stage)
        self.trains_mtp = False
        if post_process:
            self.output_layer = ColumnParallelLinear(
                tc.hidden_size,
                vocab_size,
                config=tc,
                init_method=tc.init_method,
                bias=False,
                gather_output=False,
            )
            if int(hf.get("num_nextn_predict_layers") or 0):
                if mtp_kinds is None:
                    raise ValueError(
                        "DeepSeek-V4 with MTP layers: say which kind of layer they are (mtp_kinds)"
                    )
                self.mtp = MTPBlock(tc, hf, mtp_kinds)

    def set_input_tensor(self, tensor) -> None:
        if isinstance(tensor, list | tuple):
            tensor = tensor[0]
        self.decoder.set_input_tensor(tensor)

    def train_mtp(self) -> None:
        """Train the carried MTP layers: a training forward then returns (logits, [each MTP layer's
        logits [b, s, vocab/tp]]), layer k at position i predicting token i + 2 + k. The policy's
        streams, the embedding and the output layer's weight enter them detached, so their loss
        reaches the MTP parameters alone (as miles.megatron.mtp trains megatron-core's block)."""
        from miles.megatron.mtp import MtpRefused

        if not self.post_process:
            return
        if not hasattr(self, "mtp"):
            raise MtpRefused("this DeepSeek-V4 model chunk carries no MTP layers (num_nextn_predict_layers)")
        if not self.pre_process:
            raise MtpRefused(
                "DeepSeek-V4's MTP layers read the word embedding, which only the first pipeline stage holds; "
                "train them with --pipeline-model-parallel-size 1"
            )
        self.mtp.requires_grad_(True)
        self.trains_mtp = True

    def forward(self, input_ids, position_ids, attention_mask=None, **kwargs):
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if attention_mask is not None or unknown:
            raise ValueError(
                f"DeepSeek-V4's model builds its own masks and takes no {unknown or ['attention_mask']}: "
                "pass input_ids and position_ids only"
            )
        mtp = self.post_process and self.trains_mtp and self.training
        hidden = self.embedding(input_ids=input_ids, position_ids=None) if self.pre_process else None
        out = self.decoder(hidden, position_ids, _sequence_slice(input_ids, self.config), keep_streams=mtp)
        if not self.post_process:
            return out
        out, streams = out if mtp else (out, None)
        logits, _ = self.output_layer(out)
        logits = logits.transpose(0, 1).contiguous()
        return (logits, self.mtp_logits(streams, input_ids, position_ids)) if mtp else logits

    def mtp_logits(self, streams: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor) -> list:
        """Each MTP layer's logits [b, s, vocab/tp] from the policy's last streams (before their
        collapse): layer k reads the previous one's streams and the embedding of token i + 1 + k
        (id 0 past the end, as megatron-core's MTP block rolls them)."""
        streams, out = streams.detach(), []
        weight = self.output_layer.weight.detach()
        for k, layer in enumerate(self.mtp.layers):
            pad = input_ids.new_zeros(input_ids.shape[0], k + 1)
            following = torch.cat([input_ids[:, k + 1 :], pad], dim=1)
            embedded = self.embedding(input_ids=following, position_ids=None).detach()
            streams = layer(streams, embedded, position_ids)
            logits, _ = self.output_layer(layer.head_input(streams), weight=weight)
            out.append(logits.transpose(0, 1).contiguous())
        return out


def build_model(
    tc,
    hf: Mapping[str, Any],
    vocab_size: int,
    vp_stage: int | None = None,
    mtp_kinds: Mapping[str, str] | None = None,
) -> Model:
    """This rank's DeepSeek-V4 model chunk (pipeline stage, virtual stage), in tc.params_dtype with the
    parameters transformers keeps in float32 kept so; `mtp_kinds` the attention and MLP kind of the
    carried MTP layers (config.json's layer lists cover the decoder layers only)."""
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = Model(tc, hf, vocab_size, first, last, vp_stage, mtp_kinds)
    kept = {
        id(p)
        for m in model.modules()
        if isinstance(m, RMSNorm | HyperConnection | HyperHead)
        for p in m.parameters()
    }
    kept |= {id(m.attn_sink) for m in model.modules() if isinstance(m, Attention)}
    kept |= {id(m.ape) for m in model.modules() if isinstance(m, Compressor)}
    for param in model.parameters():
        if id(param) not in kept:
            param.data = param.data.to(tc.params_dtype)
    return model
