"""Check that a checkpoint directory is the one a recipe expects, before hours of GPU time.

Rules, each reported with the file, the tensor and a fix:
- config: config.json parses; model_type belongs to the family; architectures is the class
  transformers registers for it; num_hidden_layers matches the slice; no auto_map unless
  the plan allows remote code.
- files: every shard the index names exists; each shard's header agrees with its own size
  (truncation) and its offsets with its shapes; index and shards list the same tensors; no
  weights file lies beside them that the index does not name (a loader could read it instead).
- tensors: names and shapes are exactly what the family's transformers class, built on the
  meta device from this config, saves (plus the MTP layers the config declares, which the
  classes do not build); dtypes fit the config (fp32 and fp8 allowed where used).
- values: every float tensor is read once, in bounded windows, and any NaN or Inf is
  reported with the tensor and the index of its first bad value (scan_fraction < 1 samples
  evenly spaced windows instead; 0 reads headers only).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles import families
from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import (
    LAYER_RE,
    expected_architectures,
    family,
    mtp_layers,
    mtp_prefixes,
    num_layers,
    text_config,
)
from miles.ckpt.fp8_rules import SCALE_SUFFIX, geometry_of_scale
from miles.ckpt.shards import (
    DTYPE_OF_TORCH_NAME,
    FLOAT_DTYPES,
    INDEX_NAME,
    SINGLE_SHARD,
    WEIGHT_SUFFIXES,
    ShardHeader,
    checkpoint_file,
    pread_into,
    read_header,
    read_json_file,
    read_weight_map,
    torch_dtype,
)
from miles.ckpt.trim import trimmed_name
from miles.families.schema import ConfigRefused

_MAX_LISTED = 20
_SCAN_WINDOW = 8 << 20  # bytes read at a time by the NaN/Inf scan (one buffer, reused)
# Bits that make a float8 byte NaN (or Inf): e4m3fn has NaN only, e5m2 IEEE-style, e8m0 0xFF.
_F8_SPECIAL = {"F8_E4M3": (0x7F, 0x7F), "F8_E5M2": (0x7C, 0x7C), "F8_E8M0": (0xFF, 0xFF)}
SCANNED_DTYPES = FLOAT_DTYPES | frozenset(_F8_SPECIAL)


@dataclass(frozen=True)
class Finding:
    path: str
    rule: str
    message: str
    tensor: str | None = None

    def __str__(self) -> str:
        where = f"{self.path}: tensor {self.tensor}" if self.tensor else self.path
        return f"{where}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class ValidationReport:
    root: str
    model_type: str
    num_layers: int
    shards: int
    tensors: int
    bytes: int


def validate_checkpoint(
    root: Path | str,
    family_name: str,
    *,
    expect_layers: int | None = None,
    min_layers: int | None = None,
    allow_auto_map: bool = False,
    scan_fraction: float = 1.0,
) -> ValidationReport:
    """Validate `root` for `family_name`; raise CheckpointError listing every problem found.

    expect_layers: num_hidden_layers must equal it (the N of an -Nlayer slice).
    min_layers: num_hidden_layers must be at least it (a source that trim will cut to it);
        only what the slice keeps is checked, so a sliced download may lack the deep shards.
    scan_fraction: share of each float tensor read to look for NaN/Inf: 1 (default) reads
        every value, 0 reads headers only.
    """
    root = Path(root)
    if not 0 <= scan_fraction <= 1:  # NaN fails too: it would scan nothing and say nothing
        raise CheckpointError(
            f"scan_fraction {scan_fraction!r}: give a share from 0 (headers only) to 1 (every value)"
        )
    findings: list[Finding] = []
    config = _check_config(root, family_name, expect_layers, min_layers, allow_auto_map, findings)
    keep = _kept(config, min_layers)
    headers = _check_files(root, findings, keep)
    if config is not None and headers is not None and not findings:
        _check_depth(root, config, headers, min_layers, findings)
    if config is not None and headers is not None and not findings:
        _check_tensors(root, config, headers, findings, keep)
    if config is not None and headers is not None and not findings:
        _check_id_tables(family(family_name), config, headers, findings, keep)
        if scan_fraction > 0 and not findings:
            _scan_nonfinite(headers, scan_fraction, findings, keep)
    if len(findings) == 1:
        raise CheckpointError(f"{root} is not a valid {family_name} checkpoint: {findings[0]}")
    if findings:
        listed = "\n".join(f"  - {f}" for f in findings[:_MAX_LISTED])
        more = f"\n  ... and {len(findings) - _MAX_LISTED} more" if len(findings) > _MAX_LISTED else ""
        raise CheckpointError(
            f"{root} is not a valid {family_name} checkpoint ({len(findings)} problem(s)):\n{listed}{more}"
        )
    assert config is not None and headers is not None
    return ValidationReport(
        str(root),
        config["model_type"],
        num_layers(config) or 0,
        len(headers),
        sum(len(h.tensors) for h in headers.values()),
        sum(t.nbytes for h in headers.values() for t in h.tensors.values()),
    )


def _check_config(root, family_name, expect_layers, min_layers, allow_auto_map, findings) -> dict | None:
    spec = family(family_name)
    path = root / "config.json"
    try:
        config = read_json_file(checkpoint_file(root, "config.json"))
    except OSError as exc:
        findings.append(
            Finding(str(path), "config", f"cannot read config.json ({exc}); is {root} a checkpoint?")
        )
        return None
    except CheckpointError as exc:
        findings.append(Finding(str(path), "config", f"{exc}; is {root} a checkpoint?"))
        return None
    if not isinstance(config, dict):
        findings.append(
            Finding(str(path), "config", "is not a JSON object; is this a checkpoint's config.json?")
        )
        return None
    model_type = config.get("model_type")
    if model_type not in spec.model_types:
        findings.append(
            Finding(
                str(path),
                "model_type",
                f"is {model_type!r}; family {family_name} expects {' or '.join(spec.model_types)}",
            )
        )
        return None
    try:  # before anything reads a number from it: a wrong type or range is one line, not a traceback
        spec.check_config(config)
    except ConfigRefused as exc:
        findings.append(Finding(str(path), "schema", str(exc)))
        return None
    expected = expected_architectures(model_type) or spec.release_architectures
    archs = config.get("architectures") or []
    if not any(a in expected for a in archs):
        findings.append(
            Finding(
                str(path), "architectures", f"is {archs}; {model_type} checkpoints declare {list(expected)}"
            )
        )
    layers = num_layers(config)
    if layers is None:
        findings.append(Finding(str(path), "num_hidden_layers", "is missing"))
    elif expect_layers is not None and layers != expect_layers:
        findings.append(
            Finding(
                str(path),
                "num_hidden_layers",
                f"is {layers} but the model is a {expect_layers}-layer slice; "
                + ("add the trim step to cut it" if layers > expect_layers else "fetch a deeper checkpoint"),
            )
        )
    elif min_layers is not None and layers < min_layers:
        findings.append(
            Finding(
                str(path), "num_hidden_layers", f"is {layers}; cannot cut a {min_layers}-layer slice from it"
            )
        )
    # a family whose release class transformers lacks never runs the remote code: its trunk loads built in
    if config.get("auto_map") and not allow_auto_map and spec.trunk_model_type is None:
        findings.append(
            Finding(
                str(path),
                "auto_map",
                "asks for remote code; miles uses built-in classes (the plan can allow it)",
            )
        )
    return config


def _check_depth(
    root: Path,
    config: dict,
    headers: Mapping[str, ShardHeader],
    keep_layers: int | None,
    findings: list[Finding],
) -> None:
    """Every decoder layer config.json declares (of those a slice keeps) has tensors in the shards,
    checked before the family's class is built for that many layers (a config claiming a million
    layers over two layers' weights would build a million on the meta device)."""
    layers = num_layers(config) or 0
    wanted = layers if keep_layers is None else min(layers, keep_layers)
    present = {int(m["index"]) for h in headers.values() for n in h.tensors if (m := LAYER_RE.match(n))}
    held = sorted(i for i in present if i < wanted)
    if len(held) == wanted:
        return
    missing = next((n for n, i in enumerate(held) if i != n), len(held))
    findings.append(
        Finding(
            str(root / "config.json"),
            "schema",
            f"num_hidden_layers = {layers}: the shards hold no tensors of layer {missing} "
            f"({len(held)} of the {wanted} layers it declares); write the weights' depth, or fetch the missing shards",
        )
    )


