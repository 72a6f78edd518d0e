"""Speculative decoding for the built-in rollout engine: a checkpoint's MTP layer drafts, the
policy verifies, and exact rejection sampling keeps the samples those of the policy alone.

A step drafts k tokens with the MTP layer (DeepSeek-V3's formula, chained: the draft of position
i + 1 is `lm_head(norm(layer(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))))`, the next step's h
the layer's normed output; MiMo's projection takes the two the other way round and its embedding is
zeroed at position 0; DeepSeek-V4's reads the policy's last hyper-connection streams, each through
h_proj(hnorm), plus e_proj(enorm(embed)), and chains on its own output streams), then runs one
forward of the policy over the k drafts and accepts them left to right with probability
min(1, p/q); the first rejected one is replaced by a draw from normalise(max(0, p - q)), and
when all k pass a (k+1)-th token is drawn from p. The tokens
that come out are distributed exactly as plain sampling from p (temperature, top-k, top-p
applied to both p and q), and their logprobs are read from the policy's own logits.

Rows of a batch advance together by m + 1 tokens, m the fewest drafts any row accepted (the KV
caches stay rectangular): each row emits the first m + 1 tokens the algorithm gives it (its
(m+1)-th draft where it accepted that one, else its residual or bonus draw). Every such token,
given those before it, is drawn from p, so cutting a row's tokens there keeps them exact.
The policy's cache then drops the rejected positions: attention layers crop them; a layer with a
recurrent state (linear attention: Qwen3.5's gated delta nets) cannot, so the verifying forward
steps such layers one token at a time and keeps the state after each, and a rejection takes the
one after the last kept token (`RecordedStates`); a layer that compresses what it is fed
(DeepSeek-V4's CSA and HCA) keeps what the forward gave its compressors and is cut back to the
kept tokens' prefix of it (`RecordedCompressors`). Where this transformers cannot record such
layers, the cache goes back to before the verifying forward and the kept tokens are fed again.
Sliding-window layers keep
every key while a step is verified, so that crop can take rejected ones back once the window is
full (`open_windows`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# --sglang-speculative-algorithm values that draft with the checkpoint's MTP layers (SGLang's
# names: NEXTN is its alias of EAGLE for MTP drafters)
MTP_ALGORITHMS = ("EAGLE", "NEXTN")


class SpeculationRefused(ValueError):
    """A speculative-decoding flag the built-in engine cannot act on; the message says why."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the built-in engine speculates: `steps` drafts per verifying forward."""

    steps: int

    @classmethod
    def from_flags(
        cls, algorithm: str | None, steps: int | None, topk: int | None, draft_tokens: int | None
    ) -> SpeculativeConfig | None:
        """The seed's SGLang flags as the built-in engine reads them (None: no speculation)."""
        if algorithm is None:
            for flag, value in (
                ("--sglang-speculative-num-steps", steps),
                ("--sglang-speculative-eagle-topk", topk),
                ("--sglang-speculative-num-draft-tokens", draft_tokens),
            ):
                if value is not None:
                    raise SpeculationRefused(f"{flag} {value} without --sglang-speculative-algorithm")
            return None
        if algorithm.upper() not in MTP_ALGORITHMS:
            raise SpeculationRefused(
                f"--sglang-speculative-algorithm {algorithm}: the built-in rollout engine drafts with the "
                f"checkpoint's MTP layers only ({' or '.join(MTP_ALGORITHMS)})"
            )
        steps = 1 if steps is None else steps
        if steps < 1:
            raise SpeculationRefused(f"--sglang-speculative-num-steps {steps}: must be >= 1")
        if topk not in (None, 1):
            raise SpeculationRefused(
                f"--sglang-speculative-eagle-topk {topk}: the built-in engine drafts one chain (a tree of "
                "drafts is SGLang's); use 1"
            )
        if draft_tokens not in (None, steps + 1):
            raise SpeculationRefused(
                f"--sglang-speculative-num-draft-tokens {draft_tokens}: a chain of {steps} drafts verifies "
                f"{steps + 1} tokens (the drafts and the one after); use {steps + 1}"
            )
        return cls(steps=steps)


def accept_drafts(target, draft, drafts, generator):
    """Exact rejection sampling of one speculative step, for each row.

    `target` [B, k+1, V]: the distributions plain sampling draws from at the k drafted positions
    and the one after; `draft` [B, k, V]: the drafter's, which drew `drafts` [B, k]. Returns
    (accepted [B]: how many drafts pass, the token after them [B]: the residual draw at the first
    rejected position, or a draw from the target after k accepted ones).
    """
    import torch

    rows, k = drafts.shape
    p = target[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q = draft.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = torch.rand((rows, k), generator=generator, device=drafts.device, dtype=p.dtype)
    passed = u * q < p  # probability min(1, p / q); q > 0 where the draft was drawn
    accepted = passed.long().cumprod(dim=-1).sum(dim=-1)
    index = torch.arange(rows, device=drafts.device)
    # past the k-th draft the "draft distribution" is zero: the residual is the target itself
    padded = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)
    residual = (target[index, accepted] - padded[index, accepted]).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q at a rejected position has probability zero; rounding can still leave no mass
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target[index, accepted])
    return accepted, torch.multinomial(residual, 1, generator=generator).squeeze(1)


