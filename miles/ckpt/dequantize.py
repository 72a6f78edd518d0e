"""FP8 checkpoints back to bf16 (or fp16, fp32), each piece checked as FP8 before a value is computed.

What dequantize reads is the form miles.ckpt.fp8 (and DeepSeek's FP8 releases) write:
config.json's quantization_config says quant_method fp8, fmt e4m3 and 128x128 blocks; every
float8 weight is float8_e4m3fn with its `<name>_scale_inv` in the same shard, a float tensor
of one positive, finite scale per tile, shaped to tile the weight; no e4m3 byte encodes NaN;
and no value overflows the target dtype once scaled. Anything else (an e5m2 weight, a weight
without its scale, a scale of an int dtype, zero, negative or non-finite, a scale beside a
bf16 weight, another block size) is refused naming the tensor, the index and the rule, before
a wrong value is written. The conversion itself streams like miles.ckpt.fp8's.
"""

from __future__ import annotations

from pathlib import Path

from miles.ckpt.errors import CheckpointError
from miles.ckpt.fp8 import convert, dequantize_blockwise, read_rows, unravel
from miles.ckpt.fp8_rules import BLOCK, SCALE_SUFFIX, geometry_of_scale
from miles.ckpt.manifest import FileRecord
from miles.ckpt.progress import Progress
from miles.ckpt.shards import (
    DTYPE_OF_TORCH_NAME,
    FLOAT_DTYPES,
    ShardHeader,
    TensorInfo,
    read_json_file,
    tensor_bytes,
)

__all__ = ["check_quantization_config", "check_scale", "convert_from_fp8"]


def convert_from_fp8(
    src: Path,
    dst: Path,
    *,
    dtype: str = "bfloat16",
    workers: int | None = None,
    progress: Progress | None = None,
) -> dict[str, FileRecord]:
    """Write the `dtype` form of FP8 checkpoint `src` into `dst` (weights dequantized, scales dropped)."""
    if dtype not in _DEQUANT_DTYPES:
        raise CheckpointError(f"dequantize to {dtype!r}: choose one of {', '.join(_DEQUANT_DTYPES)}")
    check_quantization_config(src, read_json_file(Path(src) / "config.json"))
    return convert(src, dst, _DequantizePlan(dtype), workers, progress)


_DEQUANT_DTYPES = ("bfloat16", "float16", "float32")


class _DequantizePlan:
    """FP8 (e4m3, 128x128 tiles, a positive finite scale per tile) back to `dtype`: every piece is
    checked as FP8 before a value is computed, and every value as it is."""

    reads_scales = True

    def __init__(self, dtype: str):
        self.dtype = dtype

    def layout(self, info: TensorInfo, header: ShardHeader, names: set[str]):
        where = f"{header.path}: tensor {info.name}"
        base = info.name.removesuffix(SCALE_SUFFIX)
        if info.name.endswith(SCALE_SUFFIX) and base != info.name:
            weight = header.tensors.get(base)
            if base in names and weight is not None and weight.dtype.startswith("F8_"):
                return [], None  # folded into its weight
            what = f"a {weight.dtype} weight" if weight is not None else "no weight in its shard"
            raise CheckpointError(
                f"{where}: a scale of {what}; only an FP8 weight has one, so the checkpoint is not the FP8 "
                "form miles (or DeepSeek) writes: fetch it again"
            )
        if not info.dtype.startswith("F8_"):
            return None
        if info.dtype != "F8_E4M3":
            raise CheckpointError(
                f"{where}: is {info.dtype}; dequantize reads float8_e4m3fn weights (the fmt e4m3 of its "
                "quantization_config), and an e5m2 or e8m0 byte means another number: convert it with the "
                "tool that wrote it"
            )
        scale = header.tensors.get(info.name + SCALE_SUFFIX)
        if scale is None:
            held = "is in another shard" if info.name + SCALE_SUFFIX in names else "is missing"
            raise CheckpointError(
                f"{where}: an FP8 weight whose scale {info.name}{SCALE_SUFFIX} {held}; without it in the same "
                "shard its values cannot be recovered: fetch the checkpoint again"
            )
        if scale.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{header.path}: tensor {scale.name} is {scale.dtype}; a scale is a float ({', '.join(sorted(FLOAT_DTYPES))})"
            )
        g = geometry_of_scale(info.name, info.shape, scale.shape)
        if g is None:
            raise CheckpointError(
                f"{header.path}: tensor {info.name}{SCALE_SUFFIX} has shape {list(scale.shape)}, which does "
                f"not tile {info.name} {list(info.shape)} in {BLOCK}x{BLOCK} blocks"
            )
        return [(info.name, DTYPE_OF_TORCH_NAME[self.dtype], info.shape)], g

    def work(self, job):
        import torch

        fd, header, info, (r0, r1, s0, s1), scale = job
        rows = read_rows(fd, header, info, r0, r1)
        nan = (rows.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's only special value: NaN
        if bool(nan.any()):
            row, col = (int(i) for i in nan.nonzero()[0])
            raise CheckpointError(
                f"{header.path}: tensor {info.name}: NaN at index {[*unravel(r0 + row, info.shape[:-1]), col]} "
                "(an e4m3 NaN byte); the checkpoint is broken: fetch it again"
            )
        out = dequantize_blockwise(rows, scale[s0:s1], getattr(torch, self.dtype))
        if not bool(torch.isfinite(out).all()):
            row, col = (int(i) for i in (~torch.isfinite(out)).nonzero()[0])
            raise CheckpointError(
                f"{header.path}: tensor {info.name}: the value at index {[*unravel(r0 + row, info.shape[:-1]), col]} "
                f"overflows {self.dtype} once scaled (its tile's scale is too large); the checkpoint is broken"
            )
        return [tensor_bytes(out)], None

    def check_scale(self, header: ShardHeader, name: str, scale) -> None:
        check_scale(header, name, scale)

    def config(self, config: dict, not_converted: list[str]) -> dict:
        return {k: v for k, v in config.items() if k != "quantization_config"}


def check_scale(header: ShardHeader, name: str, scale) -> None:
    """A scale tile is a positive, finite number: a zero erases its tile, a negative flips it,
    NaN or Inf make every value of it NaN or Inf."""
    import torch

    values = scale.float()
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        value = float(values[tuple(index)])
        raise CheckpointError(
            f"{header.path}: tensor {name}: scale {value:g} at index {index}; a scale must be positive and finite "
            "(one per 128x128 tile): the checkpoint is broken, fetch it again"
        )


def check_quantization_config(src: Path, config: object) -> None:
    """The FP8 form dequantize reads: quant_method fp8, fmt e4m3, weight_block_size [128, 128]."""
    where = f"{Path(src) / 'config.json'}: quantization_config"
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if q is not None and not isinstance(q, dict):
        raise CheckpointError(f'{where} is {q!r}, not an object like {{"quant_method": "fp8", ...}}')
    if q is None or q.get("quant_method") != "fp8":
        method = None if q is None else q.get("quant_method")
        raise CheckpointError(
            f"{where} quant_method is {method!r}, not 'fp8': {src} is not an FP8 checkpoint, nothing to dequantize"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where} fmt is {q.get('fmt')!r}; dequantize reads e4m3 only")
    blocks = q.get("weight_block_size", [BLOCK, BLOCK])
    if blocks != [BLOCK, BLOCK] or any(isinstance(b, bool) for b in blocks):
        raise CheckpointError(
            f"{where} weight_block_size is {blocks!r}; dequantize reads {BLOCK}x{BLOCK} tiles, the block size "
            "miles and DeepSeek's FP8 checkpoints use"
        )
