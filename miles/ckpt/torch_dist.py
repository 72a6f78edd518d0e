"""Hugging Face weights -> Megatron `torch_dist` checkpoint, written and verified on CPU.

Layout (what Megatron-LM's `--load` with `--ckpt-format torch_dist` reads):
    <dir>/release/__0_0.distcp, .metadata   torch.distributed.checkpoint data and index
    <dir>/release/metadata.json             {"sharded_backend": "torch_dist", ...}
    <dir>/release/common.pt                 non-tensor state, with the `args` Megatron-LM reads
    <dir>/latest_checkpointed_iteration.txt "release", written last: the done marker

The families megatron-core builds here (`miles.families`: every shipped one) are written in
their megatron model's own sharded keys (the TE-shaped layer spec's model produces them, so
they match what a TE model on GPU loads). A family it does not build is stored under its
Hugging Face names in the same container. megatron-core's save path synchronises
CUDA, so the tensors are translated with megatron's own functions and written with
torch.distributed.checkpoint's synchronous writer; a world of one process over an in-memory
store stands in for the training job (no network). After writing, the checkpoint is
loaded back with megatron-core's dist_checkpointing and compared tensor by tensor. Every
megatron-core call goes through the adapter, `miles.megatron`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles import phases
from miles.ckpt.errors import CheckpointError, full_disk_error
from miles.ckpt.families import family, writes_megatron_keys
from miles.ckpt.progress import Progress, say
from miles.ckpt.shards import FLOAT_DTYPES, CheckpointReader, read_json_file, torch_dtype
from miles.families.transformer import megatron_lm_args
from miles.megatron.checkpoint import RELEASE, SHARDED_METADATA, TRACKER, single_process_group

__all__ = ["RELEASE", "SHARDED_METADATA", "TRACKER", "convert_to_torch_dist"]

_COMMON = {"checkpoint_version": 3.0, "iteration": 0, "content_metadata": SHARDED_METADATA}
_COMMON_KEYS = (*_COMMON, "miles", "args")


def convert_to_torch_dist(
    src: Path,
    dst: Path,
    family_name: str,
    *,
    vocab_multiple: int = 1,
    verify: bool = True,
    progress: Progress | None = None,
) -> None:
    """Write the torch_dist form of HF checkpoint `src` into the empty directory `dst`.

    vocab_multiple pads the embedding and output rows (with zeros) to a multiple, as
    Megatron-LM's --make-vocab-size-divisible-by x TP does; 1 keeps the HF vocabulary.
    """
    with phases.phase(phases.CHECKPOINT):
        _convert(src, dst, family_name, vocab_multiple=vocab_multiple, verify=verify, progress=progress)


def _convert(
    src, dst, family_name: str, *, vocab_multiple: int, verify: bool, progress: Progress | None
) -> None:
    src, dst = Path(src), Path(dst)
    gpt = writes_megatron_keys(family_name)
    with _mapped({}):
        config = _config(src, gpt, family_name)
    with _quiet(), _mapped(config), single_process_group(), CheckpointReader(src) as reader, _on_cpu(gpt):
        _refuse_quantized(src, config, reader)
        if progress is not None:
            progress.total_bytes = sum(reader.info(n)[1].nbytes for n in reader.files.weight_map)
            progress.total_tensors = len(reader.files.weight_map)
        vocab = _padded_vocab(config, vocab_multiple)
        if gpt:
            from miles.families.model import build_model
            from miles.megatron.checkpoint import gpt_state

            model = build_model(config, vocab)
            left = _fill_gpt(model, config, reader, vocab, progress)
            if left:
                say(f"torch_dist: {src} {left}")
            sharded = gpt_state(model)
        else:
            sharded = _hf_named_state(reader, progress)
        release = dst / RELEASE
        release.mkdir()
        layout = "megatron-gpt" if gpt else "hf-names"
        common = {**_COMMON, "miles": {"layout": layout, "model_type": config["model_type"]}}
        if gpt:  # only a GPT layout is a checkpoint Megatron-LM can load
            common["args"] = megatron_lm_args(config, vocab, vocab_multiple)
        _save(sharded, common, release)
        del sharded
        if gpt:
            del model
        if verify:
            _verify(release, config, reader, gpt, vocab)
    (dst / TRACKER).write_text(RELEASE)


def _config(hf_dir: Path, gpt: bool, family_name: str | None = None) -> dict:
    """config.json of `hf_dir`, checked against the schema of `family_name` (default: the family
    its model_type names) before any arithmetic on it; for a family megatron-core builds, the
    decoder's config as the family reads it (miles.families.decoder_config)."""
    from miles.families import decoder_config, family_of
    from miles.families.schema import ConfigRefused

    path = Path(hf_dir) / "config.json"
    raw = read_json_file(path)
    spec = family(family_name) if family_name else family_of(raw) if isinstance(raw, Mapping) else None
    try:
        if spec is not None:
            spec.check_config(raw)
    except ConfigRefused as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return decoder_config(raw) if gpt else raw