# --- the MTP drafter on the Hugging Face side -----------------------------------------------------


# Where each MTP style keeps MTP layer k: the decoder layer's prefix, and the block's own tensors
# (drafter module <- checkpoint name). "layers" (DeepSeek-V3, GLM): model.layers.{L+k}.* with its
# enorm, hnorm, eh_proj and shared_head.norm; "mtp_layers" (Qwen3.5): mtp.layers.{k}.* beside one
# mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm} for the block; "mimo" (MiMo):
# model.mtp_layers.{k}.* holding its token_layernorm, hidden_layernorm, input_proj (which takes
# [hidden; token], the other order) and final_layernorm beside the decoder layer's tensors;
# "mtp" (DeepSeek-V4): mtp.{k}.* holding the decoder layer (DeepSeek's published names) and its
# enorm, hnorm, e_proj, h_proj, norm and hc_head_{fn,base,scale}, read on the policy's last
# hyper-connection streams (`MtpDrafter.reads_streams`). Each style's block tensors beside the
# decoder layer: drafter module -> checkpoint name, under the layer's prefix (Qwen3.5's under mtp.).
_BLOCK_TENSORS = {
    "layers": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_norm": "shared_head.norm"},
    "mtp": {"enorm": "enorm", "hnorm": "hnorm", "e_proj": "e_proj", "h_proj": "h_proj", "final_norm": "norm"},
    "mtp_layers": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                   "final_norm": "norm"},
    "mimo": {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
             "final_norm": "final_layernorm"},
}  # fmt: skip
DRAFTER_STYLES = tuple(_BLOCK_TENSORS)
# the styles whose projection takes [hidden state; embedding]
HIDDEN_FIRST = ("mimo",)


def mtp_layer_names(config: Mapping[str, Any], style: str, k: int) -> tuple[str, dict[str, str]]:
    """(the checkpoint prefix of MTP layer k's decoder layer, {drafter parameter: checkpoint name} of
    the tensors its block holds beside it)."""
    from miles.ckpt.families import mtp_layer_prefix, text_config

    if style not in _BLOCK_TENSORS:
        raise ValueError(f"MTP style {style!r}: the drafter knows {DRAFTER_STYLES}")
    prefix = mtp_layer_prefix(style, int(text_config(config)["num_hidden_layers"]), k)
    under = "mtp." if style == "mtp_layers" else prefix
    names = {f"{module}.weight": f"{under}{name}.weight" for module, name in _BLOCK_TENSORS[style].items()}
    if style == "mtp":  # DeepSeek-V4's block collapses its streams with its own hc_head
        names |= {f"hc_head.hc_{part}": f"{prefix}hc_head_{part}" for part in ("fn", "base", "scale")}
    return prefix, names


