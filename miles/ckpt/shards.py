"""Safetensors shards read and written without loading them: headers, index, streaming writer.

The steps move tens to hundreds of GB, so they never hold a shard in memory: they read a
header (a few KB), then each tensor's bytes at its offset, and write output shards
tensor by tensor with the header first (every size is known in advance). The format is
safetensors': u64 little-endian header length, a JSON header padded with spaces to 8
bytes, then the tensors' bytes back to back in header order.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import stat
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from miles.ckpt.errors import CheckpointError
from miles.files import FileRefused, create_new, read_regular, replace_file, resolve_inside

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
# config.json's dtype (torch's name) -> the safetensors name of the same float type
DTYPE_OF_TORCH_NAME = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_COPY_CHUNK = 16 * 1024 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    data_start: int  # file offset of the data section
    file_size: int
    tensors: Mapping[str, TensorInfo]  # in data order
    metadata: Mapping[str, str]

    def offset(self, info: TensorInfo) -> int:
        return self.data_start + info.begin


def read_header(path: Path | str) -> ShardHeader:
    """Parse and check a shard's header against its own size; never reads tensor data.

    Every field is checked for type and size before any arithmetic on it (the rules of
    safetensors' own reader, huggingface/safetensors safetensors/src/tensor.rs
    `Metadata::validate`, plus what torch can hold), so a crafted header is one line, fast."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(
                f"{path}: not a regular file (a FIFO, device or folder); a shard must be one"
            )
        size = info.st_size
        prefix = os.pread(fd, 8, 0)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{path}: header length field says {n} bytes but the file has {size}; "
                "the shard is truncated or not safetensors; fetch it again"
            )
        raw = bytearray(n)
        pread_into(fd, memoryview(raw), 8, path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from exc
    finally:
        os.close(fd)
    header = _parse_header_json(path, bytes(raw))
    metadata = _metadata(path, header.pop("__metadata__", None))
    infos = sorted((_tensor_info(path, name, entry) for name, entry in header.items()), key=lambda t: t.begin)
    expected = 0
    for info in infos:
        if info.begin != expected:
            what = "overlaps the previous tensor" if info.begin < expected else "leaves a gap before it"
            raise CheckpointError(
                f"{path}: tensor {info.name} starts at data offset {info.begin}, which {what} "
                f"(expected {expected}); header and offsets disagree, the shard is corrupt"
            )
        expected = info.end
    data_start = 8 + n
    if data_start + expected != size:
        state = "truncated" if data_start + expected > size else "longer than its header says"
        raise CheckpointError(
            f"{path}: file is {size} bytes but its header ends the data at {data_start + expected}; "
            f"the shard is {state}; fetch it again"
        )
    return ShardHeader(path, data_start, size, {t.name: t for t in infos}, metadata)


MAX_RANK = 64  # no model tensor comes near it; a header claiming more is crafted or corrupt
MAX_NUMEL_BYTES = 2**63  # torch sizes, strides and storage offsets are int64


def _parse_header_json(path: Path, raw: bytes) -> dict:
    if not raw.lstrip(b" ").startswith(b"{"):
        raise CheckpointError(f"{path}: header is not a JSON object; the shard is not safetensors")
    try:
        header = json.loads(raw)
    except RecursionError:
        raise CheckpointError(
            f"{path}: header is nested too deeply to be a safetensors header; the shard is corrupt"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}); fetch the shard again") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    return header


