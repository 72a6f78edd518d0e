"""Training checkpoints: `--save`, `--load`, `--save-interval`.

Layout (the same done-marker convention as Megatron's):

    <save>/iter_0000007/          model and optimizer state (torch.distributed.checkpoint,
                                  sharded; loads at any world size) + trainer_state.json
    <save>/latest_checkpointed_iteration.txt   "7", written last
    <save>/iter_0000007/model_hash.json   with --ci-save-model-hash: a SHA-256 per weight

`iter_N` holds the state after N completed rollouts. A checkpoint is written into a
temporary sibling and renamed into place by rank 0 only when every rank has finished, and
the marker is replaced atomically after that, so a run killed mid-save leaves the previous
checkpoint as the latest and nothing half-written that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from miles.train.config import RunConfig

MARKER = "latest_checkpointed_iteration.txt"
CRITIC_DIR = "critic"  # PPO's critic: its model and optimizer, beside the policy's
STATE_FILE = "trainer_state.json"
HASH_FILE = "model_hash.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or from a different run setup."""

    same_on_every_rank = True  # every rank reads the same --load directory


@dataclass(frozen=True)
class TrainerState:
    rollouts_done: int  # the next rollout id to run
    hf_checkpoint: str
    seed: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    prompt_data: str
    with_optimizer: bool


def state_of(config: RunConfig, rollouts_done: int) -> TrainerState:
    """What the checkpoint written after `rollouts_done` rollouts of this command records."""
    return TrainerState(
        rollouts_done=rollouts_done,
        hf_checkpoint=config.checkpoint.hf_checkpoint,
        seed=config.job.seed,
        rollout_batch_size=config.rollout.rollout_batch_size,
        n_samples_per_prompt=config.rollout.n_samples_per_prompt,
        prompt_data=config.data.prompt_data,
        with_optimizer=not config.checkpoint.no_save_optim,
    )


def iteration_dir(root: str | Path, rollouts_done: int) -> Path:
    return Path(root) / f"iter_{rollouts_done:07d}"


def latest_iteration(root: str | Path) -> int | None:
    """Rollouts done by the latest complete checkpoint under `root`, or None when there is none."""
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker}: expected a rollout count, found {text!r}")
    step = int(text)
    if not (iteration_dir(root, step) / STATE_FILE).is_file():
        raise CheckpointError(
            f"{marker} names iteration {step}, but {iteration_dir(root, step)} is incomplete"
        )
    return step


def save(
    backend,
    root: str | Path,
    state: TrainerState,
    *,
    is_main: bool,
    barrier,
    hashes: dict | None = None,
    critic=None,
) -> Path:
    """Write the checkpoint of `state.rollouts_done` rollouts (every rank calls this), with PPO's
    critic under CRITIC_DIR when there is one; `hashes` (rank 0's `model_hashes`) go beside it as
    model_hash.json."""
    root = Path(root)
    final = iteration_dir(root, state.rollouts_done)
    tmp = final.with_name(final.name + ".tmp")
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if critic is not None:
            (tmp / CRITIC_DIR).mkdir()
    barrier()
    backend.save(str(tmp), with_optimizer=state.with_optimizer)
    if critic is not None:
        critic.save(str(tmp / CRITIC_DIR), with_optimizer=state.with_optimizer)
    barrier()
    if is_main:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
        if hashes is not None:
            (tmp / HASH_FILE).write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = root / f".{MARKER}.tmp"
        marker_tmp.write_text(f"{state.rollouts_done}\n")
        os.replace(marker_tmp, root / MARKER)
    barrier()
    return final