class MtpDrafter:
    """The checkpoint's MTP layers around the policy's embedding and head, on the policy's device.

    Each MTP layer is the family's transformers decoder layer, built as the layer at index L + k
    of the model one MTP layer deeper (so its per-layer kinds are the published model's), with its
    projection and norms; it keeps its own KV cache of the positions it has seen.
    """

    def __init__(self, model, path: str):
        import json
        from pathlib import Path

        import torch

        from miles import families
        from miles.ckpt.families import LAYER_LIST_KEYS, mtp_layers, mtp_prefixes
        from miles.families.facts import source_layers

        self.model = model
        config = json.loads((Path(path) / "config.json").read_text())
        family = families.family_of(config)
        style = family.mtp_style if family else None
        count = mtp_layers(config)
        if not count or style not in DRAFTER_STYLES:
            why = (
                "its config.json declares no MTP layers (num_nextn_predict_layers)"
                if not count
                else f"its family {family.name if family else config.get('model_type')} keeps none, and the "
                "built-in engine drafts with GLM's model.layers.{L+k}.*, Qwen3.5's mtp.*, MiMo's "
                "model.mtp_layers.* and DeepSeek-V4's mtp.{k}.*"
            )
            raise SpeculationRefused(f"{path}: the built-in engine cannot draft with this checkpoint: {why}")
        text = model.config.get_text_config()
        layers = int(text.num_hidden_layers)
        deeper = {k: v for k, v in text.to_dict().items() if k not in LAYER_LIST_KEYS}
        for key, kind in family.mtp_layer_kinds.items():
            deeper[key] = list(getattr(text, key)) + [kind] * count
        deeper["num_hidden_layers"] = layers + count
        from transformers import AutoConfig

        self.config = AutoConfig.for_model(**deeper)
        # the policy's attention and experts implementations
        self.config._attn_implementation = text._attn_implementation
        if hasattr(text, "_experts_implementation"):
            self.config._experts_implementation = text._experts_implementation
        # DSA layers that share a top-k (GLM-5.2's cross-layer sharing): each shared MTP layer takes
        # the top-k of the policy's layer `trunk_source`, which the engine hands `step`
        kinds = list(getattr(self.config, "indexer_types", None) or [])
        shares = [bool(kinds) and kinds[layers + k] == "shared" for k in range(count)]
        sources = source_layers(kinds) if any(shares) else ()
        shared = {sources[layers + k] for k in range(count) if shares[k]}
        if any(source >= layers for source in shared):
            raise SpeculationRefused(
                f"{path}: MTP layer kinds {kinds[layers:]}: an MTP layer shares the top-k of another MTP "
                "layer; the built-in engine drafts with MTP layers that index for themselves or share the "
                "policy's top-k"
            )
        if len(shared) > 1:
            raise SpeculationRefused(
                f"{path}: MTP layer kinds {kinds[layers:]} share the top-k of policy layers {sorted(shared)}; "
                "the engine hands the drafter one policy layer's"
            )
        self.shares = shares
        self.trunk_source = min(shared) if shared else None
        names = [mtp_layer_names(config, style, k) for k in range(count)]
        self.prefixes = [prefix for prefix, _ in names]
        self.own_names = [own for _, own in names]
        self.hidden_first = style in HIDDEN_FIRST
        self.masks_first_position = family.mtp_masks_first_position
        # DeepSeek-V4's MTP layer reads the policy's last streams (before their collapse), as SGLang's
        # DeepseekV4ModelNextN does, and its own layer's streams when chained
        self.reads_streams = style == "mtp"
        kinds = list(getattr(self.config, "layer_types", None) or [])
        self.sliding = [bool(kinds) and "sliding" in kinds[layers + k] for k in range(count)]
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        layer_cls = type(model.model.layers[0])
        norm = model.model.norm
        self.layers = torch.nn.ModuleList()
        for k in range(count):
            block = torch.nn.Module()
            block.layer = layer_cls(self.config, layers + k)
            for module in block.layer.modules():  # its place in the drafter's own cache
                if isinstance(getattr(module, "layer_idx", None), int):
                    module.layer_idx = k
            for name in ("enorm", "hnorm", "final_norm"):
                setattr(block, name, _copy_module(norm))
            if self.reads_streams:
                block.e_proj = torch.nn.Linear(text.hidden_size, text.hidden_size, bias=False)
                block.h_proj = torch.nn.Linear(text.hidden_size, text.hidden_size, bias=False)
                block.hc_head = type(model.model.hc_head)(self.config)
            else:
                block.eh_proj = torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False)
            self.layers.append(block)
        self.layers.to(device=device, dtype=dtype)
        _policys_dtypes(self.layers, model)
        self.rotary = model.model.rotary_emb
        self.load(_read_mtp_tensors(path, mtp_prefixes(config, style), style))

    # names: those of the checkpoint (model.layers.{L+k}.* or mtp.*, experts one tensor each) as
    # transformers' class loads them (experts fused) -> this drafter's modules
    def named_tensors(self) -> dict[str, Any]:
        """Every tensor of the drafter under the name the trainer hands it over by (the transformers
        class's names of the decoder layer under the checkpoint's prefix, and the checkpoint's names
        of the MTP block's own tensors)."""
        out = {}
        for prefix, own, block in zip(self.prefixes, self.own_names, self.layers, strict=True):
            for name, tensor in block.layer.state_dict(keep_vars=True).items():
                out[prefix + name] = tensor
            for param, name in own.items():
                out[name] = block.get_parameter(param)
        return out

    def load(self, tensors: Mapping[str, Any]) -> None:
        import torch

        mine = self.named_tensors()
        missing = sorted(set(mine) - set(tensors))
        if missing:
            raise SpeculationRefused(f"the checkpoint's MTP layers lack {missing[:4]}")
        with torch.no_grad():
            for name, target in mine.items():
                target.copy_(tensors[name].to(device=target.device, dtype=target.dtype))

    def new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        # the cache layers of the MTP layers' kinds, at the indices their modules now carry
        cache.layers = cache.layers[len(cache.layers) - len(self.layers) :]
        return cache

    def step(self, hidden, tokens, positions, attention, cache, depth: int = 0, topk=None):
        """One MTP layer over `tokens` [B, n] (each the token after the position whose normed
        hidden state is `hidden` [B, n, d]): (logits [B, n, V], the layer's normed output).

        `topk` [B, n, w]: for an MTP layer that shares the policy's DSA top-k (`shares`), the key
        columns each query attends to (the policy's layer `trunk_source` at the same columns, see
        `extend_topk` for columns it has not seen); columns past the keys this layer holds are
        causally masked where the policy chose them, and stand for the query's own column here."""
        import torch

        block = self.layers[depth]
        if self.reads_streams:
            return self._stream_step(block, hidden, tokens, positions, attention, cache, depth)
        embed = self.model.get_input_embeddings()(tokens)
        if self.masks_first_position:  # the family's MTP layer reads no embedding at position 0
            embed = embed.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        parts = [block.enorm(embed), block.hnorm(hidden)]
        x = block.eh_proj(torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1))
        mask = _causal_mask(self.config, x, attention, cache, positions, sliding=self.sliding[depth])
        extra = {}
        if self.shares[depth]:
            if topk is None:
                raise ValueError(
                    f"MTP layer {depth} shares the DSA top-k of policy layer {self.trunk_source}: pass its "
                    "top-k for these positions (topk=)"
                )
            n = tokens.shape[1]
            keys = cache.get_seq_length(depth) + n
            own = torch.arange(keys - n, keys, device=topk.device).view(1, n, 1)
            extra["prev_topk_indices"] = torch.where(topk < keys, topk.long(), own)
        out = block.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
            use_cache=True,
            **{_cache_keyword(block.layer): cache},
            **extra,
        )
        out = out[0] if isinstance(out, tuple) else out
        normed = block.final_norm(out)
        return self.model.get_output_embeddings()(normed).float(), normed

    def _stream_step(self, block, streams, tokens, positions, attention, cache, depth: int):
        """DeepSeek-V4's MTP layer as SGLang 0.5.23's DeepseekV4ModelNextN.forward runs it: each of
        `streams` [B, n, hc, d] through hnorm and h_proj, plus e_proj(enorm(the next token's
        embedding)), the decoder layer, its hc_head collapse and final norm, the policy's head:
        (logits [B, n, V], the layer's output streams)."""
        embed = self.model.get_input_embeddings()(tokens)
        x = block.e_proj(block.enorm(embed)).unsqueeze(2) + block.h_proj(block.hnorm(streams))
        mask = _causal_mask(self.config, embed, attention, cache, positions, sliding=self.sliding[depth])
        rope = {
            kind: self.rotary(embed, position_ids=positions, layer_type=kind) for kind in ("main", "compress")
        }
        out = block.layer(
            x,
            position_embeddings=rope,
            position_ids=positions,
            attention_mask=mask,
            input_ids=tokens,
            use_cache=True,
            **{_cache_keyword(block.layer): cache},
        )
        normed = block.final_norm(block.hc_head(out))
        return self.model.get_output_embeddings()(normed).float(), out