def _metadata(path: Path, metadata: object) -> dict[str, str]:
    """`__metadata__`: absent, null or a map of strings to strings (safetensors' own type)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        shown = type(metadata).__name__ if not isinstance(metadata, dict) else "a map with non-string values"
        raise CheckpointError(
            f"{path}: __metadata__ is {shown}; safetensors allows only a map of strings to strings"
        )
    return dict(metadata)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _tensor_info(path: Path, name: str, entry: object) -> TensorInfo:
    shown = name if name.isprintable() and len(name) <= 200 else repr(name[:200])
    where = f"{path}: tensor {shown}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        shown = repr(dtype) if isinstance(dtype, str | int | float | None) else type(dtype).__name__
        raise CheckpointError(f"{where}: unknown dtype {shown[:40]}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        rank = f"{len(shape)} dimensions" if isinstance(shape, list) else type(shape).__name__
        raise CheckpointError(f"{where}: shape is {rank}; a shape is a list of at most {MAX_RANK} sizes")
    if not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {_short(shape)} must hold whole numbers from 0 to 2**64-1")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(
            f"{where}: data_offsets {_short(offsets)} must be two whole numbers [begin, end]"
        )
    if offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: data_offsets {offsets} end before they begin; the shard is corrupt")
    span = DTYPE_SIZES[dtype]
    for d in shape:  # checked as it grows: a huge product never gets computed
        span *= max(d, 1)
        if span >= MAX_NUMEL_BYTES:
            raise CheckpointError(
                f"{where}: shape {_short(shape)} of {dtype} overflows a 64-bit size (torch cannot hold it); "
                "the header is corrupt"
            )
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    if info.numel * DTYPE_SIZES[dtype] != info.nbytes:
        raise CheckpointError(
            f"{where}: shape {list(shape)} of {dtype} needs {info.numel * DTYPE_SIZES[dtype]} "
            f"bytes but data_offsets span {info.nbytes}; header and offsets disagree"
        )
    return info


def _short(value: object) -> str:
    text = repr(value) if isinstance(value, list | int | float | str | None) else type(value).__name__
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


@dataclass(frozen=True)
class WeightFiles:
    """Where each tensor of a checkpoint directory lives."""

    root: Path
    weight_map: Mapping[str, str]  # tensor name -> shard file name
    indexed: bool  # True when model.safetensors.index.json exists

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.weight_map.values())))


MAX_INDEX_BYTES = 256 << 20  # an index lists tensor names; the largest hub models' are a few MB
MAX_JSON_BYTES = 64 << 20  # config.json and the other small JSON files of a checkpoint


def link_scope(root: Path | str) -> Path:
    """Where the files of checkpoint `root` may point through symlinks: the folder itself, or
    for a Hugging Face cache snapshot (<repo>/snapshots/<revision>) the repository folder,
    whose blobs/ its links name."""
    root = Path(root)
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return root.parent.parent
    return root


def checkpoint_file(root: Path | str, entry: object, *, named_by: Path | str | None = None) -> Path:
    """The file `entry` (a name read from the checkpoint's own files) inside `root`; a
    CheckpointError naming `named_by` when it is absolute, climbs out with '..', or is a
    symlink leaving the checkpoint (miles.files.resolve_inside)."""
    try:
        return resolve_inside(root, entry, what="file", links_within=link_scope(root))
    except FileRefused as exc:
        source = f"{named_by}: " if named_by else f"{root}: "
        raise CheckpointError(f"{source}{exc}; the checkpoint is corrupt or crafted") from None


def read_json_file(path: Path | str, limit: int = MAX_JSON_BYTES):
    """A checkpoint's JSON file (config.json, the index), read only if it is a regular file
    of at most `limit` bytes: a FIFO or /dev/zero under that name is refused, not read."""
    try:
        raw = read_regular(path, limit)
    except FileRefused as exc:
        raise CheckpointError(f"{exc}; replace it with the checkpoint's own file") from None
    try:
        return json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{path}: nested too deeply to be a checkpoint's JSON file") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def read_weight_map(root: Path | str) -> WeightFiles:
    """The index's weight map, or the single shard's tensor list when there is no index.

    Every shard name the index gives must name a file inside `root` (checkpoint_file)."""
    root = Path(root)
    index = root / INDEX_NAME
    if os.path.lexists(index):  # a FIFO or device there is refused by name, never taken as absent
        data = read_json_file(checkpoint_file(root, INDEX_NAME), MAX_INDEX_BYTES)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{index}: not a safetensors index: its weight_map must map tensor names to shard file names"
            )
        for shard in sorted(set(weight_map.values())):
            checkpoint_file(root, shard, named_by=index)
        return WeightFiles(root, dict(weight_map), True)
    single = root / SINGLE_SHARD
    if single.is_file():
        checkpoint_file(root, SINGLE_SHARD)
        return WeightFiles(root, {name: SINGLE_SHARD for name in read_header(single).tensors}, False)
    raise CheckpointError(
        f"{root}: no {INDEX_NAME} and no {SINGLE_SHARD}; this is not a safetensors checkpoint"
    )


def write_index(root: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """Write the index; total_size is the sum of the tensors' bytes, as transformers writes it."""
    data = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    replace_file(Path(root) / INDEX_NAME, (json.dumps(data, indent=2) + "\n").encode())


def torch_dtype(name: str):
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
        "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
        "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E8M0": torch.float8_e8m0fnu,
    }[name]  # fmt: skip


