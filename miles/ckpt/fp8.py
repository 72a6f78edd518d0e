"""Block-wise FP8 (e4m3) checkpoints on CPU, and back to bf16.

Each quantized matrix is cut into 128x128 tiles; a tile's scale is amax/448 (fp32, saved
as `<name>_scale_inv`, one [ceil(rows/128), ceil(cols/128)] grid per matrix) and its
values become round_e4m3(w * 448/amax). With `scale_fmt: ue8m0` (DSA models) a scale is
rounded up to a power of two first, so a loader that keeps it as a 1-byte exponent reads
exactly the scale the weight was divided by. Which tensors are quantized, the layout of
their scales and the `quantization_config` written to config.json: miles.ckpt.fp8_rules.

A non-finite weight has no FP8 form: conversion stops naming the tensor and the index.

Conversion streams: shards one after another, each tensor in strips of 128-row blocks
read with pread, quantized by a thread pool (torch releases the GIL), and written in
order by the main thread. Memory stays at a few strips per worker whatever the shard size.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import text_config
from miles.ckpt.fp8_rules import (
    BLOCK,
    SCALE_FMT_FLOAT,
    SCALE_FMT_UE8M0,
    SCALE_SUFFIX,
    TIED_HEAD,
    Geometry,
    family_keep,
    geometry,
    geometry_of_scale,
    modules_to_not_convert,
    quantization_config,
    scale_fmt_for,
    should_quantize,
)
from miles.ckpt.manifest import FileRecord
from miles.ckpt.progress import Progress
from miles.ckpt.shards import (
    DTYPE_OF_TORCH_NAME,
    DTYPE_SIZES,
    FLOAT_DTYPES,
    ShardHeader,
    ShardWriter,
    TensorInfo,
    copy_side_files,
    pread_into,
    read_header,
    read_json_file,
    read_weight_map,
    tensor_bytes,
    torch_dtype,
)
from miles.ckpt.shards import write_index as _write_index
from miles.files import replace_file

__all__ = [
    "BLOCK", "E4M3_MAX", "SCALE_SUFFIX", "convert_from_fp8", "convert_to_fp8", "dequantize_blockwise", "dequantize_tensor",
    "quantization_config", "quantize_blockwise", "should_quantize",
]  # fmt: skip

E4M3_MAX = 448.0
_STRIP_BYTES = 8 << 20  # input bytes per work item
_AMAX_FLOOR = 1e-12  # an all-zero tile still gets a finite, non-zero scale


class _NonFinite(Exception):
    """A strip holds NaN or Inf at (row, col) of the strip."""

    def __init__(self, row: int, col: int, value: float):
        super().__init__(row, col, value)
        self.row, self.col, self.value = row, col, value


def _kind(value: float) -> str:
    return "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")


def quantize_blockwise(weight, block: int = BLOCK, *, pow2_scales: bool = False):
    """(e4m3 tensor, fp32 scale_inv) of a 2-D tensor; scale_inv[i, j] = amax of tile (i, j) / 448.

    pow2_scales rounds each scale up to a power of two (scale_fmt ue8m0). A NaN or Inf
    input raises CheckpointError naming its index.
    """
    import torch

    weight = weight.contiguous()
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / block), math.ceil(cols / block), dtype=torch.float32)
    step = max(block, (_STRIP_BYTES // max(cols * weight.element_size(), 1)) // block * block)
    for r in range(0, rows, step):
        stop = min(r + step, rows)
        try:
            q[r:stop], scales[r // block : math.ceil(stop / block)] = _quantize_strip(
                weight[r:stop], block, pow2_scales
            )
        except _NonFinite as bad:
            raise CheckpointError(
                f"quantize_blockwise: {_kind(bad.value)} at index [{r + bad.row}, {bad.col}]; "
                "FP8 has no form for a non-finite weight"
            ) from None
    return q, scales


def _quantize_strip(strip, block: int, pow2_scales: bool = False):
    import torch

    rows, cols = strip.shape
    prow, pcol = math.ceil(rows / block) * block, math.ceil(cols / block) * block
    x = _scratch("f32", prow * pcol, torch.float32).view(prow, pcol)
    if (prow, pcol) == (rows, cols):
        # max/min of the input dtype are exact, and the scaled copy is one fused pass
        tiles = strip.view(prow // block, block, pcol // block, block)
        magnitude = _scratch(f"abs-{strip.dtype}", rows * cols, strip.dtype).view(tiles.shape)
        amax = torch.abs(tiles, out=magnitude).amax(dim=(1, 3)).float()
        out = x.view(tiles.shape)
    else:  # zero padding leaves every tile's amax unchanged
        x.zero_()
        x[:rows, :cols] = strip
        tiles = out = x.view(prow // block, block, pcol // block, block)
        amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg())
    if not bool(torch.isfinite(amax).all()):  # amax propagates NaN and Inf: one check per strip
        bad = (~torch.isfinite(strip)).nonzero()[0].tolist()
        raise _NonFinite(bad[0], bad[1], float(strip[bad[0], bad[1]]))
    amax.clamp_(min=_AMAX_FLOOR)
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
        torch.mul(tiles, scale.reciprocal()[:, None, :, None], out=out)
    else:
        scale = amax / E4M3_MAX
        torch.mul(tiles, (E4M3_MAX / amax)[:, None, :, None], out=out)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    q.copy_(x[:rows, :cols])
    return q, scale


_local = threading.local()


def _scratch(name: str, numel: int, dtype):
    """A per-thread buffer reused across strips: fresh multi-MB allocations cost page faults."""
    import torch

    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_local, name, buf)
    return buf[:numel]


def dequantize_blockwise(q, scale_inv, dtype=None, block: int = BLOCK):
    """The inverse of quantize_blockwise: q * scale_inv of its tile, as `dtype` (bf16 default)."""
    import torch

    rows, cols = q.shape
    scale = scale_inv.to(torch.float32)
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (q.to(torch.float32) * full).to(dtype or torch.bfloat16)


def ordered_map(pool: ThreadPoolExecutor, fn: Callable, items: Iterable, window: int) -> Iterator:
    """pool.map with at most `window` items in flight, results in order (bounded memory)."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _strips(g: Geometry, item: int) -> list[tuple[int, int, int, int]]:
    """(first row, end row, first scale row, end scale row) of each work item, rows of the
    tensor viewed as [mats * rows, cols]; a strip never crosses a matrix."""
    step = max(BLOCK, (_STRIP_BYTES // max(g.cols * item, 1)) // BLOCK * BLOCK)
    per = g.scale_rows_per_mat
    return [
        (k * g.rows + r, k * g.rows + min(r + step, g.rows), k * per + r // BLOCK,
         k * per + math.ceil(min(r + step, g.rows) / BLOCK))
        for k in range(g.mats)
        for r in range(0, g.rows, step)
    ] or [(0, 0, 0, 0)]  # fmt: skip


def _read_rows(fd: int, header: ShardHeader, info: TensorInfo, r0: int, r1: int):
    """Rows r0:r1 of the tensor viewed as 2-D [all leading dims, last dim]."""
    import torch

    cols = info.shape[-1] if info.shape else 1
    item = DTYPE_SIZES[info.dtype]
    nbytes = (r1 - r0) * cols * item
    if not nbytes:
        return torch.empty(0, cols, dtype=torch_dtype(info.dtype))
    buf = _scratch("read", nbytes, torch.uint8)  # valid until this thread's next read
    pread_into(fd, memoryview(buf.numpy()), header.offset(info) + r0 * cols * item, header.path)
    return buf.view(torch_dtype(info.dtype)).view(r1 - r0, cols)


def _read_whole(fd: int, header: ShardHeader, info: TensorInfo):
    rows = info.numel // (info.shape[-1] if info.shape else 1) if info.numel else 0
    return _read_rows(fd, header, info, 0, rows).clone().reshape(info.shape)


def convert_to_fp8(src: Path, dst: Path, *, workers: int | None = None, progress: Progress | None = None):
    """Write the FP8 form of checkpoint `src` into the empty directory `dst`; return shard records."""
    names = read_weight_map(src).weight_map
    keep = family_keep(read_json_file(src / "config.json"))
    return _convert(src, dst, _QuantizePlan(scale_fmt_for(names), keep), workers, progress)


def convert_from_fp8(
    src: Path,
    dst: Path,
    *,
    dtype: str = "bfloat16",
    workers: int | None = None,
    progress: Progress | None = None,
):
    """Write the `dtype` form of FP8 checkpoint `src` into `dst` (weights dequantized, scales dropped)."""
    if dtype not in _DEQUANT_DTYPES:
        raise CheckpointError(f"dequantize to {dtype!r}: choose one of {', '.join(_DEQUANT_DTYPES)}")
    return _convert(src, dst, _DequantizePlan(dtype), workers, progress)


class _QuantizePlan:
    def __init__(self, scale_fmt: str = SCALE_FMT_FLOAT, keep: frozenset[str] = frozenset()):
        self.scale_fmt = scale_fmt
        self.keep = keep  # the family's modules that stay bf16

    def layout(self, info: TensorInfo, header: ShardHeader, names: set[str]):
        if not should_quantize(info, self.keep):
            return None
        g = geometry(info.name, info.shape)
        return [(info.name, "F8_E4M3", info.shape), (info.name + SCALE_SUFFIX, "F32", g.scale_shape)], g

    def work(self, job):
        fd, header, info, (r0, r1, _, _) = job
        try:
            q, scales = _quantize_strip(
                _read_rows(fd, header, info, r0, r1), BLOCK, self.scale_fmt == SCALE_FMT_UE8M0
            )
        except _NonFinite as bad:
            lead = info.shape[:-1]
            index = [*_unravel(r0 + bad.row, lead), bad.col]
            raise CheckpointError(
                f"{header.path}: tensor {info.name}: {_kind(bad.value)} at index {index}; FP8 has no form "
                "for a non-finite weight and the source checkpoint is broken: fetch or repair it "
                "(validate reports every such tensor)"
            ) from None
        return [tensor_bytes(q)], scales

    def config(self, config: dict, not_converted: list[str]) -> dict:
        return {**config, "quantization_config": quantization_config(not_converted, self.scale_fmt)}


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for dim in reversed(shape):
        flat, rest = divmod(flat, dim)
        index.append(rest)
    return index[::-1]


_DEQUANT_DTYPES = ("bfloat16", "float16", "float32")


class _DequantizePlan:
    def __init__(self, dtype: str):
        self.dtype = dtype

    def layout(self, info: TensorInfo, header: ShardHeader, names: set[str]):
        if info.name.endswith(SCALE_SUFFIX) and info.name.removesuffix(SCALE_SUFFIX) in names:
            return [], None  # folded into its weight
        if info.dtype != "F8_E4M3" or info.name + SCALE_SUFFIX not in names:
            return None
        scale = header.tensors.get(info.name + SCALE_SUFFIX)
        if scale is None:
            raise CheckpointError(
                f"{header.path}: {info.name}{SCALE_SUFFIX} must sit in the same shard as {info.name}"
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
        rows = _read_rows(fd, header, info, r0, r1)
        return [tensor_bytes(dequantize_blockwise(rows, scale[s0:s1], getattr(torch, self.dtype)))], None

    def config(self, config: dict, not_converted: list[str]) -> dict:
        return {k: v for k, v in config.items() if k != "quantization_config"}


def _convert(
    src: Path, dst: Path, plan, workers: int | None, progress: Progress | None
) -> dict[str, FileRecord]:
    import torch

    src, dst = Path(src), Path(dst)
    files = read_weight_map(src)
    headers = {s: read_header(src / s) for s in files.shards}
    names = set(files.weight_map)
    if progress is not None:
        progress.total_bytes = sum(t.nbytes for h in headers.values() for t in h.tensors.values())
        progress.total_tensors = len(files.weight_map)
    workers = workers or len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallelism comes from the pool; nested OpenMP would oversubscribe
    records, weight_map, total = {}, {}, 0
    quantized, kept = [], []
    closing = {}
    try:
        # A shard's fsync runs on its own thread while the next shard is converted.
        with (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp8") as pool,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync") as syncer,
        ):
            for shard, header in headers.items():
                writer, layout = _convert_shard(header, dst / shard, plan, names, pool, workers, progress)
                closing[shard] = syncer.submit(_close, writer)
                for name, dtype, shape in layout:
                    weight_map[name] = shard
                    total += math.prod(shape) * DTYPE_SIZES[dtype]
                    if dtype.startswith("F8"):
                        quantized.append(name)
                    elif dtype in FLOAT_DTYPES and len(shape) == 2 and name.endswith(".weight"):
                        kept.append(name)  # a linear (or embedding) left in its own dtype
            for shard, future in closing.items():
                records[shard] = FileRecord(*future.result())
    finally:
        torch.set_num_threads(threads)
    config = read_json_file(src / "config.json")
    if text_config(config).get("tie_word_embeddings") or config.get("tie_word_embeddings"):
        kept.append(TIED_HEAD + ".weight")  # not in the files, but every loader builds it as a linear
    not_converted = modules_to_not_convert(kept, quantized)
    replace_file(
        dst / "config.json",
        (json.dumps(plan.config(config, not_converted), indent=2, sort_keys=True) + "\n").encode(),
    )
    if files.indexed:
        _write_index(dst, weight_map, total)
    copy_side_files(src, dst)
    return records


def _convert_shard(header: ShardHeader, out: Path, plan, names: set[str], pool, workers, progress):
    import torch

    infos = list(header.tensors.values())
    plans = {info.name: plan.layout(info, header, names) for info in infos}
    layout = []
    for info in infos:
        entry = plans[info.name]
        layout.extend([(info.name, info.dtype, info.shape)] if entry is None else entry[0])
    writer = ShardWriter(out, layout, header.metadata or {"format": "pt"})
    fd = os.open(header.path, os.O_RDONLY)
    try:
        scales = {}
        if isinstance(plan, _DequantizePlan):
            for info in infos:
                entry = plans[info.name]
                if entry is not None and entry[1] is not None:
                    s = _read_whole(fd, header, header.tensors[info.name + SCALE_SUFFIX])
                    scales[info.name] = s.reshape(-1, s.shape[-1])

        def strips(info: TensorInfo):
            return _strips(plans[info.name][1], DTYPE_SIZES[info.dtype])

        def jobs():
            for info in infos:
                entry = plans[info.name]
                if entry is not None and entry[1] is not None:
                    for strip in strips(info):
                        yield (
                            (fd, header, info, strip, scales[info.name])
                            if scales
                            else (fd, header, info, strip)
                        )

        # Enough strips in flight to keep the workers busy while a write waits on the disk.
        results = ordered_map(pool, plan.work, jobs(), window=4 * workers + 4)
        for info in infos:
            entry = plans[info.name]
            if entry is None:
                writer.copy_from(info.name, fd, header.offset(info), info.nbytes, header.path)
            elif entry[1] is not None:
                parts = []
                for _ in strips(info):
                    chunks, scale = next(results)
                    for chunk in chunks:
                        writer.write_part(info.name, chunk)
                    parts.append(scale)
                if parts[0] is not None:
                    name, _, shape = entry[0][1]
                    writer.write(name, tensor_bytes(torch.cat(parts).reshape(shape)))
            if progress is not None:
                progress.advance(info.nbytes, 1)
    except BaseException:
        writer.abort()
        raise
    finally:
        os.close(fd)
    return writer, layout


def _close(writer: ShardWriter) -> tuple[int, str]:
    try:
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def dequantize_tensor(name: str, q, scale_inv, dtype=None, *, grid: bool = False):
    """A whole FP8 tensor (2-D, or 3-D experts tiled per expert) back to `dtype` (bf16 default).

    grid=True also returns each element's tile scale (fp32, q's shape), for error bounds.
    """
    import torch

    g = geometry_of_scale(name, tuple(q.shape), tuple(scale_inv.shape))
    if g is None:
        raise CheckpointError(
            f"{name}: a scale of shape {list(scale_inv.shape)} does not tile {list(q.shape)} in {BLOCK}x{BLOCK} blocks"
        )
    scales = scale_inv.to(torch.float32).reshape(g.mats, g.scale_rows_per_mat, -1)
    full = scales.repeat_interleave(BLOCK, 1)[:, : g.rows].repeat_interleave(BLOCK, 2)[:, :, : g.cols]
    out = (q.reshape(g.mats, g.rows, g.cols).to(torch.float32) * full).to(dtype or torch.bfloat16)
    return (out.reshape(q.shape), full.reshape(q.shape)) if grid else out.reshape(q.shape)