def _policys_dtypes(blocks, model) -> None:
    """Each drafter tensor in the dtype the policy keeps its counterpart in (transformers keeps some
    modules in float32 under a bf16 policy: DeepSeek-V4's hyper-connections and norms, GLM's
    router bias): the decoder layer's as the policy's last layer's, the norms and hc_head as its own."""
    import torch

    last = dict(model.model.layers[-1].named_parameters())
    last.update(model.model.layers[-1].named_buffers())
    with torch.no_grad():
        for block in blocks:
            for name, tensor in [*block.layer.named_parameters(), *block.layer.named_buffers()]:
                if name in last and tensor.dtype != last[name].dtype and tensor.is_floating_point():
                    tensor.data = tensor.data.to(last[name].dtype)
            own = {"enorm": model.model.norm, "hnorm": model.model.norm, "final_norm": model.model.norm}
            own["hc_head"] = getattr(model.model, "hc_head", None)
            for name, theirs in own.items():
                if theirs is not None and hasattr(block, name):
                    block.get_submodule(name).to(next(theirs.parameters()).dtype)


def extend_topk(row, column: int):
    """The top-k row [B, 1, w] of the last column the policy indexed, grown by `column` (a drafted
    position after it, which the policy has not indexed): [B, 1, w + 1]. While the policy's top-k
    still keeps every earlier key (sequences up to `index_topk`), this is what the policy would
    pick there; past that it keeps the policy's last choice and the drafted keys. Either way the
    draft is sampled from what the drafter computed, so acceptance keeps the samples exact."""
    import torch

    return torch.cat([row, torch.full_like(row[..., :1], column)], dim=-1)


def _copy_module(module):
    return copy.deepcopy(module)


def _cache_keyword(layer) -> str:
    import inspect

    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _causal_mask(config, x, attention, cache, positions, sliding: bool = False):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    params = _mask_params()
    extra = {"cache" if "cache" in params else "past_key_values": cache}
    if "allow_is_causal_skip" in params and not sliding:  # some layers (the DSA indexer) read the mask itself
        extra["allow_is_causal_skip"] = False
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make(config=config, inputs_embeds=x, attention_mask=attention, position_ids=positions, **extra)


def _mask_params():
    import inspect

    from transformers.masking_utils import create_causal_mask

    return inspect.signature(create_causal_mask).parameters


def _read_mtp_tensors(path: str, prefixes: list[str], style: str) -> dict[str, Any]:
    """The MTP layers' tensors of the checkpoint in `path`, named as transformers' class holds
    layer L + k (its experts fused, `as_model_names`); a shape the class does not hold fails the
    copy in `MtpDrafter.load`."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from miles.ckpt.shards import INDEX_NAME

    index = Path(path) / INDEX_NAME
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    raw = {}
    for file in files:
        with safe_open(str(Path(path) / file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(tuple(prefixes)):
                    raw[name] = f.get_tensor(name)
    return as_model_names(raw, style)


def as_model_names(raw: dict, style: str | None = None) -> dict:
    """Per-expert checkpoint tensors of an MTP layer stacked as transformers 5 fuses a layer's
    experts (mlp.experts.gate_up_proj [E, 2I, d] = [gate; up], down_proj [E, d, I]); DeepSeek-V4's
    ("mtp" style) decoder-layer tensors first renamed from DeepSeek's published names to the
    transformers class's (miles.families.deepseek_v4.layer_model_name)."""
    import re

    import torch

    if style == "mtp":
        from miles.families.deepseek_v4 import layer_model_name

        raw = {_renamed_in_layer(name, layer_model_name): tensor for name, tensor in raw.items()}
    out, experts = {}, {}
    pattern = re.compile(
        r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$"
    )
    for name, tensor in raw.items():
        m = pattern.match(name)
        if m:
            experts.setdefault(m["pre"], {}).setdefault(int(m["e"]), {})[m["w"]] = tensor
        else:
            out[name] = tensor
    for pre, by_expert in experts.items():
        ids = sorted(by_expert)
        out[pre + ".gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids]
        )
        out[pre + ".down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def _renamed_in_layer(name: str, rename) -> str:
    """mtp.{k}.{tail} with the decoder layer's `tail` renamed (the block's own tensors kept)."""
    head, k, tail = name.split(".", 2)
    return f"{head}.{k}.{rename(tail)}"


def crop_cache(cache, remove: int) -> None:
    """Drop the last `remove` positions of `cache`, or of one attention layer of it (transformers
    5.24 takes the count to remove, negative; earlier 5.x the length to keep)."""
    import inspect

    if remove <= 0:
        return
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-remove)
    else:
        cache.crop(cache.get_seq_length() - remove)


