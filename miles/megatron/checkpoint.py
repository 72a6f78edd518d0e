"""megatron-core's torch_dist checkpoints: read into model chunks, written from a conversion,
and the training state (model, distributed optimizer, schedule) a run saves and resumes.

Layout of a torch_dist directory (what Megatron-LM's `--load` with `--ckpt-format torch_dist`
reads): `<dir>/release/` holds torch.distributed.checkpoint data, its index, `metadata.json`
and `common.pt` (non-tensor state); `<dir>/latest_checkpointed_iteration.txt` names the
release and is written last.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
# Megatron-LM rebuilds the model's sharded state dict with the content_metadata it finds in
# common.pt, so recording the (default) metadata used here makes a loader ask for these keys.
SHARDED_METADATA: dict = {}
# The distributed optimizer's shards as they are: a run resumes at the same model-parallel
# layout with any number of data-parallel replicas (weights alone load at any layout).
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
# One tensor per parameter, gathered on data-parallel rank 0 at save: loads at any layout
# megatron-core can reshard the model to (--dist-ckpt-optim-fully-reshardable).
RESHARDABLE_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
# The model-parallel degrees a dp_reshardable optimizer state is tied to.
MODEL_PARALLEL = ("tp", "pp", "vpp", "ep", "etp", "cp")


class CheckpointMismatch(ValueError):
    """A torch_dist checkpoint that does not hold what the model asks for."""


def is_torch_dist_dir(path: str | Path | None) -> bool:
    if not path:
        return False
    path = Path(path)
    return (path / TRACKER).is_file() or (path / "metadata.json").is_file()


def torch_dist_release(path: str | Path) -> Path:
    """The directory holding the tensors of a torch_dist checkpoint (its `release/` or itself)."""
    path = Path(path)
    marker = path / TRACKER
    if marker.is_file():
        tag = marker.read_text().strip()
        name = tag if tag == RELEASE else f"iter_{int(tag):07d}"
        return path / name
    return path


@contextmanager
def single_process_group() -> Iterator[None]:
    """torch.distributed and megatron's parallel state for one CPU process, unless already set up."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles.megatron.compat import forget_destroyed_groups

    own_pg = not dist.is_initialized()
    if own_pg:  # an in-memory store: no port, no file left behind by a killed run
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_mp = not parallel_state.model_parallel_is_initialized()
    if own_mp:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if own_mp:
            parallel_state.destroy_model_parallel()
            forget_destroyed_groups()
        if own_pg:
            dist.destroy_process_group()


# --- model weights -------------------------------------------------------------------------


def model_state_template(chunks: Sequence, *, adapters_only: bool = False) -> dict:
    """Every chunk's sharded state dict (TE's fp8 `_extra_state` left out: converted weights have
    none); with `adapters_only`, its LoRA adapters alone (the frozen base is --ref-load's)."""
    from miles.megatron.lora import is_adapter

    state = {}
    for i, chunk in enumerate(chunks):
        sharded = chunk.sharded_state_dict()
        state[f"model{i}"] = {
            k: v
            for k, v in sharded.items()
            if not k.endswith("_extra_state") and (is_adapter(k) or not adapters_only)
        }
    return state


def load_weights(chunks: Sequence, path: str | Path) -> None:
    """Fill the chunks with the weights of torch_dist checkpoint `path`, resharded to this layout."""
    from megatron.core import dist_checkpointing

    release = torch_dist_release(path)
    loaded = dist_checkpointing.load(model_state_template(chunks), str(release))
    for i, chunk in enumerate(chunks):
        missing, _ = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointMismatch(
                f"{release}: holds no value for {missing[:5]}; is it a GPT torch_dist of this model?"
            )


