"""Inkling's layers as transformers' InklingForCausalLM computes them, megatron-style.

megatron-core 0.16.1 has the pieces around them (the fused-norm column-parallel projection,
row-parallel output projection, qk norms, the SwiGLU MLP, the MoE layer's dispatcher and
experts), but none of Inkling's own operations, so these modules add them, each tensor- and
expert-parallel aware and with its own sharded state dict:

- `ShortConv`: the residual causal depthwise convolution (fp32, kernel `conv_kernel_size`) on
  the keys and values (channels split over TP with the kv heads) and on the attention and MLP
  outputs (replicated; under sequence parallelism each rank fetches the rows before its slice).
- `InklingAttention`: one fused projection holding q, k, v and the relative-bias states r per
  query group (a contiguous TP split hands each rank whole groups), k/v convolutions before the
  k norm, per-head q/k RMS norms, a hidden-state-conditioned relative bias (`rel_proj`, shared
  by the layer's heads), scores scaled by 1/head_dim, on global layers the log scaling of q and
  the bias by position, a sliding window of `sliding_window_size` keys on sliding layers, an
  fp32 softmax; then the output projection and the attention short convolution.
- `InklingDenseMLP`: megatron's MLP times a learned global scale, then the MLP convolution.
- `InklingRouter` / `InklingSharedExperts` / `InklingMoELayer`: the router scores routed and
  shared experts with one gate; the expert bias only selects the top k; the weights are the
  softmax of log-sigmoid logits over the k chosen and all shared experts ("shared-expert
  sink"), times `route_scale` and a learned global scale; each shared expert is an MLP of the
  routed width scaled per token before its down projection.
- `InklingEmbedding` (the embedding's RMS norm) and `FinalNorm` (the final norm, then the
  division by `logits_mup_width_multiplier`).

No position embedding: position reaches the model only through the relative bias and the
convolutions, computed from row-local positions (hence no context parallelism). The attention
is materialised ([batch, heads, seq, seq] in fp32), which the CPU runs and trains; on a GPU it
is correct but memory-heavy at long sequences (untested on GPU).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from miles.megatron.routing import replayed_picks

SLIDING = "hybrid_sliding"


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _tp_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def attention_dims(hf: Mapping[str, Any], i: int) -> dict:
    """Layer i's attention geometry in the HF config: sliding layers have their own heads."""
    sliding = hf["layer_types"][i] == SLIDING
    pre = "swa_" if sliding else ""
    return {
        "sliding": sliding,
        "heads": int(hf[f"{pre}num_attention_heads"]),
        "groups": int(hf[f"{pre}num_key_value_heads"]),
        "dim": int(hf[f"{pre}head_dim"]),
        "d_rel": int(hf["d_rel"]),
        "extent": int(hf["sliding_window_size"] if sliding else hf["rel_extent"]),
        "window": int(hf["sliding_window_size"]) if sliding else None,
    }


class ShortConv(MegatronModule):
    """transformers' InklingShortConvolution: x + causal depthwise conv(x) in fp32, zero left
    padding, the current token weighted by the kernel's last tap. Input [seq, batch, channels].

    `split`: the channels are this rank's share of a tensor-parallel projection (the weight is
    split over TP along dim 0). Otherwise the weight is whole on every rank; under sequence
    parallelism the input is this rank's sequence slice, so the whole sequence is gathered
    (its backward reduce-scatters) for the rows before the slice, and the weight's gradient,
    partial per rank, is marked for megatron's TP all-reduce (`sequence_parallel`)."""

    def __init__(self, config, channels: int, kernel: int, *, split: bool):
        super().__init__(config=config)
        tp = _tp_size() if split else 1
        self.split = split
        self.kernel = kernel
        self.weight = torch.nn.Parameter(torch.zeros(channels // tp, 1, kernel, dtype=torch.float32))
        if split:
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        else:
            self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = not self.split and self.config.sequence_parallel and _tp_size() > 1
        local = x.shape[0]
        if gathered:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=_tp_group())
        x32 = x.float()
        y = F.conv1d(
            F.pad(x32.permute(1, 2, 0), (self.kernel - 1, 0)), self.weight.float(), groups=x.shape[-1]
        )
        out = x32 + y.permute(2, 0, 1)
        if gathered:
            rank = torch.distributed.get_rank(_tp_group())
            out = out[rank * local : (rank + 1) * local]
        return out.to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = {"weight": self.weight}
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"weight": 0} if self.split else {}, sharded_offsets
        )


