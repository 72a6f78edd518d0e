"""The checkpoints a run starts from, checked before any model is built from them.

- A directory prepare-ckpt made (--hf-checkpoint, --ref-load) carries a manifest: every file it
  lists must be there, of its recorded size and sha256, and no other file may be (miles.ckpt.verify;
  a digest is computed once per file and kept while the file is unchanged). A manifest that cannot
  be read is refused, and so is a folder that lost the manifest it was written or verified with.
- A torch_dist --ref-load (the Megatron backend's starting weights) must hold the model of
  --hf-checkpoint: its common.pt records the model type and shape of config.json, and, where
  both directories carry manifests, it was converted from that very checkpoint (its manifest's
  inputs are the fingerprint of the HF directory, or of the one an FP8 --hf-checkpoint was made
  from), so another model of the same shape is refused too.

One process per node reads the files (local rank 0); every rank gets the verdict and raises the
same `CheckpointRefused`, which the trainer prints once.
"""

from __future__ import annotations

from pathlib import Path

from miles.train.config import RunConfig

PREPARE = "rerun `invoke prepare-ckpt` for this model (it redoes a step whose files changed)"


class CheckpointRefused(RuntimeError):
    """A checkpoint the run would load is damaged or belongs to another model; the same on every rank."""

    same_on_every_rank = True


def checkpoint_problems(config: RunConfig) -> list[str]:
    """One line per refused input checkpoint (each names the file and the fix); [] when all pass."""
    from miles.ckpt.verify import manifest_problems

    ckpt = config.checkpoint
    hf = Path(ckpt.hf_checkpoint)
    problems: list[str] = []
    inputs = [("--hf-checkpoint", hf)]
    if ckpt.ref_load and Path(ckpt.ref_load).resolve() != hf.resolve():
        inputs.append(("--ref-load", Path(ckpt.ref_load)))
    for flag, directory in inputs:
        found = manifest_problems(directory)
        if found:
            more = f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
            problems.append(
                f"{flag} {directory}: {found[0]}{more}; {PREPARE}, or point {flag} at an intact copy"
            )
    if problems or config.job.train_backend != "megatron" or not ckpt.ref_load:
        return problems
    return _same_model_problems(hf, Path(ckpt.ref_load))


def _same_model_problems(hf: Path, ref_load: Path) -> list[str]:
    """A torch_dist --ref-load of another model than --hf-checkpoint (by shape, or by origin)."""
    from miles.ckpt.manifest import fingerprint, read_manifest
    from miles.ckpt.torch_dist import shape_problems
    from miles.ckpt.verify import dcp_problems
    from miles.megatron.checkpoint import is_torch_dist_dir, torch_dist_release

    if not is_torch_dist_dir(ref_load) or not (hf / "config.json").is_file():
        return []  # the backend says what it needs
    fix = f"convert --hf-checkpoint {hf} with `invoke prepare-ckpt` and pass its _torch_dist as --ref-load"
    files = dcp_problems(torch_dist_release(ref_load))
    if files:
        return [f"--ref-load {ref_load}: {files[0]}; {fix}"]
    shape = shape_problems(ref_load, hf)
    if shape:
        return [f"--ref-load {ref_load}: {shape[0]}; {fix}"]
    made, source = read_manifest(ref_load), read_manifest(hf)
    if made is None or source is None:
        return []
    origins = {fingerprint(hf)}
    if source.step == "fp8":  # an FP8 --hf-checkpoint and the torch_dist come from the same HF dir
        origins.add(source.inputs)
    if made.inputs not in origins:
        return [
            f"--ref-load {ref_load} was converted from another checkpoint than --hf-checkpoint {hf} (its "
            f"manifest's inputs {made.inputs[:24]}... are not {hf}'s fingerprint): the same shape, other "
            f"weights; {fix}"
        ]
    return []


def verify_checkpoints(config: RunConfig, dist_info) -> None:
    """Raise CheckpointRefused on every rank when local rank 0 of any node refuses an input."""
    from miles.train.distributed import all_gather_objects

    found = checkpoint_problems(config) if dist_info.local_rank == 0 else []
    everyone = all_gather_objects(found)
    problems = list(dict.fromkeys(p for part in everyone for p in part))
    if problems:
        raise CheckpointRefused(" | ".join(problems))