@contextmanager
def _mapped(config: Mapping[str, Any]) -> Iterator[None]:
    """The adapter's refusals of a config (and of a checkpoint) as checkpoint errors."""
    from miles.families import UnmappedModel
    from miles.megatron.checkpoint import CheckpointMismatch

    try:
        yield
    except (UnmappedModel, CheckpointMismatch) as exc:
        raise CheckpointError(f"torch_dist: {exc}") from exc


@contextmanager
def _on_cpu(gpt: bool) -> Iterator[None]:
    """The conversion's megatron-core work (build, fill, save, load back, logit check) runs on the
    CPU on every machine: megatron-core otherwise places parts of it on a visible GPU."""
    if not gpt:
        yield
        return
    from miles.megatron.compat import cpu_placed

    with cpu_placed():
        yield


@contextmanager
def _quiet() -> Iterator[None]:
    """No warnings: megatron warns (also while it is imported) about CUDA extensions it cannot use here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _refuse_quantized(src: Path, config: Mapping[str, Any], reader: CheckpointReader) -> None:
    """An FP8 checkpoint holds float8 blocks and their scales, not weights: megatron's parameters
    (and an HF-named torch_dist) would get the float8 values cast without their scales. Refused
    before anything is written, with the step that makes a convertible copy."""
    qconfig = config.get("quantization_config")
    method = qconfig.get("quant_method") if isinstance(qconfig, Mapping) else qconfig
    quantized = sorted(n for n in reader.files.weight_map if reader.info(n)[1].dtype.startswith("F8_"))
    if method is None and not quantized:
        _refuse_integer_weights(src, reader)
        return
    held = f"quantization_config quant_method {method!r}" if method else "no quantization_config"
    example = f"; {quantized[0]} is {reader.info(quantized[0])[1].dtype}" if quantized else ""
    raise CheckpointError(
        f"{src}: a quantized checkpoint ({held}{example}, {len(quantized)} float8 tensor(s)); torch_dist needs "
        f"the weights themselves, not float8 blocks and their scales: write a bf16 copy with "
        f"`python -m miles.ckpt dequantize {src} <dir>` and convert that"
    )


def _refuse_integer_weights(src: Path, reader: CheckpointReader) -> None:
    """A weight or bias is a float tensor: one stored as integers (FP8 or other quantized bytes
    relabelled as U8, a corrupt header) would be cast value by value into megatron's parameters."""
    for name in sorted(reader.files.weight_map):
        dtype = reader.info(name)[1].dtype
        if name.endswith((".weight", ".bias")) and dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{reader.info(name)[0].path}: tensor {name} is {dtype}, but a weight is a float tensor "
                "(quantized bytes relabelled as integers, or a corrupt header); torch_dist would cast its "
                f"integer values into megatron's parameters: fetch {src} again, or dequantize an FP8 source"
            )