def _kept(config: dict | None, keep_layers: int | None):
    """name -> whether a `keep_layers` slice keeps the tensor (everything when not slicing)."""
    total = num_layers(config) if config else None
    if keep_layers is None or total is None:
        return lambda name: True
    return lambda name: trimmed_name(name, keep_layers, total) is not None


def _check_files(root: Path, out: list[Finding], keep) -> dict[str, ShardHeader] | None:
    findings: list[Finding] = []
    try:
        files = read_weight_map(root)
    except CheckpointError as exc:
        out.append(Finding(str(root), "index", str(exc)))
        return None
    listed = set(files.shards)
    for extra in sorted(p.name for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        if extra not in listed:  # a loader may take it for the checkpoint's weights
            where = f"the index {INDEX_NAME} does not list it" if files.indexed else f"beside {SINGLE_SHARD}"
            findings.append(
                Finding(
                    str(root / extra),
                    "unlisted weights",
                    f"weights the checkpoint does not name ({where}); a loader may read them instead: remove it",
                )
            )
    headers: dict[str, ShardHeader] = {}
    needed = {shard for name, shard in files.weight_map.items() if keep(name)}
    for shard in sorted(needed):
        path = root / shard
        if not os.path.exists(path):
            named = sum(1 for v in files.weight_map.values() if v == shard)
            findings.append(
                Finding(
                    str(path),
                    "missing shard",
                    f"the index maps {named} tensors here but the file is absent; fetch again",
                )
            )
            continue
        try:
            headers[shard] = read_header(path)
        except CheckpointError as exc:
            findings.append(Finding(str(path), "header", str(exc).removeprefix(f"{path}: ")))
    for name, shard in files.weight_map.items():
        if shard in headers and name not in headers[shard].tensors:
            findings.append(
                Finding(
                    str(root / shard),
                    "index",
                    f"the index places it in {shard} but that shard lacks it",
                    name,
                )
            )
    for shard, header in headers.items():
        for name in header.tensors:
            if files.weight_map.get(name) != shard:
                where = files.weight_map.get(name)
                said = f"the index says {where}" if where else "the index does not list it"
                findings.append(Finding(str(header.path), "index", f"is in {shard} but {said}", name))
    out.extend(findings)
    return headers if not findings else None


def _check_tensors(
    root: Path, config: dict, headers: Mapping[str, ShardHeader], findings: list[Finding], keep
) -> None:
    on_disk = {name: (h, t) for h in headers.values() for name, t in h.tensors.items() if keep(name)}
    expected, ignore = expected_tensors(config)
    expected = {name: value for name, value in expected.items() if keep(name)}
    quantized = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    declared_name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    declared = DTYPE_OF_TORCH_NAME.get(declared_name, "BF16")
    for name, (shape, is_float) in expected.items():
        if name not in on_disk:
            findings.append(
                Finding(str(root), "missing tensor", "the config implies it but no shard has it", name)
            )
            continue
        header, info = on_disk[name]
        if info.shape != shape:
            findings.append(
                Finding(
                    str(header.path),
                    "shape",
                    f"has shape {list(info.shape)} but this config.json implies {list(shape)}; "
                    "the weights and config.json come from different models",
                    name,
                )
            )
        allowed = {declared, "F32"} | ({"F8_E4M3"} if quantized else set()) if is_float else None
        if allowed is not None and info.dtype not in allowed:
            findings.append(
                Finding(
                    str(header.path), "dtype", f"is {info.dtype}; config dtype allows {sorted(allowed)}", name
                )
            )
        if allowed is None and info.dtype in FLOAT_DTYPES:
            findings.append(
                Finding(str(header.path), "dtype", f"is {info.dtype} where the model keeps integers", name)
            )
    layers, mtp = num_layers(config) or 0, mtp_layers(config)
    spec = families.family_of(config)
    mtp_named = tuple(mtp_prefixes(config, spec.mtp_style if spec else None))
    for name, (header, info) in on_disk.items():
        if name in expected or any(p.search(name) for p in ignore):
            continue
        base = name.removesuffix(SCALE_SUFFIX)
        if quantized and name.endswith(SCALE_SUFFIX) and base in on_disk:
            weight = on_disk[base][1]
            if geometry_of_scale(base, weight.shape, info.shape) is None:
                findings.append(
                    Finding(
                        str(header.path),
                        "shape",
                        f"is {list(info.shape)}, which does not tile {base} {list(weight.shape)} in 128x128 blocks",
                        name,
                    )
                )
            continue
        m = LAYER_RE.match(name)
        if m and layers <= int(m["index"]) < layers + mtp:
            continue  # an MTP layer: the config declares it, the class does not build it
        if mtp_named and name.startswith(mtp_named):
            continue  # the family's MTP block, however it names it (MiMo's model.mtp_layers.*)
        findings.append(
            Finding(str(header.path), "unexpected tensor", "this config's model has no such tensor", name)
        )


def expected_tensors(config: Mapping[str, Any]):
    """{name: (shape, is_float)} the family's class saves for this config, plus ignorable patterns."""
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    # a family whose release class transformers lacks: the class that loads its trunk (MiMo: Qwen2's)
    clean = {
        k: v for k, v in families.trunk_config(config).items() if k not in ("quantization_config", "auto_map")
    }
    cfg = AutoConfig.for_model(**clean)
    arch = next((a for a in clean.get("architectures") or [] if hasattr(transformers, a)), None)
    if arch is None:
        raise CheckpointError(f"no transformers class for architectures {config.get('architectures')}")
    with torch.device("meta"):
        model = getattr(transformers, arch)._from_config(cfg)
    state = model.state_dict()
    for tied in getattr(model, "all_tied_weights_keys", None) or {}:
        state.pop(tied, None)  # a tied weight (lm_head with tie_word_embeddings) is not saved
    state = revert_weight_conversion(model, state)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    return {k: (tuple(v.shape), v.is_floating_point()) for k, v in state.items()}, ignore


def _check_id_tables(
    spec, config: dict, headers: Mapping[str, ShardHeader], findings: list[Finding], keep
) -> None:
    """The family's id tables (DeepSeek-V4's tid2eid): an integer dtype its loaders hold, every
    entry an id in [0, count), no row naming an id twice. Read whole (vocab x top-k integers)."""

    for suffix, key, dtypes in spec.id_tables:
        count = text_config(config).get(key)
        for header in headers.values():
            for name, info in header.tensors.items():
                if not name.endswith(suffix) or not keep(name):
                    continue
                if info.dtype not in dtypes:
                    findings.append(
                        Finding(
                            str(header.path), "dtype",
                            f"is {info.dtype}; an id table is {' or '.join(dtypes)} (its loaders hold those)", name,
                        )
                    )  # fmt: skip
                    continue
                rule = _id_table_problem(header, info, count, key)
                if rule:
                    findings.append(Finding(str(header.path), "ids", rule, name))


def _id_table_problem(header: ShardHeader, info, count: int, key: str) -> str | None:
    import torch

    table = torch.empty(info.nbytes, dtype=torch.uint8)
    fd = os.open(header.path, os.O_RDONLY)
    try:
        pread_into(fd, memoryview(table.numpy()), header.offset(info), header.path)
    finally:
        os.close(fd)
    table = table.view(torch_dtype(info.dtype)).reshape(info.shape).long()
    if table.ndim != 2:
        return f"has shape {list(info.shape)}; an id table is [tokens, ids per token]"
    bad = ((table < 0) | (table >= count)).nonzero()
    if len(bad):
        row, col = (int(v) for v in bad[0])
        return (
            f"row {row} names {int(table[row, col])}, outside 0..{count - 1} ({key} = {count}); "
            "the table and config.json come from different models"
        )
    ordered = table.sort(dim=1).values
    twice = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1).nonzero()
    if len(twice):
        row = int(twice[0])
        return (
            f"row {row} names an expert twice ({table[row].tolist()}); each token's ids are distinct "
            "(a routing map cannot send a token to one expert twice): the table is corrupt"
        )
    return None


