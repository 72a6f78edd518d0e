"""DeepSeek sparse attention (DSA) as transformers' GLM-5 computes it, built from megatron-core modules.

megatron-core 0.16.1 has multi-latent attention and a DSA indexer
(`transformer/experimental_attention_variant/dsa.py`), but no layer spec uses the indexer, and
its indexer differs from `GlmMoeDsaIndexer` (transformers 5.24) in ways that change which keys
a query attends to: it rotates q and k with a Hadamard transform that only runs in bf16 with
the `fast_hadamard_transform` CUDA package, rotates the last `qk_rope` dims of each head where
GLM rotates the first, normalises k with the model's eps where GLM uses 1e-6, is handed the q
latent before its norm where GLM hands the normalised one, and runs on every layer where
GLM-5.2's "shared" layers reuse the top-k of the nearest "full" layer below. So:

- `Indexer` is GLM's indexer (frozen: transformers never trains it, under `torch.no_grad`).
- `SparseAttention` is the core attention: the indexer's top-k (or, on a shared layer, the
  top-k its source layer left in the model chunk's holder) masks megatron-core's
  `unfused_dsa_fn`.
- `LatentMLA` is megatron-core's MLASelfAttention handing the indexer the normalised q latent;
  its latent norms (fused into the up-projections, as the Transformer Engine spec fuses them)
  use GLM's 1e-6 (miles.megatron.mla, shared with GLM-4.7-Flash).
- `attention_spec` puts them together; a model chunk (pipeline or virtual stage) that starts
  on a shared layer, whose source layer another chunk holds, is refused
  (miles.megatron.blocks.check_chunk_start).

The top-k is taken exactly as transformers takes it (same op order, a [batch, seq, seq] row per
query): `relu(q·k)` ties at zero are common, and `torch.topk` breaks ties by the whole row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from miles.families.facts import source_layers
from miles.megatron.blocks import DuplicatedLinear
from miles.megatron.mla import mla_attention_spec

# the indexer's k LayerNorm eps (GlmMoeDsaIndexer.k_norm)
INDEXER_NORM_EPS = 1e-6


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GlmMoeDsaRMSNorm's arithmetic, op for op (the indexer's top-k depends on the last bit)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class Indexer(MegatronModule):
    """GlmMoeDsaIndexer: scores every key for each query with a few small heads and keeps the
    top `dsa_indexer_topk`. Weights (their transformers names in brackets): linear_wq_b [wq_b],
    linear_wk [wk], k_norm [k_norm, a LayerNorm with bias], linear_weights_proj [weights_proj]."""

    def __init__(self, config, pg_collection):
        super().__init__(config=config)
        self.n_heads = config.dsa_indexer_n_heads
        self.head_dim = config.dsa_indexer_head_dim
        self.topk = config.dsa_indexer_topk
        self.tp_group = pg_collection.tp
        init = config.init_method
        self.rotary_pos_emb = RotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_percent=1.0,
            rotary_base=config.rotary_base,
            cp_group=pg_collection.cp,
        )
        self.linear_wq_b = DuplicatedLinear(
            config.q_lora_rank, self.n_heads * self.head_dim, config=config, init_method=init
        )
        self.linear_wk = DuplicatedLinear(config.hidden_size, self.head_dim, config=config, init_method=init)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS, dtype=config.params_dtype)
        self.linear_weights_proj = DuplicatedLinear(
            config.hidden_size, self.n_heads, config=config, init_method=init
        )
        self.requires_grad_(False)  # transformers computes it under no_grad: it never learns

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
        """Top-k key indices [batch, seq, k] of the hidden states x [seq, batch, hidden] and the
        normalised q latent [seq, batch, q_lora_rank] (this rank's part under sequence parallelism)."""
        if self.config.sequence_parallel and self.tp_group.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            q_latent = gather_from_sequence_parallel_region(q_latent, group=self.tp_group)
        seq, batch, _ = x.shape
        freqs = self.rotary_pos_emb(seq)  # [seq, 1, 1, rope]
        # rope on the first qk_rope dims of each head, pairs interleaved (MLA's convention), as GLM does
        q = self.linear_wq_b(q_latent)[0].view(seq, batch, self.n_heads, self.head_dim)
        q = apply_rotary_pos_emb(q, freqs, config=self.config).transpose(0, 1)  # [b, s, heads, d]
        k = self.k_norm(self.linear_wk(x)[0]).unsqueeze(2)
        k = apply_rotary_pos_emb(k, freqs, config=self.config).squeeze(2).transpose(0, 1)  # [b, s, d]
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim**-0.5
        scores = F.relu(scores)  # [b, s, heads, s]
        x = x.transpose(0, 1)
        weights = F.linear(x.float(), self.linear_weights_proj.weight.float()) * self.n_heads**-0.5
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [b, s, s]
        future = torch.ones(seq, seq, dtype=torch.bool, device=index.device).triu(1)
        index = index.masked_fill(future, float("-inf"))
        return index.topk(min(self.topk, seq), dim=-1).indices


class SparseAttention(MegatronModule):
    """Core attention of one MLA layer over its DSA top-k: a full layer runs its indexer and leaves
    the top-k in `holder` (one per model chunk) under its layer number; a shared layer reads its
    source layer's. `kinds` are every layer's "full"/"shared" (MTP layers after the decoder's)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout=None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type=None,
        pg_collection=None,
        *,
        kinds: tuple[str, ...],
        holder: dict,
    ):
        super().__init__(config=config)
        if attention_dropout:
            raise ValueError(f"DSA sparse attention applies no dropout (got {attention_dropout})")
        self.layer_number = layer_number  # global, from 1
        if layer_number > len(kinds):
            raise ValueError(f"layer {layer_number} has no DSA kind: {len(kinds)} layers are described")
        self.source = source_layers(kinds)[layer_number - 1] + 1
        self.indexer = Indexer(config, pg_collection) if self.source == layer_number else None
        self.softmax_scale = softmax_scale
        self.holder = holder

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        x: torch.Tensor,
        qr: torch.Tensor,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("DSA sparse attention takes no attention bias and no packed sequences")
        if self.indexer is not None:
            topk = self.indexer(x.detach(), qr.detach())
            self.holder[self.layer_number] = topk
        else:
            topk = self.holder.get(self.source)
            if topk is None or topk.shape[:2] != (query.shape[1], query.shape[0]):
                raise RuntimeError(
                    f"layer {self.layer_number} reuses the DSA top-k of layer {self.source}, which this model "
                    "chunk has not computed for this input; a pipeline stage must start on a full layer"
                )
        return unfused_dsa_fn(query, key, value, topk, self.softmax_scale)


class LatentMLA(MLASelfAttention):
    """MLASelfAttention whose core attention gets the q latent after its norm, as GLM's indexer
    does (the Transformer Engine spec fuses the norm into linear_q_up_proj, so megatron-core
    would hand it the latent before the norm)."""

    def get_query_key_value_tensors(self, *args, **kwargs):
        query, key, value, q_latent, kv_latent = super().get_query_key_value_tensors(*args, **kwargs)
        norm = self.linear_q_up_proj
        return (
            query,
            key,
            value,
            hf_rms_norm(q_latent, norm.layer_norm_weight, norm.config.layernorm_epsilon),
            kv_latent,
        )


def attention_spec(provider, kinds: tuple[str, ...], holder: dict) -> ModuleSpec:
    """The self-attention spec of every layer: MLA with fused latent norms (the Transformer
    Engine spec's modules, from `provider`) and DSA sparse core attention."""
    return mla_attention_spec(
        provider, LatentMLA, ModuleSpec(module=SparseAttention, params={"kinds": kinds, "holder": holder})
    )
