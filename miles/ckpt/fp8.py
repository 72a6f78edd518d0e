"""Block-wise FP8 (e4m3) checkpoints on CPU, and back to bf16.

Each 2-D linear weight is cut into 128x128 tiles; a tile's scale is amax/448 (fp32, saved
as `<name>_scale_inv` with shape [ceil(rows/128), ceil(cols/128)]) and its values become
round_e4m3(w * 448/amax). Norms, embeddings, routers/gates, lm_head, biases and anything
not a 2-D `.weight` stay as they are. config.json gains the `quantization_config` that
transformers' fine-grained FP8 loader and SGLang read.

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
from miles.ckpt.families import LAYER_RE
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
    read_weight_map,
    tensor_bytes,
    torch_dtype,
    write_index,
)

BLOCK = 128
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
_STRIP_BYTES = 8 << 20  # input bytes per work item
_AMAX_FLOOR = 1e-12  # an all-zero tile still gets a finite, non-zero scale
_KEEP_COMPONENTS = ("gate", "router", "lm_head", "head", "weights_proj")  # module names kept in bf16


def quantization_config(modules_to_not_convert: list[str]) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": modules_to_not_convert,
    }


def should_quantize(info: TensorInfo) -> bool:
    """2-D float `.weight` of a projection; not a norm, embedding, router/gate or lm_head."""
    if (
        not info.name.endswith(".weight")
        or len(info.shape) != 2
        or info.dtype not in FLOAT_DTYPES
        or not info.numel
    ):
        return False
    module = info.name.removesuffix(".weight").rsplit(".", 1)[-1]
    return "norm" not in module and "embed" not in module and module not in _KEEP_COMPONENTS


def quantize_blockwise(weight, block: int = BLOCK):
    """(e4m3 tensor, fp32 scale_inv) of a 2-D tensor; scale_inv[i, j] = amax of tile (i, j) / 448."""
    import torch

    weight = weight.contiguous()
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / block), math.ceil(cols / block), dtype=torch.float32)
    step = max(block, (_STRIP_BYTES // max(cols * weight.element_size(), 1)) // block * block)
    for r in range(0, rows, step):
        q[r : r + step], scales[r // block : (r + step) // block + 1] = _quantize_strip(
            weight[r : r + step], block
        )
    return q, scales


def _quantize_strip(strip, block: int):
    import torch

    rows, cols = strip.shape
    prow, pcol = math.ceil(rows / block) * block, math.ceil(cols / block) * block
    x = _scratch("f32", prow * pcol, torch.float32).view(prow, pcol)
    if (prow, pcol) == (rows, cols):
        # max/min of the input dtype are exact, and the scaled copy is one fused pass
        tiles_in = strip.view(prow // block, block, pcol // block, block)
        magnitude = _scratch(f"abs-{strip.dtype}", rows * cols, strip.dtype).view(tiles_in.shape)
        amax = torch.abs(tiles_in, out=magnitude).amax(dim=(1, 3)).float().clamp_(min=_AMAX_FLOOR)
        torch.mul(tiles_in, (E4M3_MAX / amax)[:, None, :, None], out=x.view(tiles_in.shape))
    else:  # zero padding leaves every tile's amax unchanged
        x.zero_()
        x[:rows, :cols] = strip
        tiles = x.view(prow // block, block, pcol // block, block)
        amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg()).clamp_(min=_AMAX_FLOOR)
        tiles.mul_((E4M3_MAX / amax)[:, None, :, None])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    q.copy_(x[:rows, :cols])
    return q, amax / E4M3_MAX


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
    full = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
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


def _strips(info: TensorInfo) -> list[tuple[int, int]]:
    rows, cols = info.shape
    row_bytes = max(cols * info.nbytes // max(info.numel, 1), 1)
    step = max(BLOCK, (_STRIP_BYTES // row_bytes) // BLOCK * BLOCK)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)] or [(0, 0)]


def _read_rows(fd: int, header: ShardHeader, info: TensorInfo, r0: int, r1: int):
    import torch

    cols = info.shape[1]
    item = info.nbytes // max(info.numel, 1)
    nbytes = (r1 - r0) * cols * item
    if not nbytes:
        return torch.empty(0, cols, dtype=torch_dtype(info.dtype))
    buf = _scratch("read", nbytes, torch.uint8)  # valid until this thread's next read
    pread_into(fd, memoryview(buf.numpy()), header.offset(info) + r0 * cols * item, header.path)
    return buf.view(torch_dtype(info.dtype)).view(r1 - r0, cols)


def convert_to_fp8(src: Path, dst: Path, *, workers: int | None = None, progress: Progress | None = None):
    """Write the FP8 form of checkpoint `src` into the empty directory `dst`; return shard records."""
    return _convert(src, dst, _QuantizePlan(), workers, progress)


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
    def layout(self, info: TensorInfo, names: set[str]):
        if not should_quantize(info):
            return None
        rows, cols = info.shape
        return [
            (info.name, "F8_E4M3", info.shape),
            (info.name + SCALE_SUFFIX, "F32", (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))),
        ]

    def work(self, job):
        fd, header, info, r0, r1 = job
        q, scales = _quantize_strip(_read_rows(fd, header, info, r0, r1), BLOCK)
        return [tensor_bytes(q)], scales

    def config(self, config: dict, kept: list[str]) -> dict:
        return {**config, "quantization_config": quantization_config(kept)}


_DEQUANT_DTYPES = ("bfloat16", "float16", "float32")


class _DequantizePlan:
    def __init__(self, dtype: str):
        self.dtype = dtype

    def layout(self, info: TensorInfo, names: set[str]):
        if info.name.endswith(SCALE_SUFFIX) and info.name.removesuffix(SCALE_SUFFIX) in names:
            return []  # folded into its weight
        if info.dtype != "F8_E4M3" or info.name + SCALE_SUFFIX not in names:
            return None
        return [(info.name, DTYPE_OF_TORCH_NAME[self.dtype], info.shape)]

    def work(self, job):
        import torch

        fd, header, info, r0, r1, scale = job
        rows = _read_rows(fd, header, info, r0, r1)
        part = scale[r0 // BLOCK : math.ceil(r1 / BLOCK)]
        return [tensor_bytes(dequantize_blockwise(rows, part, getattr(torch, self.dtype)))], None

    def config(self, config: dict, kept: list[str]) -> dict:
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
        progress.total_tensors = len(names)
    workers = workers or len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallelism comes from the pool; nested OpenMP would oversubscribe
    records, weight_map, kept, total = {}, {}, set(), 0
    closing = {}
    try:
        # A shard's fsync runs on its own thread while the next shard is converted.
        with (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp8") as pool,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync") as syncer,
        ):
            for shard, header in headers.items():
                writer, written = _convert_shard(header, dst / shard, plan, names, pool, workers, progress)
                closing[shard] = syncer.submit(_close, writer)
                for name, dtype, shape, nbytes, converted in written:
                    weight_map[name] = shard
                    total += nbytes
                    if not converted and dtype in FLOAT_DTYPES and len(shape) >= 2:
                        kept.add(_module_pattern(name))
            for shard, future in closing.items():
                records[shard] = FileRecord(*future.result())
    finally:
        torch.set_num_threads(threads)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(
        json.dumps(plan.config(config, sorted(kept)), indent=2, sort_keys=True) + "\n"
    )
    if files.indexed:
        write_index(dst, weight_map, total)
    copy_side_files(src, dst)
    return records


def _convert_shard(header: ShardHeader, out: Path, plan, names, pool, workers, progress):
    import torch

    infos = list(header.tensors.values())
    layouts = {info.name: plan.layout(info, names) for info in infos}
    layout = []
    for info in infos:
        entry = layouts[info.name]
        layout.extend([(info.name, info.dtype, info.shape)] if entry is None else entry)
    writer = ShardWriter(out, layout, header.metadata or {"format": "pt"})
    fd = os.open(header.path, os.O_RDONLY)
    try:
        scales = {}
        if isinstance(plan, _DequantizePlan):
            for info in infos:
                if layouts[info.name] and info.name + SCALE_SUFFIX in header.tensors:
                    s = header.tensors[info.name + SCALE_SUFFIX]
                    scales[info.name] = _read_rows(fd, header, s, 0, s.shape[0]).clone()
                elif layouts[info.name]:
                    raise CheckpointError(
                        f"{header.path}: {info.name}{SCALE_SUFFIX} must sit in the same shard as {info.name}"
                    )

        def jobs():
            for info in infos:
                if layouts[info.name]:
                    for r0, r1 in _strips(info):
                        yield (
                            (fd, header, info, r0, r1, scales[info.name])
                            if scales
                            else (fd, header, info, r0, r1)
                        )

        # Enough strips in flight to keep the workers busy while a write waits on the disk.
        results = ordered_map(pool, plan.work, jobs(), window=4 * workers + 4)
        for info in infos:
            entry = layouts[info.name]
            if entry is None:
                writer.copy_from(info.name, fd, header.offset(info), info.nbytes, header.path)
            elif entry:
                parts = []
                for _ in _strips(info):
                    chunks, scale = next(results)
                    for chunk in chunks:
                        writer.write_part(info.name, chunk)
                    parts.append(scale)
                if parts[0] is not None:
                    writer.write(entry[1][0], tensor_bytes(torch.cat(parts)))
            if progress is not None:
                progress.advance(info.nbytes, 1)
    except BaseException:
        writer.abort()
        raise
    finally:
        os.close(fd)
    written = [
        (name, dtype, shape, _nbytes(dtype, shape), layouts.get(name.removesuffix(SCALE_SUFFIX)) is not None)
        for name, dtype, shape in layout
    ]
    return writer, written


def _close(writer: ShardWriter) -> tuple[int, str]:
    try:
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _nbytes(dtype: str, shape) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


def _module_pattern(name: str) -> str:
    """The module of a tensor, relative to its decoder layer (so one pattern covers all layers)."""
    module = name.rsplit(".", 1)[0]
    m = LAYER_RE.match(module + ".")
    return m.group("rest").rstrip(".") if m else module