def recurrent_layers(cache) -> list[int]:
    """Indices of the cache layers that hold a recurrent state (linear attention's conv and
    recurrent states: Qwen3.5's gated delta nets), which `crop` cannot take back: the state after
    a rejected draft has that draft folded in."""
    return [
        i
        for i, layer in enumerate(cache.layers)
        if hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")
    ]


def compressing_layers(cache) -> list[int]:
    """Indices of the cache layers that compress the keys they are fed (DeepSeek-V4's CSA and HCA
    layers keep the tokens of a window not yet compressed, and the compressed entries): `crop` takes
    back their sliding-window keys but not what a rejected draft added to those."""
    return [i for i, layer in enumerate(cache.layers) if hasattr(layer, "update_compressor_states")]


def open_windows(cache, skip=()) -> list:
    """Sliding-window layers of `cache` (not in `skip`) set to keep every key they are fed until
    `close_windows`, so that `crop` can take back tokens once the window is full (transformers'
    past recording)."""
    layers = [
        layer
        for i, layer in enumerate(cache.layers)
        if i not in skip and getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording")
    ]
    for layer in layers:
        layer.activate_past_recording()
    return layers


def close_windows(layers) -> None:
    """Each layer back to the keys a sliding window keeps (the last window - 1), recording off."""
    for layer in layers:
        keep = layer.sliding_window - 1
        if layer.is_initialized and layer.keys.shape[-2] > keep:
            layer.keys = layer.keys[:, :, -keep:, :]
            layer.values = layer.values[:, :, -keep:, :]
        layer.record_past = False


class RecordedStates:
    """A verifying forward whose linear-attention layers keep what a rejection needs to go back.

    In the forward (a context manager around it), each gated delta net of the policy steps its
    recurrent state one token at a time with transformers' own recurrent rule (the one plain
    decoding runs for every token; a multi-token forward would take the chunked rule, which pads
    to its chunk of 64) and the state after each token is kept; its conv state keeps the whole
    window (transformers' `activate_past_recording`). `rewind(cache, m)` then leaves each such
    layer as it was after the first m + 1 fed tokens: the recurrent state kept there, the conv
    state cropped, so the kept tokens need not be fed again. `ok` is False where this
    transformers cannot (no past recording: the caller goes back to a copy and feeds them again
    instead), and after the forward where the model's layers did not go through the rule (nothing
    to go back to: the caller stops)."""

    RULE = "torch_chunk_gated_delta_rule"
    STEP = "torch_recurrent_gated_delta_rule"

    def __init__(self, modules: list, cache, layers: list[int]):
        self.cache, self.layers, self.modules = cache, layers, modules
        self.states: list[list[Any]] = []
        self.ok = bool(self.modules) and all(
            hasattr(cache.layers[i], "activate_past_recording") for i in layers
        )
        self._saved = []

    @classmethod
    def rule_modules(cls, model) -> list:
        """The modeling modules whose gated delta nets step through their module's rule."""
        import sys

        homes = []
        for module in model.modules():
            home = sys.modules.get(type(module).__module__)
            named = "GatedDeltaNet" in type(module).__name__
            if named and hasattr(home, cls.RULE) and hasattr(home, cls.STEP) and home not in homes:
                homes.append(home)
        return homes

    def __enter__(self):
        if not self.ok:
            return self
        for i in self.layers:
            self.cache.layers[i].activate_past_recording()
        for home in self.modules:
            self._saved.append((home, getattr(home, self.RULE)))
            setattr(home, self.RULE, self._stepper(getattr(home, self.STEP)))
        return self

    def __exit__(self, *exc):
        for home, rule in self._saved:
            setattr(home, self.RULE, rule)
        self._saved = []
        # every layer went through the rule once: the record is theirs, in their order
        self.ok = self.ok and len(self.states) == len(self.layers)
        return False

    def _stepper(self, step):
        def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
            import torch

            outs, after = [], []
            state = initial_state
            for t in range(query.shape[1]):
                one = slice(t, t + 1)
                out, state = step(
                    query[:, one], key[:, one], value[:, one], g=g[:, one], beta=beta[:, one],
                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                )  # fmt: skip
                outs.append(out)
                after.append(state)
            self.states.append(after)
            return torch.cat(outs, dim=1), (state if output_final_state else None)

        return rule

    def rewind(self, kept: int) -> None:
        """Each recorded layer as after the first `kept` of the tokens the forward fed."""
        for i, after in zip(self.layers, self.states, strict=True):
            layer = self.cache.layers[i]
            layer.recurrent_states[0].copy_(after[kept - 1])  # a gated delta net's one state
            layer.crop(-(len(after) - kept))
            layer.record_past = False