def read_tensor(fd: int, header: ShardHeader, info: TensorInfo):
    """One tensor as a torch tensor that owns its memory (read with pread, not mmap)."""
    import torch

    buf = torch.empty(info.nbytes, dtype=torch.uint8)  # not zero-filled: pread overwrites it all
    if info.nbytes:
        pread_into(fd, memoryview(buf.numpy()), header.offset(info), header.path)
    return buf.view(torch_dtype(info.dtype)).reshape(info.shape)


def pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(
                f"{path}: ended while reading at byte {offset + done}; the shard is truncated"
            )
        done += n


def tensor_bytes(tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    import torch

    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class _Hasher:
    """sha256 of a byte stream, computed on its own thread so it overlaps the writes.

    Chunks are queued by reference: a caller must not modify a chunk after handing it over.
    """

    def __init__(self):
        self._hash = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._hash.update(chunk)

    def update(self, chunk) -> None:
        self._queue.put(chunk)

    def hexdigest(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._hash.hexdigest()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class ShardWriter:
    """Writes one shard tensor by tensor in a fixed order, hashing as it goes.

    The layout (name, dtype, shape) is given up front so the header can be written first;
    each `write`/`copy_from` must then come in layout order with exactly the declared size.
    Data handed to `write`/`write_part` must not change afterwards (it is hashed on another
    thread). `close` fsyncs and returns (size, sha256) for the step's manifest.
    """

    def __init__(self, path: Path, layout: Iterable[tuple[str, str, tuple[int, ...]]], metadata=None):
        self.path = Path(path)
        entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        self._sizes: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in layout:
            n = DTYPE_SIZES[dtype]
            for d in shape:
                n *= d
            entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._sizes.append((name, n))
            offset += n
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._hash = _Hasher()
        # A new file renamed into place at close: never written through a link or a hard
        # link someone left under the final name (a fetched shard shares its inode with the source)
        self._tmp = self.path.with_name(f".{self.path.name}.writing")
        self._file = create_new(self._tmp)
        self._size = 0
        self._next = 0
        self._filled = 0
        self._emit(len(raw).to_bytes(8, "little") + raw)

    def _emit(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as exc:  # name the file: ENOSPC/EFBIG from write() carry no path
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        self._hash.update(data)
        self._size += len(data)

    def write_part(self, name: str, data) -> None:
        """Append bytes to tensor `name`; a tensor may arrive in several parts, in layout order."""
        data = memoryview(data).cast("B")
        want, size = self._sizes[self._next] if self._next < len(self._sizes) else (None, 0)
        if name != want or self._filled + len(data) > size:
            raise CheckpointError(
                f"{self.path}: got {len(data)} B for {name} where the layout expects "
                f"{want} ({size - self._filled} B left)"
            )
        self._emit(data)
        self._filled += len(data)
        if self._filled == size:
            self._next += 1
            self._filled = 0

    def write(self, name: str, data) -> None:
        """Write tensor `name` whole."""
        self.write_part(name, data)
        if self._filled:
            raise CheckpointError(f"{self.path}: {name} is larger than {len(memoryview(data).cast('B'))} B")

    def copy_from(self, name: str, fd: int, offset: int, nbytes: int, src: Path) -> None:
        """Copy a tensor's bytes verbatim from another shard (no decode, bounded buffer)."""
        if nbytes == 0:
            self.write(name, b"")
            return
        done = 0
        while done < nbytes:
            view = memoryview(bytearray(min(_COPY_CHUNK, nbytes - done)))  # fresh: the hasher holds the last
            pread_into(fd, view, offset + done, src)
            self.write_part(name, view)
            done += len(view)

    def close(self) -> tuple[int, str]:
        if self._next != len(self._sizes) or self._filled:
            self.abort()
            raise CheckpointError(f"{self.path}: closed after {self._next} of {len(self._sizes)} tensors")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        self._file.close()
        os.replace(self._tmp, self.path)
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        self._hash.stop()
        try:
            self._file.close()
        except OSError:
            pass  # the flush of a failed write fails again
        self._tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_side_files(src: Path, dst: Path, skip: tuple[str, ...] = ("config.json",)) -> None:
    """Copy tokenizer, generation config and other small files; never weights, the index or
    hidden files. Each is read only from inside `src` and written as a new file in `dst`."""
    for path in sorted(Path(src).iterdir()):
        name = path.name
        if (
            not path.is_file()
            or name in skip
            or name == INDEX_NAME
            or name.endswith(WEIGHT_SUFFIXES)
            or name.startswith(".")
            or os.path.lexists(Path(dst) / name)
        ):
            continue
        checkpoint_file(src, name)
        tmp = Path(dst) / f".{name}.writing"
        try:
            with open(path, "rb") as fin, create_new(tmp) as fout:
                shutil.copyfileobj(fin, fout, _COPY_CHUNK)
            os.replace(tmp, Path(dst) / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


class CheckpointReader:
    """Read tensors of a checkpoint directory by name, one at a time (files opened once)."""

    def __init__(self, root: Path | str):
        self.files = read_weight_map(root)
        self._headers: dict[str, ShardHeader] = {}
        self._fds: dict[str, int] = {}

    def info(self, name: str) -> tuple[ShardHeader, TensorInfo]:
        shard = self.files.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.files.root}: no tensor {name} in the checkpoint")
        if shard not in self._headers:
            self._headers[shard] = read_header(self.files.root / shard)
            self._fds[shard] = os.open(self.files.root / shard, os.O_RDONLY)
        header = self._headers[shard]
        if name not in header.tensors:
            raise CheckpointError(f"{header.path}: the index places {name} here but the shard lacks it")
        return header, header.tensors[name]

    def read(self, name: str):
        header, info = self.info(name)
        return read_tensor(self._fds[self.files.weight_map[name]], header, info)

    def read_rows(self, name: str, start: int, stop: int, out=None):
        """Rows [start, stop) of a tensor (elements of a 1-D one), read straight into `out` if given.

        `out` must be contiguous with the tensor's dtype and row shape; the bytes go there
        without an intermediate copy.
        """
        import torch

        header, info = self.info(name)
        rows = info.shape[0] if info.shape else 1
        row_bytes = info.nbytes // rows if rows else 0
        shape = (stop - start, *info.shape[1:])
        if not 0 <= start <= stop <= rows:
            raise CheckpointError(
                f"{header.path}: tensor {name} has {rows} rows; rows {start}:{stop} do not exist"
            )
        if out is None:
            out = torch.empty(shape, dtype=torch_dtype(info.dtype))
        if tuple(out.shape) != shape or out.dtype != torch_dtype(info.dtype) or not out.is_contiguous():
            raise CheckpointError(
                f"{header.path}: tensor {name} rows {start}:{stop} are {info.dtype} {list(shape)}"
            )
        if out.numel():
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            pread_into(
                view=view,
                fd=self._fds[self.files.weight_map[name]],
                offset=header.offset(info) + start * row_bytes,
                path=header.path,
            )
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
