"""Which tensors an FP8 checkpoint quantizes, how their scales are laid out, what config.json says.

The rules are the serving side's (SGLang loads these modules unquantized) as the seed
framework's converter writes them: only linear weights inside decoder layers and MTP
blocks are quantized; norms, embeddings, routers/gates, output heads, the modules a family
keeps (its `fp8_keep`, miles.families: GLM-5's MTP `eh_proj`, the DSA indexer's
`weights_proj`, DeepSeek-V4's compressors and `attn.wo_a`), and everything outside the
decoder (vision/audio towers, projectors) stay as they are. A model
with tied embeddings has no lm_head in its files, yet loaders build one: it is listed too.
Fused 3-D expert tensors (`experts.gate_up_proj`, `experts.down_proj`) are quantized per
expert; a fused gate/up tensor gets separate tiles for its gate and up halves, as
per-expert gate_proj/up_proj files do once a loader stacks them.

`modules_to_not_convert` lists the full names of the linear modules kept in bf16 (the
module of each kept 2-D `<module>.weight`): a loader treats each entry as a prefix
(transformers also as a suffix), so an entry must never be a module that holds quantized
linears. A parameter that is not a linear's weight (a decoder layer's fp32 `hc_attn_fn`, a
compressor's `ape`) names no module: listing its owner would switch off FP8 for
everything below it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from miles.ckpt.families import LAYER_RE
from miles.ckpt.shards import FLOAT_DTYPES, TensorInfo

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
SCALE_FMT_FLOAT = "float"
SCALE_FMT_UE8M0 = "ue8m0"  # scales are powers of two (1-byte e8m0 on the GPU side)

# Last module names every family keeps in bf16 (exact match); a family adds its own (fp8_keep).
_KEEP_LEAVES = frozenset({"gate", "router", "lm_head", "head"})
_MTP_RE = re.compile(
    r"^(?:model\.)?mtp(?:_layers)?\."
)  # DeepSeek-V4 `mtp.N.*`, Inkling `model.mtp.*`, MiMo `model.mtp_layers.N.*`
_FUSED_EXPERTS = frozenset({"gate_up_proj", "down_proj", "up_proj"})
_GATE_UP = "gate_up_proj"
_DSA_MARK = ".indexer."
TIED_HEAD = "lm_head"  # the output linear a loader builds (and ties) when the files hold only embeddings  # a DSA model (DeepSeek-V3.2 style sparse attention) has indexer tensors


@dataclass(frozen=True)
class Geometry:
    """A quantized tensor as `mats` stacked matrices of `rows` x `cols`, tiled independently."""

    mats: int
    rows: int
    cols: int
    scale_shape: tuple[int, ...]

    @property
    def scale_rows_per_mat(self) -> int:
        return math.ceil(self.rows / BLOCK)


def in_decoder(name: str) -> bool:
    """Inside a decoder layer (any depth, MTP layers included) or an MTP block."""
    return bool(LAYER_RE.match(name) or _MTP_RE.match(name))


def family_keep(config: Mapping[str, Any] | None) -> frozenset[str]:
    """The modules (by name, anywhere on a tensor's path) a checkpoint's family keeps in bf16; for
    a config no family claims, every family's, so nothing any of them keeps is quantized."""
    from miles import families
    from miles.families.facts import text_config

    found = families.family_of(text_config(config or {}))
    if found is not None:
        return found.fp8_keep
    return frozenset().union(*(f.fp8_keep for f in families.families().values()))


def should_quantize(info: TensorInfo, keep: frozenset[str] | None = None) -> bool:
    """A float linear weight inside the decoder that the serving side reads as FP8 (`keep`: the
    family's modules that stay bf16; default every family's)."""
    keep = family_keep(None) if keep is None else keep
    if info.dtype not in FLOAT_DTYPES or not info.numel or not in_decoder(info.name):
        return False
    parts = info.name.split(".")
    if len(info.shape) == 2 and parts[-1] == "weight":
        module = parts[:-1]
    elif len(info.shape) == 3 and parts[-1] in _FUSED_EXPERTS and len(parts) > 1 and parts[-2] == "experts":
        module = parts[:-1]
    else:
        return False
    leaf = module[-1]
    if "norm" in leaf or "embed" in leaf or leaf in _KEEP_LEAVES:
        return False
    return not any(p in keep for p in module)


def geometry(name: str, shape: tuple[int, ...]) -> Geometry:
    """How the tensor `name` of `shape` is tiled: 2-D as one matrix, 3-D experts per expert."""
    if len(shape) == 2:
        rows, cols = shape
        return Geometry(1, rows, cols, (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)))
    experts, rows, cols = shape
    if name.rsplit(".", 1)[-1] == _GATE_UP and rows % 2 == 0:
        half = rows // 2
        return Geometry(
            2 * experts, half, cols, (experts, 2 * math.ceil(half / BLOCK), math.ceil(cols / BLOCK))
        )
    return Geometry(experts, rows, cols, (experts, math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)))


def geometry_of_scale(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> Geometry | None:
    """The tiling an existing FP8 tensor was written with, read from its scale's shape."""
    if len(shape) not in (2, 3):
        return None
    g = geometry(name, shape)
    if tuple(scale_shape) == g.scale_shape:
        return g
    if len(shape) == 3:  # a fused gate/up whose halves share tiles, or the other way round
        experts, rows, cols = shape
        whole = Geometry(experts, rows, cols, (experts, math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)))
        if tuple(scale_shape) == whole.scale_shape:
            return whole
    return None


def scale_fmt_for(names: Iterable[str]) -> str:
    """ue8m0 for DSA checkpoints (they carry indexer tensors), as the seed framework's converter writes."""
    return SCALE_FMT_UE8M0 if any(_DSA_MARK in f".{n}" for n in names) else SCALE_FMT_FLOAT


def modules_to_not_convert(kept: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """The modules owning the `kept` linear weights (`<module>.weight`), full names, never one
    that also holds a `quantized` tensor below it."""
    holders = {name.rsplit(".", 1)[0] for name in quantized}
    prefixes = set()
    for module in holders:
        parts = module.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    modules = {name.rsplit(".", 1)[0] if "." in name else name for name in kept}
    return sorted(m for m in modules if m not in prefixes)


def quantization_config(not_converted: list[str], scale_fmt: str = SCALE_FMT_FLOAT) -> dict:
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": not_converted,
    }
    if scale_fmt != SCALE_FMT_FLOAT:
        config["scale_fmt"] = scale_fmt
    return config