class RelativeBias(MegatronModule):
    """transformers' InklingRelativeLogits' bank of bias-vs-distance profiles, [d_rel, extent],
    shared by every head of the layer: each rank's heads give a partial gradient, which the
    copy into the TP region all-reduces."""

    def __init__(self, config, d_rel: int, extent: int):
        super().__init__(config=config)
        self.extent = extent
        self.weight = torch.nn.Parameter(torch.zeros(d_rel, extent, dtype=config.params_dtype))

    def forward(self, r: torch.Tensor, seq: int) -> torch.Tensor:
        """Bias [batch, heads, seq, seq] of the states r [seq, batch, heads, d_rel]."""
        proj = (
            copy_to_tensor_model_parallel_region(self.weight, group=_tp_group())
            if _tp_size() > 1
            else self.weight
        )
        logits = torch.einsum("sbhr,re->bhse", r, proj)
        pos = torch.arange(seq, device=r.device)
        distance = pos[:, None] - pos[None, :]
        index = distance.clamp(0, self.extent - 1).expand(*logits.shape[:2], seq, seq)
        bias = logits.gather(-1, index)
        return bias.masked_fill((distance < 0) | (distance >= self.extent), 0.0)


class InklingAttention(MegatronModule):
    """Inkling's self-attention of layer `layer_number` (see the module docstring). `hf` is the
    HF text config, whose per-layer types and head counts the module reads."""

    def __init__(
        self,
        config,
        submodules,
        layer_number: int,
        attn_mask_type=None,
        cp_comm_type=None,
        pg_collection=None,
        *,
        hf: Mapping[str, Any],
    ):
        super().__init__(config=config)
        self.layer_number = layer_number
        dims = attention_dims(hf, layer_number - 1)
        tp = _tp_size()
        self.sliding, self.window, self.dim = dims["sliding"], dims["window"], dims["dim"]
        heads, groups, d_rel = dims["heads"], dims["groups"], dims["d_rel"]
        if heads % groups or groups % tp:
            raise ValueError(
                f"layer {layer_number - 1}: {groups} key/value heads of {heads} do not split over tensor "
                f"parallel size {tp} (each rank holds whole query groups)"
            )
        self.groups, self.rep, self.d_rel = groups // tp, heads // groups, d_rel
        self.n_floor = hf.get("log_scaling_n_floor") if not self.sliding else None
        self.alpha = float(hf.get("log_scaling_alpha", 0.1))
        hidden, kernel = config.hidden_size, int(hf.get("conv_kernel_size", 4))
        rows = groups * (self.rep * self.dim + 2 * self.dim + self.rep * d_rel)
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            hidden,
            rows,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
        )
        self.k_sconv = ShortConv(config, groups * self.dim, kernel, split=True)
        self.v_sconv = ShortConv(config, groups * self.dim, kernel, split=True)
        self.q_layernorm = build_module(
            submodules.q_layernorm, hidden_size=self.dim, config=config, eps=config.layernorm_epsilon
        )
        self.k_layernorm = build_module(
            submodules.k_layernorm, hidden_size=self.dim, config=config, eps=config.layernorm_epsilon
        )
        self.rel_proj = RelativeBias(config, d_rel, dims["extent"])
        self.linear_proj = build_module(
            submodules.linear_proj,
            heads * self.dim,
            hidden,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
        )
        self.attn_sconv = ShortConv(config, hidden, kernel, split=False)

    def forward(
        self, hidden_states, attention_mask=None, packed_seq_params=None, inference_context=None, **_
    ):
        if packed_seq_params is not None or inference_context is not None:
            raise ValueError("Inkling's attention takes neither packed sequences nor an inference context")
        mixed, _ = self.linear_qkv(hidden_states)  # the whole sequence (the linear gathers an SP slice)
        seq, batch, _ = mixed.shape
        q_rows, d, rep = self.rep * self.dim, self.dim, self.rep
        mixed = mixed.view(seq, batch, self.groups, q_rows + 2 * d + rep * self.d_rel)
        q, k, v, r = torch.split(mixed, [q_rows, d, d, rep * self.d_rel], dim=-1)
        heads = self.groups * rep
        k = self.k_sconv(k.reshape(seq, batch, self.groups * d))
        v = self.v_sconv(v.reshape(seq, batch, self.groups * d))
        q = self.q_layernorm(q.reshape(seq, batch, heads, d))
        k = self.k_layernorm(k.view(seq, batch, self.groups, d))
        bias = self.rel_proj(r.reshape(seq, batch, heads, self.d_rel), seq)  # [b, h, s, s]
        q = q.permute(1, 2, 0, 3)  # [b, h, s, d]
        k = k.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        v = v.view(seq, batch, self.groups, d).permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        if self.n_floor is not None:
            positions = torch.arange(1, seq + 1, device=q.device, dtype=torch.float32)
            tau = 1.0 + self.alpha * torch.log((positions / self.n_floor).clamp(min=1.0))
            tau = tau.view(1, 1, -1, 1)
            q = (q.float() * tau).to(q.dtype)
            bias = (bias.float() * tau).to(bias.dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / d) + bias
        pos = torch.arange(seq, device=q.device)
        distance = pos[:, None] - pos[None, :]
        masked = distance < 0
        if self.window is not None:
            masked = masked | (distance >= self.window)
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(seq, batch, heads * d)
        out, _ = self.linear_proj(out)
        return self.attn_sconv(out), None


