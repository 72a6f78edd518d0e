"""Cut an N-layer slice out of a deeper checkpoint (the 4- or 5-layer CI models).

Layers below N are kept byte for byte; layers N..L-1 are dropped; layers numbered past the
config's L (multi-token-prediction layers in DeepSeek-style checkpoints) are renumbered to
follow the slice, so the slice keeps its MTP head. Every tensor outside the decoder layers
(embeddings, final norm, lm_head, vision/audio towers) is kept. config.json gets
num_hidden_layers = N and its per-layer lists cut to N; the index is rewritten; shards left
empty are dropped and the rest renamed model-0000i-of-0000n.safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import LAYER_LIST_KEYS, LAYER_RE, num_layers
from miles.ckpt.manifest import FileRecord
from miles.ckpt.progress import Progress
from miles.ckpt.shards import (
    ShardWriter,
    copy_side_files,
    read_header,
    read_json_file,
    read_weight_map,
    write_index,
)
from miles.files import replace_file


def trimmed_name(name: str, keep: int, total: int) -> str | None:
    """The tensor's name in a `keep`-layer slice of a `total`-layer checkpoint, or None if dropped."""
    m = LAYER_RE.match(name)
    if not m:
        return name
    index = int(m.group("index"))
    if index < keep:
        return name
    if index < total:
        return None
    return f"{m.group('prefix')}.{index - total + keep}.{m.group('rest')}"


def trim_config(config: Mapping[str, Any], keep: int) -> dict[str, Any]:
    """config.json of the slice: layer count and every per-layer list cut to `keep`."""
    config = json.loads(json.dumps(config))
    target = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    target["num_hidden_layers"] = keep
    for key in LAYER_LIST_KEYS:
        if isinstance(target.get(key), list):
            target[key] = target[key][:keep]
    for key in ("mlp_only_layers", "local_layer_ids"):
        if isinstance(target.get(key), list):
            target[key] = [i for i in target[key] if i < keep]
    return config


def trim_checkpoint(
    src: Path, dst: Path, keep: int, *, progress: Progress | None = None
) -> dict[str, FileRecord]:
    """Write the `keep`-layer slice of `src` into the (empty) directory `dst`; return its shard records."""
    src, dst = Path(src), Path(dst)
    config = read_json_file(src / "config.json")
    total = num_layers(config)
    if total is None or keep > total:
        raise CheckpointError(f"{src}/config.json: has {total} layers; cannot cut a {keep}-layer slice")
    files = read_weight_map(src)
    kept: dict[str, list[tuple[str, str]]] = {}  # source shard -> [(old name, new name)]
    for name, shard in files.weight_map.items():
        new = trimmed_name(name, keep, total)
        if new is not None:
            kept.setdefault(shard, []).append((name, new))
    shards = sorted(kept)
    rename = {
        s: s if not files.indexed else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        for i, s in enumerate(shards, 1)
    }
    headers = {s: read_header(src / s) for s in shards}
    if progress is not None:
        progress.total_bytes = sum(headers[s].tensors[old].nbytes for s in shards for old, _ in kept[s])
        progress.total_tensors = sum(len(v) for v in kept.values())
    records: dict[str, FileRecord] = {}
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in shards:
        header = headers[shard]
        order = sorted(kept[shard], key=lambda pair: header.tensors[pair[0]].begin)
        layout = [(new, header.tensors[old].dtype, header.tensors[old].shape) for old, new in order]
        writer = ShardWriter(dst / rename[shard], layout, header.metadata)
        fd = os.open(header.path, os.O_RDONLY)
        try:
            for old, new in order:
                info = header.tensors[old]
                writer.copy_from(new, fd, header.offset(info), info.nbytes, header.path)
                weight_map[new] = rename[shard]
                total_size += info.nbytes
                if progress is not None:
                    progress.advance(info.nbytes, 1)
            size, digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            os.close(fd)
        records[rename[shard]] = FileRecord(size, digest)
    replace_file(
        dst / "config.json", (json.dumps(trim_config(config, keep), indent=2, sort_keys=True) + "\n").encode()
    )
    if files.indexed:
        write_index(dst, weight_map, total_size)
    copy_side_files(src, dst)
    return records