def embedding_rows(path: str | Path) -> int | None:
    """Rows of the checkpoint's input embedding (the vocabulary as the converter padded it), if any."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(torch_dist_release(path)))
    embedding = meta.get("embedding.word_embeddings.weight")
    return int(embedding.global_shape[0]) if embedding is not None else None


# --- a conversion's release ----------------------------------------------------------------


def gpt_state(model) -> dict:
    """The sharded state dict a GPTModel is saved and loaded under."""
    return model.sharded_state_dict(metadata=dict(SHARDED_METADATA))


def hf_named_state(tensors: Iterator[tuple[str, Any]]) -> dict:
    """(name, tensor) pairs as a sharded state dict that keeps the names (one replica each)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {name: ShardedTensor.from_rank_offsets(name, tensor, replica_id=0) for name, tensor in tensors}


def load_release(template: dict, release: Path) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(template, str(release))


def save_release(sharded: dict, common: dict, out: Path) -> None:
    """Write `sharded` (and `common`, merged into common.pt) as the torch_dist data of `out`,
    synchronously and byte-reproducibly: megatron-core's own save path synchronises CUDA, so its
    translation functions are used with torch.distributed.checkpoint's synchronous writer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class Writer(dcp.FileSystemWriter):
        def storage_meta(self):
            return None  # it would record the temp path and a random save id; the bytes must not depend on either

    tensors, common_part = save_preprocess(sharded, validate_access_integrity=True)
    # serialized in memory, then written by Python: a full disk is an OSError naming its errno
    # (torch.save's own file writer reports "file write failed" and nothing more)
    buffer = io.BytesIO()
    torch.save({**common_part, **common}, buffer)
    (out / "common.pt").write_bytes(buffer.getvalue())
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(tensors, keep_only_main_replica=True)
    state = mcore_to_pyt_state_dict(flat, is_loading=False)
    # the tensors are on the CPU: written as they are, never staged through a GPU stream (torch
    # stages them when a GPU is visible unless nothing is copied ahead)
    writer = Writer(out, thread_count=1, per_thread_copy_ahead=0)
    dcp.save(state, storage_writer=writer, planner=MCoreSavePlanner(flatten_state_dict=False))
    save_config(CheckpointingConfig("torch_dist", 1), out)


# --- a run's training state ----------------------------------------------------------------


def optimizer_format(fully_reshardable: bool) -> dict:
    """The sharding metadata the distributed optimizer's state is saved with."""
    return dict(RESHARDABLE_FORMAT if fully_reshardable else OPTIMIZER_FORMAT)


def _layout_record(layout) -> dict:
    """The model-parallel degrees of `layout` (a miles.parallel.ParallelLayout), as saved."""
    if layout is None:
        return {}
    return {name: layout.expert_tp if name == "etp" else getattr(layout, name) for name in MODEL_PARALLEL}


def save_training_state(
    chunks: Sequence,
    optimizer,
    directory: str,
    *,
    steps_done: int | None,
    layout=None,
    optimizer_format=None,
    adapters_only: bool = False,
) -> None:
    """Model chunks (and, with `steps_done`, the distributed optimizer and the schedule step) into
    `directory`, every rank its shards; the layout's model-parallel degrees and the optimizer's
    format are kept in common.pt for the load; with `adapters_only` (LoRA) the model part is the
    adapters alone. The writer processes megatron-core starts for it
    end with this process, even when it is killed mid-save (miles.children)."""
    from megatron.core import dist_checkpointing

    from miles.megatron.compat import writers_die_with_this_process

    writers_die_with_this_process()
    state = model_state_template(chunks, adapters_only=adapters_only)
    if steps_done is not None:
        # an optimizer that has not stepped yet (PPO's policy during the critic's warm-up) holds no
        # state to write; give it the state its first step would create
        _materialize_adam_state(optimizer)
        fmt = optimizer_format or OPTIMIZER_FORMAT
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=fmt)
        # plain values: kept once, in common.pt
        state["schedule"] = {"steps_done": steps_done, "format": fmt, "layout": _layout_record(layout)}
    dist_checkpointing.save(state, directory)