def _scan_nonfinite(
    headers: Mapping[str, ShardHeader], fraction: float, findings: list[Finding], keep
) -> None:
    """Read `fraction` of each float tensor (all of it at 1.0) in bounded windows; report NaN/Inf."""
    import torch

    buf = torch.empty(_SCAN_WINDOW, dtype=torch.uint8)
    for header in headers.values():
        fd = os.open(header.path, os.O_RDONLY)
        try:
            for info in header.tensors.values():
                if info.dtype not in SCANNED_DTYPES or info.nbytes == 0 or not keep(info.name):
                    continue
                bad = _first_nonfinite(fd, header, info, fraction, buf)
                if bad is not None:
                    index, value = bad
                    findings.append(
                        Finding(
                            str(header.path),
                            "nan/inf",
                            f"{value} at index {index}; the weights are broken (a NaN/Inf never trains "
                            "back out): fetch the checkpoint again or repair it",
                            info.name,
                        )
                    )
        finally:
            os.close(fd)


def _windows(info, fraction: float) -> list[tuple[int, int]]:
    """(byte offset, length) of the windows to read: all of the tensor, or evenly spaced ones."""
    item = info.nbytes // info.numel
    window = max(item, _SCAN_WINDOW - _SCAN_WINDOW % item)
    if fraction >= 1:
        return [(start, min(window, info.nbytes - start)) for start in range(0, info.nbytes, window)]
    window = min(window, info.nbytes)
    count = min(info.nbytes // window, max(1, math.ceil(fraction * info.nbytes / window)))
    stride = (info.nbytes - window) // max(count - 1, 1)
    return [((i * stride) // item * item, window) for i in range(count)]


def _first_nonfinite(fd: int, header: ShardHeader, info, fraction: float, buf):
    """([index], "NaN" | "+Inf" | "-Inf") of the first non-finite value read, or None."""
    import torch

    item = info.nbytes // info.numel
    for start, length in _windows(info, fraction):
        raw = buf[:length]
        pread_into(fd, memoryview(raw.numpy()), header.offset(info) + start, header.path)
        if info.dtype in _F8_SPECIAL:
            mask, special = _F8_SPECIAL[info.dtype]
            hits = torch.bitwise_and(raw, mask) == special
            if not bool(hits.any()):
                continue
            pos = int(hits.nonzero()[0])
            kind = (
                "NaN"
                if info.dtype != "F8_E5M2" or raw[pos] & 0x03
                else ("-Inf" if raw[pos] & 0x80 else "+Inf")
            )
        else:
            values = raw.view(torch_dtype(info.dtype))
            low, high = torch.aminmax(values)  # NaN and Inf propagate: one fast pass per window
            if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
                continue
            pos = int((~torch.isfinite(values)).nonzero()[0])
            value = float(values[pos])
            kind = "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")
        return _unravel(start // item + pos, info.shape), kind
    return None


def _unravel(flat: int, shape) -> list[int]:
    index = []
    for dim in reversed(tuple(shape)):
        flat, rest = divmod(flat, dim)
        index.append(rest)
    return index[::-1]