class RecordedCompressors:
    """A verifying forward whose compressing layers (DeepSeek-V4's CSA and HCA caches) keep what a
    rejection needs to go back, so that the kept tokens need not be fed again.

    Such a layer holds, beside its sliding-window keys, per series (the compressor, and the CSA
    indexer's): the projected tokens of the window not yet full, the compressed entries, their count
    and (CSA) the last full window's overlapping half. Every compressed entry is made from its own
    window (and the one before it) alone, so the state after the first `kept` fed tokens is a prefix
    of what the forward made: in the forward (a context manager around it) each layer's cache calls
    are wrapped to keep what they were given and what they held before; `rewind(kept)` cuts them
    there. `ok` is False where this transformers' cache layers lack those calls (the caller goes
    back to a copy taken before the forward and feeds the kept tokens again instead), and after the
    forward where a layer was not fed through them (nothing to go back to: the caller stops)."""

    CALLS = ("update", "store_compression_weights", "update_compressor_states")
    STATE = ("keys", "cumulative_length", "sliding_window", "compress_rate", "buffer_kv", "buffer_gate",
             "compressed_kv", "entry_count")  # fmt: skip

    def __init__(self, cache, layers: list[int]):
        self.cache, self.layers = cache, layers
        self.ok = bool(layers) and all(
            all(hasattr(cache.layers[i], a) for a in (*self.CALLS, *self.STATE)) for i in layers
        )
        self.records: dict[int, dict] = {}

    def __enter__(self):
        if self.ok:
            for i in self.layers:
                self.records[i] = {"series": {}}
                self._wrap(self.cache.layers[i], self.records[i])
        return self

    def __exit__(self, *exc):
        for i in self.records:
            layer = self.cache.layers[i]
            for name in (*self.CALLS, "update_overlap_state"):
                layer.__dict__.pop(name, None)  # the class's own methods again
        # every layer went through its calls, each series to its compressed entries: the record is whole
        self.ok = self.ok and all(
            "full" in record and record["series"] and all("new" in s for s in record["series"].values())
            for record in self.records.values()
        )
        return False

    @staticmethod
    def _wrap(layer, record: dict) -> None:
        import torch

        cls, series = type(layer), record["series"]

        def update(key_states, value_states, *args, **kwargs):
            record["keys"] = (layer.keys.shape[-2] if layer.is_initialized else 0, layer.cumulative_length)
            out = cls.update(layer, key_states, value_states, *args, **kwargs)
            record["full"] = out[0]  # the kept keys before, then the fed ones (keys are values here)
            return out

        def store_compression_weights(name, kv, gate):
            held_kv, held_gate = layer.buffer_kv[name], layer.buffer_gate[name]
            held = held_kv.shape[1] if held_kv is not None else 0
            series[name] = {
                "held": held,
                "kv": torch.cat([held_kv, kv], dim=1) if held else kv,
                "gate": torch.cat([held_gate, gate], dim=1) if held else gate,
                "count": layer.entry_count[name],
                "compressed": layer.compressed_kv[name],
            }
            return cls.store_compression_weights(layer, name, kv, gate)

        def update_compressor_states(name, compressed):
            series[name]["new"] = compressed
            return cls.update_compressor_states(layer, name, compressed)

        def update_overlap_state(name, chunk_kv, chunk_gate, head_dim):
            series[name]["overlap"] = (
                layer.overlap_kv[name], layer.overlap_gate[name], chunk_kv, chunk_gate, head_dim
            )  # fmt: skip
            return cls.update_overlap_state(layer, name, chunk_kv, chunk_gate, head_dim)

        layer.update = update
        layer.store_compression_weights = store_compression_weights
        layer.update_compressor_states = update_compressor_states
        if hasattr(layer, "update_overlap_state"):
            layer.update_overlap_state = update_overlap_state

    def rewind(self, kept: int) -> None:
        """Each compressing layer as after the first `kept` of the tokens the forward fed."""
        import torch

        for i in self.layers:
            layer, record = self.cache.layers[i], self.records[i]
            was, fed_before = record["keys"]
            layer.keys = record["full"][:, :, : was + kept][:, :, -layer.sliding_window + 1 :]
            layer.values = layer.keys
            layer.cumulative_length = fed_before + kept
            for name, s in record["series"].items():
                total = s["held"] + kept
                usable = total // layer.compress_rate * layer.compress_rate
                windows = usable // layer.compress_rate
                layer.buffer_kv[name] = s["kv"][:, usable:total]
                layer.buffer_gate[name] = s["gate"][:, usable:total]
                new = s["new"][:, :windows]
                if s["compressed"] is None:
                    layer.compressed_kv[name] = new
                else:
                    layer.compressed_kv[name] = (
                        torch.cat([s["compressed"], new], dim=1) if windows else s["compressed"]
                    )
                layer.entry_count[name] = s["count"] + windows
                if "overlap" in s:
                    prior_kv, prior_gate, chunk_kv, chunk_gate, head_dim = s["overlap"]
                    if windows:
                        layer.overlap_kv[name] = chunk_kv[:, windows - 1, :, :head_dim].clone()
                        layer.overlap_gate[name] = chunk_gate[:, windows - 1, :, :head_dim].clone()
                    else:
                        layer.overlap_kv[name], layer.overlap_gate[name] = prior_kv, prior_gate