def load_training_state(
    chunks: Sequence,
    optimizer,
    directory: str,
    *,
    with_optimizer: bool,
    layout=None,
    adapters_only: bool = False,
) -> int | None:
    """What `save_training_state` wrote, back into the chunks (and optimizer); returns the
    schedule step saved with the optimizer (None without it). The optimizer state loads in the
    format it was saved in; a dp_reshardable one at another model-parallel layout is a
    CheckpointMismatch naming both layouts and the flag that saves a reshardable one."""
    import torch
    from megatron.core import dist_checkpointing

    state = model_state_template(chunks, adapters_only=adapters_only)
    if with_optimizer:
        saved = dist_checkpointing.load_common_state_dict(directory).get("schedule", {})
        fmt = saved_optimizer_format(directory, saved, layout)
        _materialize_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=fmt)
        state["schedule"] = {"steps_done": 0, "format": fmt, "layout": saved.get("layout", {})}
    loaded = dist_checkpointing.load(state, directory)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=False)
    if not with_optimizer:
        return None
    with torch.no_grad():  # fp32 main parameters are views of the model's own
        if fmt == RESHARDABLE_FORMAT:
            _load_reshardable(optimizer, loaded["optimizer"])
        else:
            optimizer.load_state_dict(loaded["optimizer"])
    steps = int(loaded["schedule"]["steps_done"])
    _set_adam_steps(optimizer, steps)
    return steps


def _materialize_adam_state(optimizer) -> None:
    """Give every parameter the Adam state its optimizer creates lazily at the first step, for a
    fresh optimizer about to load a checkpoint (it needs the tensors to load into).

    torch's AdamW (megatron's optimizer without Apex or Transformer Engine) gets zeros and step
    0; any other (TE's FusedAdam, which keeps its step in param_groups) gets what megatron-core's
    own init_state_fn gives it (untested on GPU).
    """
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            init = getattr(opt, "init_state_fn", None)
            if init is not None:
                init(inner, opt.config)
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def saved_optimizer_format(directory, saved: dict, layout) -> dict:
    """The format a checkpoint's optimizer state was saved in (`saved`: its common.pt schedule
    entry), once it is one that loads at `layout`: a dp_reshardable state saved at another
    model-parallel layout is a CheckpointMismatch naming the degrees that changed and the fix."""
    fmt = saved.get("format", OPTIMIZER_FORMAT)
    was, now = saved.get("layout", {}), _layout_record(layout)
    if fmt == OPTIMIZER_FORMAT and was and now and was != now:
        changed = ", ".join(f"{k} {was[k]} -> {now[k]}" for k in MODEL_PARALLEL if was.get(k) != now.get(k))
        raise CheckpointMismatch(
            f"{directory}: its optimizer state was saved in megatron-core's dp_reshardable format, which loads "
            f"only at the model-parallel layout it was saved at ({changed}); resume at that layout, save the "
            "checkpoint with --dist-ckpt-optim-fully-reshardable, or pass --no-load-optim to load the weights alone"
        )
    return fmt


def _load_reshardable(optimizer, state: dict) -> None:
    """A fully_reshardable optimizer state into the distributed optimizer(s), as its
    load_state_dict does, except for torch's Adam: megatron-core 0.16.1 gives each parameter's
    state a "step" first (distrib_optimizer.py, load_state_dict: "Native PyTorch state dict
    requires step") and then copies every state entry from the checkpoint, which saves no step
    (_set_main_param_and_optimizer_states: KeyError 'step'). The steps are taken out for the copy
    (_set_adam_steps puts them back)."""
    import torch

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
    for opt, part in zip(chained, parts, strict=True):
        part = dict(part)
        params = part.pop("param_state")
        part.pop("param_state_sharding_type")
        opt.load_state_dict(part)
        if isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
            for entry in opt.optimizer.state.values():
                entry.pop("step", None)
        opt.load_parameter_state_from_fully_reshardable(params)


def _set_adam_steps(optimizer, steps: int) -> None:
    """AdamW's per-parameter step count (its bias correction) after a load.

    megatron-core 0.16.1 restores it for torch's AdamW from its common state as one tensor
    shared by every parameter, which each parameter's update then increments again; every
    parameter gets a count of its own, the number of steps applied before the checkpoint.
    """
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue  # TE's FusedAdam keeps its step in param_groups
        for state in opt.optimizer.state.values():
            if "exp_avg" in state:
                state["step"] = torch.tensor(float(steps))