def _padded_vocab(config: Mapping[str, Any], multiple: int) -> int:
    vocab = config["vocab_size"]
    return -(-vocab // multiple) * multiple


def _layout(config, reader: CheckpointReader):
    """The family's weight layout with each piece named as this checkpoint names its tensor (a
    family whose published files spell names or stack tensors another way resolves them: its
    `source_piece`)."""
    from miles.families import megatron_family

    family = megatron_family(config)
    present = reader.files.weight_map
    for name, pieces in family.weights(config):
        yield name, tuple(family.source_piece(p, present) for p in pieces)


def _fill_gpt(model, config, reader: CheckpointReader, vocab: int, progress: Progress | None) -> str:
    """Read every HF row block straight into its place in the megatron parameters; what the
    checkpoint holds that the model leaves out, in words ("" if nothing)."""
    import torch

    params = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    seen = set()
    read = set()  # HF tensors read so far (q/k/v and gate/up arrive in several pieces)
    with torch.no_grad():
        for name, pieces in _layout(config, reader):
            target = _target(params, name, pieces, reader)
            for piece in pieces:
                dst = piece.of_megatron(target)
                _same_kind(dst, reader, piece.hf_name, name)
                if (
                    piece.index is not None or piece.step != 1 or piece.dim
                ):  # a sub-tensor's, strided, columns
                    dst.copy_(_read_piece(reader, piece))
                elif dst.dtype == torch_dtype(reader.info(piece.hf_name)[1].dtype):
                    reader.read_rows(piece.hf_name, piece.start, piece.stop, out=dst)
                else:  # e.g. fp32 norms in a bf16 checkpoint: megatron keeps one dtype
                    dst.copy_(reader.read_rows(piece.hf_name, piece.start, piece.stop))
                if progress is not None:
                    progress.advance(dst.numel() * dst.element_size(), int(piece.hf_name not in read))
                read.add(piece.hf_name)
            target[_rows(pieces, target) :].zero_()  # padded vocabulary rows
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"torch_dist: the HF weights give no value for megatron's {missing[:5]}")
    return left_out(config, sorted(set(reader.files.weight_map) - read))


def left_out(config, names: list[str]) -> str:
    """One line naming the checkpoint tensors the conversion did not read, grouped by what its
    family says they are ("" if none)."""
    from miles.families import megatron_family

    if not names:
        return ""
    groups: dict[str, int] = {}
    for name in names:
        what = next(
            (
                f"{what} ({prefix}*)"
                for prefix, what in megatron_family(config).not_decoder
                if name.startswith(prefix)
            ),
            "tensors the megatron model has no place for: " + name,
        )
        groups[what] = groups.get(what, 0) + 1
    parts = ", ".join(f"{what}: {count} tensor(s)" for what, count in groups.items())
    return f"left out of the megatron checkpoint (not part of the decoder it builds): {parts}"


def _same_kind(dst, reader: CheckpointReader, hf_name: str, name: str) -> None:
    """A float parameter is filled from a float tensor, an integer buffer from an integer one."""
    header, info = reader.info(hf_name)
    if torch_dtype(info.dtype).is_floating_point != dst.is_floating_point():
        kind = "a float" if dst.is_floating_point() else "an integer"
        raise CheckpointError(
            f"{header.path}: tensor {hf_name} is {info.dtype}, but megatron's {name} is {kind} tensor; "
            "the checkpoint's dtypes are not the model's (a relabelled or corrupt tensor)"
        )


def _target(params, name: str, pieces, reader: CheckpointReader):
    """The megatron parameter `name`, checked against the HF tensors that fill it."""
    target = params.get(name)
    rows = None if target is None else _rows(pieces, target)
    padded = name in ("embedding.word_embeddings.weight", "output_layer.weight")
    if target is None or rows > target.shape[0] or (rows != target.shape[0] and not padded):
        want = None if target is None else list(target.shape)
        raise CheckpointError(f"torch_dist: {name} needs {want}; the HF weights give {rows} rows")
    columns = sum(p.rows for p in pieces if p.dim == 1)
    if columns and columns != target.shape[1]:
        raise CheckpointError(
            f"torch_dist: {name} needs {list(target.shape)}; the HF weights give {columns} columns"
        )
    for piece in pieces:
        _, info = reader.info(piece.hf_name)
        shape = info.shape[1:] if piece.index is not None else info.shape
        if piece.dim:  # column blocks of whole rows
            same = shape[0] == target.shape[0] and tuple(shape[2:]) == tuple(target.shape[2:])
        else:
            same = tuple(shape[1:]) == tuple(target.shape[1:])
        if not same:
            need = (
                f"{target.shape[0]} rows of column blocks"
                if piece.dim
                else f"rows of {list(target.shape[1:])}"
            )
            raise CheckpointError(
                f"torch_dist: {piece.hf_name} is {list(info.shape)}; megatron's {name} {list(target.shape)} needs "
                f"{need}: the checkpoint is not the model its config.json describes (re-fetch it or fix config.json)"
            )
    return target