class SpeculativeDecoder:
    """The built-in engine's decoding loop with MTP drafts (see the module's docstring); counts
    the drafts it proposed and accepted for the rollout's acceptance rate."""

    def __init__(self, model, drafter: MtpDrafter, config: SpeculativeConfig, cache_keyword: str):
        self.model, self.drafter, self.steps = model, drafter, config.steps
        self.cache_keyword = cache_keyword
        self.proposed = self.accepted = 0
        self.row_steps = 0  # rows times verifying forwards
        # verifying forwards after which recurrent layers went back by their recorded states, and
        # those after which they went back to before the forward and the kept tokens were fed again
        self.rewound = self.refed = 0
        self.rule_modules = RecordedStates.rule_modules(model)
        self.topk = None  # the last forward's top-k of the layer whose top-k the drafter shares
        self.streams = None  # the last forward's last streams, where the drafter reads them

    def _target(self, ids, attention, positions, cache):
        """The policy over `ids` against `cache`: (what the drafter reads: the normed hidden states, or
        DeepSeek-V4's last streams before their collapse; float logits); the top-k of
        the layer the drafter's MTP layers share (a transformers DSA decoder layer returns it beside
        its output) left in `self.topk` [B, n, w]."""
        hooks = []
        if self.drafter.trunk_source is not None:
            self.topk = None
            layer = self.model.model.layers[self.drafter.trunk_source]
            hooks.append(layer.register_forward_hook(lambda _m, _a, out: setattr(self, "topk", out[1])))
        if self.drafter.reads_streams:
            self.streams = None
            last = self.model.model.layers[-1]
            hooks.append(last.register_forward_hook(lambda _m, _a, out: setattr(self, "streams", out)))
        try:
            out = self.model.model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                **{self.cache_keyword: cache},
            )
        finally:
            for hook in hooks:
                hook.remove()
        if self.drafter.trunk_source is not None and self.topk is None:
            raise RuntimeError(
                f"policy layer {self.drafter.trunk_source} returned no DSA top-k for the drafter to share"
            )
        hidden = out.last_hidden_state
        logits = self.model.get_output_embeddings()(hidden).float()
        return (self.streams if self.drafter.reads_streams else hidden), logits

    def generate(self, prompts, sampling, generator, device, pad_token_id: int, control=None):
        """(tokens, logprobs, finish reason, top logprobs) of each prompt's sampled response."""
        import torch
        from transformers import DynamicCache

        from miles.train.rollout import sampling_probs, select_cache_rows

        temperature, k = sampling.temperature, self.steps
        width = max(len(p) for p in prompts)
        rows = len(prompts)
        ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
        attention = torch.zeros((rows, width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        pad = (width - attention.sum(dim=1)).unsqueeze(1)  # a column's position is column - pad
        cache, draft_cache = DynamicCache(config=self.model.config), self.drafter.new_cache()
        hidden, logits = self._target(ids, attention, (attention.cumsum(1) - 1).clamp(min=0), cache)
        probs, logp = sampling_probs(logits[:, -1] / temperature, sampling)
        pending = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # sampled, not yet fed
        out_tokens = [[t] for t in pending.tolist()]
        out_logp = [[v] for v in logp.gather(-1, pending.unsqueeze(1)).squeeze(1).tolist()]
        tops = [[_top(logits[r, -1] / temperature, sampling.top_logprobs)] for r in range(rows)]
        # the drafter's next block: (hidden state at a position, the token after it) not yet fed
        block_h, block_t = hidden, torch.cat([ids[:, 1:], pending.unsqueeze(1)], dim=1)
        block_k = self.topk  # the shared top-k at the block's columns (None: no MTP layer shares one)
        block_start = 0  # column of the block's first position
        active = list(range(rows))
        finish = ["length"] * rows
        stop = set(sampling.stop_token_ids)
        done = self._finished(active, out_tokens, out_logp, tops, stop, finish, sampling.max_response_len)
        while True:
            keep = [i for i, row in enumerate(active) if row not in done]
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=device)
                for c in (cache, draft_cache):
                    select_cache_rows(c, index, batch=len(active))
                attention, pad, pending = attention[index], pad[index], pending[index]
                block_h, block_t = block_h[index], block_t[index]
                block_k = block_k[index] if block_k is not None else None
                active = [active[i] for i in keep]
            stopped = control() if control is not None else None
            if stopped:
                for row in active:
                    finish[row] = stopped
                break
            columns = attention.shape[1]  # the target's cache holds columns < `columns`
            # draft: the block (true hidden states), then k - 1 chained steps on the drafts
            drafts, draft_probs = [], []
            h, toks, start, rows = block_h, block_t, block_start, block_k
            windows = open_windows(draft_cache) if k > 1 else []  # the chained drafts are taken back
            for j in range(k):
                n = toks.shape[1]
                cols = torch.arange(start, start + n, device=device)
                mask = torch.cat(
                    [attention, torch.ones_like(attention[:, :1]).expand(-1, max(0, start + n - columns))],
                    dim=1,
                )[:, : start + n]
                if j and rows is not None:  # a chained draft's column, which the policy has not indexed
                    rows = extend_topk(rows[:, -1:], start)
                depth = min(j, len(self.drafter.layers) - 1)
                dl, g = self.drafter.step(h, toks, cols - pad, mask, draft_cache, depth=depth, topk=rows)
                q, _ = sampling_probs(dl[:, -1] / temperature, sampling)
                d = torch.multinomial(q, 1, generator=generator).squeeze(1)
                drafts.append(d)
                draft_probs.append(q)
                h, toks, start = g[:, -1:], d.unsqueeze(1), start + n
            crop_cache(draft_cache, k - 1)  # keep only entries made from the policy's hidden states
            close_windows(windows)
            drafts_t = torch.stack(drafts, dim=1)
            # verify: the pending token and the k drafts in one forward of the policy
            fed = torch.cat([pending.unsqueeze(1), drafts_t], dim=1)
            attention = torch.cat([attention, torch.ones_like(fed)], dim=1)
            cols = torch.arange(columns, columns + k + 1, device=device)
            recurrent, compressing = recurrent_layers(cache), compressing_layers(cache)
            recorders = [
                *([RecordedStates(self.rule_modules, cache, recurrent)] if recurrent else []),
                *([RecordedCompressors(cache, compressing)] if compressing else []),
            ]
            # the layers a rejection takes back by what the forward records, or (where this
            # transformers cannot record them all) by a copy from before it and feeding again
            if not all(r.ok for r in recorders):
                recorders = []
            back = [] if recorders else [*recurrent, *compressing]
            before = {i: copy.deepcopy(cache.layers[i]) for i in back}
            windows = open_windows(cache, skip={*recurrent, *compressing})
            with contextlib.ExitStack() as stack:
                for r in recorders:
                    stack.enter_context(r)
                hidden, logits = self._target(fed, attention, cols - pad, cache)
            fed_k = self.topk
            self.row_steps += len(active)
            target, target_logp = sampling_probs(logits / temperature, sampling)
            accepted, after = accept_drafts(target, torch.stack(draft_probs, dim=1), drafts_t, generator)
            self.proposed += k * len(active)
            self.accepted += int(accepted.sum())
            m = int(accepted.min())
            # every row advances by m + 1 tokens: its first m drafts, then its own token m + 1
            # (the draft where it accepted more, else its residual or bonus draw)
            nxt = torch.where(accepted > m, drafts_t[:, m] if m < k else after, after)
            emitted = torch.cat([drafts_t[:, :m], nxt.unsqueeze(1)], dim=1)
            lp = target_logp[:, : m + 1].gather(-1, emitted.unsqueeze(-1)).squeeze(-1)
            attention = attention[:, : columns + m + 1]
            if recorders:
                # the recorded layers to their state after the m + 1 kept tokens, the others cropped
                for r in recorders:
                    if not r.ok:  # its layers did not go through what it records: nothing to go back to
                        raise RuntimeError(
                            f"{type(r).__name__}: the policy's cache layers {r.layers} were not fed through "
                            "what it records, so a rejected draft cannot be taken out of them; this "
                            "transformers runs these layers otherwise than the one the lane pins: install "
                            "the lane's transformers (requirements/<lane>.txt) or drop "
                            "--sglang-speculative-algorithm to decode without speculation"
                        )
                    r.rewind(m + 1)
                self.rewound += 1
                for i, layer in enumerate(cache.layers):
                    if i not in recurrent and i not in compressing:
                        crop_cache(layer, k - m)
            elif before and m < k:
                # a recurrent or compressing layer cannot drop the rejected drafts: every layer goes
                # back to before the verifying forward (attention layers cropped, the others
                # restored), and the m + 1 kept tokens are fed again (their hidden states are the
                # verifying forward's)
                for i, layer in enumerate(cache.layers):
                    if i in before:
                        cache.layers[i] = before[i]
                    else:
                        crop_cache(layer, k + 1)
                self._target(fed[:, : m + 1], attention, cols[: m + 1] - pad, cache)
                self.refed += 1
            else:
                crop_cache(cache, k - m)
            close_windows(windows)
            for i, row in enumerate(active):
                out_tokens[row].extend(emitted[i].tolist())
                out_logp[row].extend(lp[i].tolist())
                tops[row].extend(
                    _top(logits[i, j] / temperature, sampling.top_logprobs) for j in range(m + 1)
                )
            pending = nxt
            block_h, block_t, block_start = (
                hidden[:, : m + 1],
                torch.cat([drafts_t[:, :m], nxt.unsqueeze(1)], 1),
                columns,
            )
            block_k = fed_k[:, : m + 1] if fed_k is not None else None
            done = self._finished(active, out_tokens, out_logp, tops, stop, finish, sampling.max_response_len)
        return out_tokens, out_logp, finish, tops

    @staticmethod
    def _finished(active, tokens, logprobs, tops, stop, finish, limit) -> set[int]:
        """Cut each row at its first stop token or at the length limit; the rows that ended."""
        done = set()
        for row in active:
            cut = next((i + 1 for i, t in enumerate(tokens[row]) if t in stop), None)
            if cut is not None:
                finish[row] = "stop"
            else:
                cut = limit
            if len(tokens[row]) >= cut:
                del tokens[row][cut:], logprobs[row][cut:], tops[row][cut:]
                done.add(row)
        return done


def _top(logits, k: int):
    import torch

    if not k:
        return None
    top = torch.log_softmax(logits, dim=-1).topk(k)
    return tuple(zip(top.values.tolist(), top.indices.tolist(), strict=True))