class InklingDenseMLP(MLP):
    """megatron's SwiGLU MLP (its norm fused into linear_fc1), times transformers' InklingMLP's
    learned `global_scale`, then the layer's MLP short convolution."""

    def __init__(self, config, submodules, *, hf: Mapping[str, Any], **kwargs):
        super().__init__(config, submodules, **kwargs)
        self.global_scale = torch.nn.Parameter(torch.ones(1, dtype=config.params_dtype))
        self.global_scale.sequence_parallel = config.sequence_parallel
        self.mlp_sconv = ShortConv(
            config, config.hidden_size, int(hf.get("conv_kernel_size", 4)), split=False
        )

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        out, bias = super().forward(hidden_states, per_token_scale, **kwargs)
        return self.mlp_sconv(out * self.global_scale), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(
            make_sharded_tensors_for_checkpoint(
                {"global_scale": self.global_scale}, prefix, {}, sharded_offsets
            )
        )
        return out


class InklingRouter(TopKRouter):
    """transformers' InklingTopkRouter: one fp32 gate scores the routed experts, then the shared
    ones (`weight` [routed + shared, hidden]); sigmoid scores plus the expert bias pick the top k
    (the bias weights nothing); the k chosen and the shared experts share one softmax over
    their log-sigmoid logits, scaled by `route_scale` and the learned `global_scale`. Returns
    megatron's (probs, routing_map) for the routed experts; the shared experts' weights of
    the same tokens are `shared_weights()`."""

    replays_routing = True  # `routing` takes a replay hook's experts (miles.megatron.routing.install)

    def __init__(self, config, pg_collection=None, *, hf: Mapping[str, Any]):
        loss = {
            "--moe-aux-loss-coeff": config.moe_aux_loss_coeff,
            "--moe-z-loss-coeff": config.moe_z_loss_coeff,
            "--moe-input-jitter-eps": config.moe_input_jitter_eps,
        }
        for flag, value in loss.items():
            if value and (not isinstance(value, list | tuple) or any(value)):
                raise ValueError(
                    f"{flag} {value}: Inkling's router (transformers' InklingTopkRouter) has no load-balancing "
                    "loss, z-loss or jitter, and miles' does not add one; pass 0 or leave the flag out"
                )
        super().__init__(config=config, pg_collection=pg_collection)
        self.n_shared = int(hf["n_shared_experts"])
        self.route_scale = float(hf.get("route_scale", 8.0))
        self.weight = torch.nn.Parameter(
            torch.empty(config.num_moe_experts + self.n_shared, config.hidden_size, dtype=torch.float32)
        )
        self.reset_parameters()
        self.global_scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.global_scale.sequence_parallel = config.sequence_parallel
        self._shared = None

    def routing(self, logits: torch.Tensor, padding_mask=None):
        routed_count = self.config.num_moe_experts
        logits = logits.reshape(-1, routed_count + self.n_shared).float()
        routed, shared = logits[:, :routed_count], logits[:, routed_count:]
        with torch.no_grad():
            choice = routed.sigmoid() + self.expert_bias.float()
            index = torch.topk(choice, self.topk, dim=-1, sorted=False).indices
        index = replayed_picks(self, choice, index)  # the rollout's experts under routing replay
        chosen = F.logsigmoid(torch.cat([routed.gather(-1, index), shared], dim=-1))
        weights = torch.exp(chosen - torch.logsumexp(chosen, dim=-1, keepdim=True))
        weights = weights * self.route_scale * self.global_scale.float()
        self._shared = weights[:, self.topk :]
        probs = torch.zeros_like(routed).scatter(-1, index, weights[:, : self.topk])
        routing_map = torch.zeros_like(routed, dtype=torch.bool).scatter(-1, index, True)
        return probs, routing_map

    def shared_weights(self) -> torch.Tensor:
        """[tokens, shared experts] weights of the last routed tokens (handed over once)."""
        out, self._shared = self._shared, None
        if out is None:
            raise RuntimeError("the shared-expert weights are read once per routing")
        return out


