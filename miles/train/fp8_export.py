"""Trainer weights for a rollout engine that serves an FP8 checkpoint.

An engine started from a `<model>_fp8` checkpoint holds e4m3 linear weights, each with its
`weight_scale_inv`. Pushing the trainer's bf16/fp32 tensors into such weights would leave
the scales of the checkpoint in place (garbage rollouts), so every tensor that is FP8 in the
checkpoint is quantized first, with the checkpoint's own `quantization_config`: its block
size, its scale format (`ue8m0`: power-of-two scales, as DSA families are written) and the
tensors it quantized. The quantization is prepare-ckpt's own (`miles.ckpt.fp8`), on CPU, so
what reaches the engine is bit for bit what the FP8 step would write for the same tensor.

Which tensors are FP8 is read from the checkpoint itself: a tensor is quantized exactly when
the checkpoint holds its `<name>_scale_inv`. `modules_to_not_convert` (the loader's skip
list) must agree with that, or the engine and the files disagree about a layer; that is
refused when the export is built, before any weight moves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FP8_FORMATS = ("e4m3",)  # what prepare-ckpt writes (float8_e4m3fn)
SCALE_FORMATS = ("float", "ue8m0")


class Fp8ExportError(RuntimeError):
    """The engine's checkpoint is quantized in a way miles cannot reproduce for the weight push."""


def module_matches(skipped: str, module: str) -> bool:
    """SGLang's skip-list rule (`_module_path_match` in sglang/srt/layers/quantization/utils.py,
    0.5.23): an entry matches a module on dotted-name boundaries, with or without `model.`."""
    for entry in {
        skipped.rstrip("."),
        skipped.rstrip(".").removeprefix("model."),
        "model." + skipped.rstrip("."),
    }:
        if module == entry or module.startswith(entry + ".") or f".{entry}." in f".{module}.":
            return True
    return False


@dataclass(frozen=True)
class Fp8Export:
    """Turns a stream of (name, tensor) into the stream an FP8 engine loads: each tensor the
    checkpoint holds in FP8 becomes (name, e4m3 tensor) and (name + "_scale_inv", fp32 scales)."""

    checkpoint: str
    block: int
    pow2_scales: bool  # scale_fmt ue8m0
    quantized: frozenset[str]

    def __call__(self, named_tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        from miles.ckpt.fp8_rules import SCALE_SUFFIX

        for name, tensor in named_tensors:
            if name not in self.quantized:
                yield name, tensor
                continue
            q, scale = self.quantize(name, tensor)
            yield name, q
            yield name + SCALE_SUFFIX, scale

    def quantize(self, name: str, tensor):
        """(e4m3, fp32 scale_inv) of one trainer tensor, on the tensor's device."""
        import torch

        from miles.ckpt.errors import CheckpointError
        from miles.ckpt.fp8 import quantize_blockwise
        from miles.ckpt.fp8_rules import BLOCK, geometry

        cpu = tensor.detach().to("cpu")
        try:
            if cpu.dim() == 2:
                q, scale = quantize_blockwise(cpu, self.block, pow2_scales=self.pow2_scales)
            elif cpu.dim() == 3 and self.block == BLOCK:
                # fused experts: every expert (and each half of a fused gate/up) tiled on its own
                g = geometry(name, tuple(cpu.shape))
                parts = [
                    quantize_blockwise(m, BLOCK, pow2_scales=self.pow2_scales)
                    for m in cpu.reshape(g.mats, g.rows, g.cols)
                ]
                q = torch.stack([p[0] for p in parts]).reshape(cpu.shape)
                scale = torch.stack([p[1] for p in parts]).reshape(g.scale_shape)
            else:
                raise Fp8ExportError(
                    f"trainer weight {name} {list(cpu.shape)}: {self.checkpoint} holds it in FP8, but miles "
                    f"quantizes only 2-D weights, or 3-D fused experts in {BLOCK}x{BLOCK} blocks (block {self.block})"
                )
        except CheckpointError as exc:
            raise Fp8ExportError(
                f"trainer weight {name}: {exc}; training diverged (see train/grad_norm), the weights "
                "cannot be pushed to the FP8 engine"
            ) from None
        return q.to(tensor.device), scale.to(tensor.device)


def fp8_export_for(checkpoint: str | Path) -> Fp8Export | None:
    """The export an engine started from `checkpoint` needs; None when its weights are not quantized."""
    from miles.ckpt.errors import CheckpointError
    from miles.ckpt.fp8_rules import SCALE_SUFFIX
    from miles.ckpt.shards import read_weight_map

    root = Path(checkpoint)
    config_path = root / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise Fp8ExportError(f"{config_path}: cannot read the engine checkpoint's config ({exc})") from None
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = f"{config_path}: quantization_config"
    method = qc.get("quant_method")
    if method != "fp8":
        raise Fp8ExportError(
            f"{where}.quant_method is {method!r}: miles can push trained weights into unquantized or "
            "block-FP8 (quant_method fp8, as prepare-ckpt writes) checkpoints only; roll out from the "
            "unquantized checkpoint"
        )
    fmt = qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    scale_fmt = qc.get("scale_fmt") or "float"
    if fmt not in FP8_FORMATS:
        raise Fp8ExportError(f"{where}.fmt is {fmt!r}; miles quantizes to {', '.join(FP8_FORMATS)} only")
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and int(block[0]) > 0):
        raise Fp8ExportError(
            f"{where}.weight_block_size is {block!r}; miles quantizes square blocks ([128, 128], as "
            "prepare-ckpt writes), not per-tensor or rectangular scales"
        )
    if scale_fmt not in SCALE_FORMATS:
        raise Fp8ExportError(f"{where}.scale_fmt is {scale_fmt!r}; miles writes {' or '.join(SCALE_FORMATS)}")
    try:
        names = set(read_weight_map(root).weight_map)
    except CheckpointError as exc:
        raise Fp8ExportError(f"{root}: {exc}") from None
    quantized = frozenset(
        n.removesuffix(SCALE_SUFFIX)
        for n in names
        if n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in names
    )
    skipped = [str(s) for s in qc.get("modules_to_not_convert") or ()]
    clashes = sorted(n for n in quantized for s in skipped if module_matches(s, n.rsplit(".", 1)[0]))
    if clashes:
        raise Fp8ExportError(
            f"{where}.modules_to_not_convert keeps {clashes[0]} in bf16, but the checkpoint holds it in FP8 "
            f"({len(clashes)} such tensor(s)); the engine would load that layer unquantized: rewrite the "
            "checkpoint with `invoke prepare-ckpt`"
        )
    return Fp8Export(str(root), int(block[0]), scale_fmt == "ue8m0", quantized)