def check_load_dir(load: str | Path, save: str | Path | None) -> None:
    """Refuse a --load that cannot be what the user meant; a new or empty one starts fresh.

    The recipes pass --load = --save, so there a missing or empty directory is a first run.
    A --load elsewhere must exist: a mistyped path would otherwise train from scratch and
    exit 0. An existing --load must be a checkpoint directory: the marker, iter_* dirs and
    their temporaries only (an interrupted first save leaves just iter_*.tmp).
    """
    load = Path(load)
    same_as_save = save is not None and load.resolve() == Path(save).resolve()
    if not load.exists():
        if same_as_save:
            return
        raise CheckpointError(
            f"--load {load}: no such directory, and it is not the --save directory, so there is nothing to "
            "resume; fix the path, or pass the same directory to --load and --save to resume when a "
            "checkpoint exists and start fresh otherwise"
        )
    if not load.is_dir():
        raise CheckpointError(
            f"--load {load}: not a directory; --load names a checkpoint directory (--save's)"
        )
    strays = sorted(
        p.name
        for p in load.iterdir()
        if p.name not in (MARKER, f".{MARKER}.tmp") and not (p.is_dir() and p.name.startswith("iter_"))
    )
    if strays:
        hint = " (a Hugging Face model: pass it as --hf-checkpoint)" if "config.json" in strays else ""
        raise CheckpointError(
            f"--load {load}: not a checkpoint directory{hint}; it holds {', '.join(strays[:5])}"
            f"{' ...' if len(strays) > 5 else ''} but no {MARKER}"
        )


def read_state(root: str | Path, step: int | None = None) -> TrainerState | None:
    """The trainer state of checkpoint `step` (default: the latest), or None when `root` has none."""
    step = latest_iteration(root) if step is None else step
    if step is None:
        return None
    path = iteration_dir(root, step) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no such checkpoint (the rollouts done must name a complete iter_ dir)"
        )
    return TrainerState(**json.loads(path.read_text()))


def check_files(root: str | Path, rollouts_done: int) -> None:
    """Every tensor file the checkpoint's index lists is there and long enough, before any rank loads it."""
    from miles.ckpt.verify import dcp_problems

    path = iteration_dir(root, rollouts_done)
    problems = dcp_problems(path)
    if problems:
        raise CheckpointError(
            f"--load {root}: {problems[0]}; resume from another iteration (--ckpt-step N names iter_N), "
            "or start a new run with --save elsewhere"
        )


def check_compatible(state: TrainerState, config: RunConfig) -> None:
    """Resuming with a different data or batch setup would not continue the same run."""
    now = state_of(config, state.rollouts_done)
    changed = [
        f"{flag} {old} -> {new}"
        for flag, old, new in (
            ("--seed", state.seed, now.seed),
            ("--rollout-batch-size", state.rollout_batch_size, now.rollout_batch_size),
            ("--n-samples-per-prompt", state.n_samples_per_prompt, now.n_samples_per_prompt),
            ("--prompt-data", state.prompt_data, now.prompt_data),
        )
        if old != new
    ]
    if changed:
        raise CheckpointError(
            f"--load {config.checkpoint.load}: the checkpoint was written with different flags ({'; '.join(changed)}); "
            "resume with the original flags, or start a new run with --save elsewhere"
        )


def model_hashes(backend) -> dict[str, str] | None:
    """A SHA-256 of every weight the backend holds, by Hugging Face name, over its unsharded bytes
    (shape and dtype included): the same at any layout and on either backend. Every rank takes
    part in the gathers; rank 0 gets the hashes, the others None."""
    import hashlib

    import torch
    import torch.distributed as dist

    main = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, tensor in backend.full_weights(names="model"):
        if main:
            data = tensor.detach().cpu().contiguous()
            digest = hashlib.sha256(f"{tuple(data.shape)} {data.dtype} ".encode())
            digest.update(data.reshape(-1).view(torch.uint8).clone().numpy())  # a copy: numpy pins a storage
            out[name] = digest.hexdigest()
    return out if main else None


def hash_problem(directory: Path, hashes: dict[str, str]) -> str | None:
    """What is wrong with the loaded weights against the checkpoint's recorded hashes
    (--ci-check-model-hash), or None when every weight hashes as saved."""
    path = Path(directory) / HASH_FILE
    if not path.is_file():
        return (
            f"--ci-check-model-hash: {path} does not exist; the checkpoint was saved without "
            "--ci-save-model-hash, so there is nothing to check the loaded weights against"
        )
    saved = json.loads(path.read_text())
    missing, extra = sorted(set(saved) - set(hashes)), sorted(set(hashes) - set(saved))
    changed = sorted(k for k in saved.keys() & hashes.keys() if saved[k] != hashes[k])
    if not (missing or extra or changed):
        return None
    return (
        f"--ci-check-model-hash: the weights loaded from {directory} are not the ones saved there "
        f"({len(changed)} changed: {changed[:3]}; {len(missing)} missing: {missing[:3]}; "
        f"{len(extra)} not saved: {extra[:3]})"
    )