def _rows(pieces, target) -> int:
    """How many rows of their megatron tensor `target` `pieces` fill (column blocks: every row)."""
    return target.shape[0] if any(p.dim for p in pieces) else sum(p.rows for p in pieces)


def _read_piece(reader: CheckpointReader, piece):
    """The HF rows a piece names (of sub-tensor `index` of a stacked tensor, if it has one; every
    `step`-th row; its columns, for a piece of `dim` 1)."""
    if piece.dim:
        whole = reader.read(piece.hf_name)
        return (whole if piece.index is None else whole[piece.index])[piece.hf_index]
    if piece.index is None:
        rows = reader.read_rows(piece.hf_name, piece.start, piece.stop)
        return rows if piece.step == 1 else rows[:: piece.step]
    return reader.read_rows(piece.hf_name, piece.index, piece.index + 1)[0, piece.hf_rows]


def _hf_named_state(reader: CheckpointReader, progress: Progress | None) -> dict:
    from miles.megatron.checkpoint import hf_named_state

    def tensors():
        for name in sorted(reader.files.weight_map):
            tensor = reader.read(name)
            if progress is not None:
                progress.advance(tensor.numel() * tensor.element_size(), 1)
            yield name, tensor

    return hf_named_state(tensors())


def _save(sharded: dict, common: dict, out: Path) -> None:
    from miles.megatron.checkpoint import save_release

    try:
        save_release(sharded, common, out)
    except BaseException as exc:  # torch.save inside DCP reports a full disk without its errno
        full = full_disk_error(out, exc)
        if full is None:
            raise
        raise full from exc


# The loaded model is also run against the HF model when both fit in memory twice over in
# float32 on a CPU (tiny and small slices); larger ones get the tensor comparison only.
LOGIT_CHECK_BYTES = 1 << 30
LOGIT_TOL = 1e-4


def _weight_bytes(reader: CheckpointReader) -> int:
    return sum(reader.info(n)[1].nbytes for n in reader.files.weight_map)


def _verify_logits(release: Path, config, hf_dir: Path, vocab: int) -> None:
    """The loaded-back model computes the HF model's logits (float32, a fixed token sequence):
    equal tensors in the wrong places would not."""
    import torch

    from miles.families.model import hf_logit_gap, load_model

    with torch.random.fork_rng(devices=[]):  # megatron's attention forks its RNG streams
        gap = hf_logit_gap(hf_dir, load_model(config, release, vocab, dtype=torch.float32), config)
    if not gap <= LOGIT_TOL:
        raise CheckpointError(
            f"{hf_dir}: the converted megatron model's logits differ from the HF model's by up to {gap:.3g} "
            f"(float32, tolerance {LOGIT_TOL:g}); the weights load back equal, so the mapping of this "
            f"config ({config.get('model_type')}) to megatron is wrong: report it with the config.json"
        )