class InklingSharedExperts(MegatronModule):
    """transformers' InklingSharedExperts: `n_shared_experts` SwiGLU MLPs of the routed width, each
    scaled per token (its router weight) before its down projection, summed in fp32."""

    def __init__(self, config, provider, *, count: int, width: int):
        super().__init__(config=config)
        sub = MLPSubmodules(
            linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear()
        )
        config = copy.copy(config)  # megatron's MLP sizes linear_fc2 by the config (as SharedExpertMLP does)
        config.ffn_hidden_size = width
        self.experts = torch.nn.ModuleList(MLP(config, sub, ffn_hidden_size=width) for _ in range(count))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        seq, batch = x.shape[:2]
        weights = weights.view(seq, batch, -1)
        if self.config.sequence_parallel and _tp_size() > 1:  # the MLPs run on the whole sequence
            weights = gather_from_sequence_parallel_region(
                weights, tensor_parallel_output_grad=True, group=_tp_group()
            )
        total = None
        for j, mlp in enumerate(self.experts):
            out, _ = mlp(x, per_token_scale=weights[..., j].to(x.dtype))
            total = out.float() if total is None else total + out.float()
        return total.to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = {}
        for j, mlp in enumerate(self.experts):
            out.update(mlp.sharded_state_dict(f"{prefix}experts.{j}.", sharded_offsets, metadata))
        return out