def _verify(release: Path, config, reader: CheckpointReader, gpt: bool, vocab: int) -> None:
    """Load `release` back with megatron-core, compare every tensor with the HF weights and, for a
    model small enough, its logits with the HF model's."""
    import torch

    from miles.families.weights import Piece
    from miles.megatron.checkpoint import gpt_state, hf_named_state, load_release

    if gpt:
        from miles.families.model import build_model

        model = build_model(config, vocab)
        state = load_release(gpt_state(model), release)
        model.load_state_dict({k: v for k, v in state.items() if k not in _COMMON_KEYS})
        loaded = model.state_dict()
        checks = (
            (name, p.of_megatron(loaded[name]), p) for name, pieces in _layout(config, reader) for p in pieces
        )
    else:
        empty = (
            (name, torch.empty(info.shape, dtype=torch_dtype(info.dtype)))
            for name, info in ((n, reader.info(n)[1]) for n in reader.files.weight_map)
        )
        loaded = load_release(hf_named_state(empty), release)
        checks = (
            (
                name,
                loaded[name],
                Piece(name, 0, reader.info(name)[1].shape[0] if reader.info(name)[1].shape else 1, 0),
            )
            for name in sorted(reader.files.weight_map)
        )
    for name, got, piece in checks:
        hf_name, start, stop = piece.hf_name, piece.start, piece.stop
        want = _read_piece(reader, piece)
        if not torch.equal(got.reshape(want.shape), want.to(got.dtype)):
            if want.is_floating_point() and not bool(torch.isfinite(want).all()):
                first = (~torch.isfinite(want)).nonzero()[0].tolist()
                index = [first[0] * piece.step + start, *first[1:]] if first else []
                raise CheckpointError(
                    f"{reader.files.root}: tensor {hf_name} holds NaN/Inf (first at index {index}), which "
                    "never loads back equal; the source checkpoint is broken and a rerun cannot fix it: "
                    "fetch it again or repair it (validate reports every such tensor unless --scan-nan 0)"
                )
            raise CheckpointError(
                f"{release}: {name} differs from {hf_name} rows {start}:{stop} after loading back; rerun the step"
            )
    if gpt and _weight_bytes(reader) <= LOGIT_CHECK_BYTES:
        _verify_logits(release, config, reader.files.root, vocab)


def read_common(release: Path) -> dict:
    """A torch_dist release's common.pt (its non-tensor state), read without running any pickled code:
    the only class it may name is argparse's Namespace (Megatron-LM's `args`)."""
    import argparse

    import torch

    # registered for good, as megatron-core does when imported (torch's safe_globals context
    # manager drops the registrations made before it on exit, megatron-core's among them)
    torch.serialization.add_safe_globals([argparse.Namespace])
    common = torch.load(release / "common.pt", map_location="cpu", weights_only=True)
    if not isinstance(common, dict):
        raise CheckpointError(f"{release / 'common.pt'}: not a dict of checkpoint state")
    return common


def shape_problems(torch_dist_dir: Path, hf_dir: Path) -> list[str]:
    """[] when the model recorded in torch_dist_dir's common.pt is the one hf_dir/config.json
    describes (model type and, for Megatron's layout, every shape argument Megatron-LM reads),
    else one line naming both files and each difference."""
    import pickle

    from miles.megatron.checkpoint import torch_dist_release

    release = torch_dist_release(torch_dist_dir)
    path = release / "common.pt"
    try:
        common = read_common(release)
    except FileNotFoundError:
        return [f"{path} is missing"]
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, CheckpointError) as exc:
        return [
            f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ]
    recorded = common.get("miles", {}) if isinstance(common.get("miles"), dict) else {}
    try:
        config = _config(hf_dir, recorded.get("layout") == "megatron-gpt")
    except ValueError as exc:  # a config the mapping refuses (UnmappedModel)
        return [f"{Path(hf_dir) / 'config.json'}: {exc}"]
    except CheckpointError as exc:  # one the family's schema refuses (it names the file)
        return [str(exc)]
    differences = []
    if recorded.get("model_type") not in (None, config.get("model_type")):
        differences.append(f"model_type {recorded['model_type']} (config.json: {config.get('model_type')})")
    args = common.get("args")
    if args is not None and not differences:
        multiple = int(getattr(args, "make_vocab_size_divisible_by", 1) or 1)
        expected = vars(megatron_lm_args(config, _padded_vocab(config, multiple), multiple))
        for key in (*(f.lstrip("-").replace("-", "_") for f in _SHAPE_FLAGS), "padded_vocab_size"):
            want, got = expected.get(key), getattr(args, key, None)
            if want is not None and got != want:
                differences.append(f"{key} {got} (config.json: {want})")
    if not differences:
        return []
    return [f"{path} records another model than {Path(hf_dir) / 'config.json'}: {', '.join(differences)}"]


# The arguments of common.pt that fix the model's shape (megatron_lm_args writes them all).
_SHAPE_FLAGS = (
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups",
    "--kv-channels", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
    "--untie-embeddings-and-output-weights",
)  # fmt: skip