class InklingMoELayer(MoELayer):
    """megatron's MoE layer (router, dispatcher, routed experts) with Inkling's router, its shared
    experts weighted by the router, and the MLP short convolution after both."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *, hf, provider):
        super().__init__(config, submodules, layer_number, pg_collection)
        self.shared_experts = InklingSharedExperts(
            config, provider, count=int(hf["n_shared_experts"]), width=int(hf["moe_intermediate_size"])
        )
        self.mlp_sconv = ShortConv(
            config, config.hidden_size, int(hf.get("conv_kernel_size", 4)), split=False
        )

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("training an MoE layer with tensor parallelism needs --sequence-parallel")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        probs, routing_map = self.route(hidden_states, padding_mask)
        shared = self.router.shared_weights()
        tokens, probs = self.preprocess(hidden_states, probs, routing_map)
        tokens, probs = self.dispatch(tokens, probs)
        out, _ = self.routed_experts_compute(tokens, probs)
        out = self.postprocess(self.combine(out), None)
        out = out + self.shared_experts(hidden_states, shared)
        return self.mlp_sconv(out), None


class InklingEmbedding(LanguageModelEmbedding):
    """The word embedding, then transformers' InklingNormedEmbedding's RMS norm (`embed_norm`)."""

    def forward(self, input_ids, position_ids, tokentype_ids=None):
        return self.embed_norm(super().forward(input_ids, position_ids, tokentype_ids))


class RMSNorm(torch.nn.Module):
    """transformers' InklingRMSNorm: w * (x32 * rsqrt(mean(x32²) + eps)).to(dtype); the weight is
    marked for megatron's TP all-reduce under sequence parallelism (each rank norms its slice)."""

    def __init__(self, config, hidden_size: int, eps: float, divide_by: float = 1.0):
        super().__init__()
        self.eps = eps
        self.divide_by = divide_by
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out / self.divide_by if self.divide_by != 1.0 else out


class FinalNorm(RMSNorm):
    """The final norm, then transformers' division by `logits_mup_width_multiplier` (before the head)."""

    def __init__(self, config, hidden_size: int, eps: float, *, mup: float):
        super().__init__(config, hidden_size, eps, divide_by=mup)


def add_embedding_norm(model, eps: float) -> None:
    """The embedding of a first-stage chunk becomes InklingEmbedding with its norm."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return
    embedding.__class__ = InklingEmbedding
    embedding.embed_norm = RMSNorm(embedding.config, embedding.config.hidden_size, eps)


def keep_fp32(model) -> None:
    """The short convolutions and the router's global scale stay fp32 in a bf16 model, as
    transformers keeps them (InklingPreTrainedModel._keep_in_fp32_modules_strict; the expert bias,
    also listed there, is megatron's fp32 buffer); the gate weight keeps the model's dtype and is
    computed with in fp32 (moe_router_dtype), as transformers computes it."""
    for module in model.modules():
        if isinstance(module, ShortConv):
            module.weight.data = module.weight.data.float()
        elif isinstance(module, InklingRouter):
            module.global_scale.data = module.global_scale.data.float()


def block_spec(tc, hf: Mapping[str, Any], vp_stage=None, *, impl: str = "local"):
    """This chunk's decoder block spec: the Transformer Engine GPT spec's layers (their MLP or
    MoE layer, its experts) with Inkling's attention, dense MLP, MoE layer and final norm."""
    from dataclasses import replace

    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.identity_op import IdentityOp

    from miles.megatron.spec import decoder_block_spec, layer_provider

    block = decoder_block_spec(tc, impl=impl, vp_stage=vp_stage)
    provider = layer_provider(impl)
    hf = dict(hf)
    attention = ModuleSpec(
        module=InklingAttention,
        params={"hf": hf},
        submodules=SelfAttentionSubmodules(
            linear_qkv=provider.column_parallel_layer_norm_linear(),
            core_attention=IdentityOp,
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=provider.layer_norm(rms_norm=True, for_qk=True),
            k_layernorm=provider.layer_norm(rms_norm=True, for_qk=True),
        ),
    )
    layers = []
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        if mlp.module is MoELayer:
            mlp = replace(
                mlp,
                module=InklingMoELayer,
                params={**mlp.params, "hf": hf, "provider": provider},
                submodules=replace(mlp.submodules, router=_router_builder(hf)),
            )
        else:
            mlp = replace(mlp, module=InklingDenseMLP, params={**mlp.params, "hf": hf})
        layers.append(replace(spec, submodules=replace(spec.submodules, self_attention=attention, mlp=mlp)))
    # InklingTextConfig's default multiplier is 24
    final = ModuleSpec(module=FinalNorm, params={"mup": float(hf.get("logits_mup_width_multiplier", 24.0))})
    return replace(block, layer_specs=layers, layer_norm=final)


def _router_builder(hf):
    def build(*, config, pg_collection=None):
        return InklingRouter(config, pg_collection, hf=hf)

    return build
