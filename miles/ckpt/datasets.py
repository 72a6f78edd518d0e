"""The prompt datasets the recipes name, fetched by prepare-ckpt's fetch step like the model's files.

A recipe's `--prompt-data {data_dir}/<name>/<file>` names a dataset of `DATASETS`: the Hugging
Face dataset repository it comes from (the one the seed framework's launchers download) and
the files the recipes read. `fetch_dataset` downloads each file through huggingface_hub's
cache (HF_HOME and HF_ENDPOINT honoured; the cache is consulted first without network, an
interrupted download resumes from its partial blob, HF_HUB_OFFLINE=1 makes a missing file an
error), checks every byte against the checksum the hub names the blob by (sha256 for LFS
files, the git blob sha1 otherwise), and writes `<data_dir>/<name>/` atomically with a
manifest of sizes and sha256s, so a rerun with the same files skips it. The CPU lane's
`synthetic:*` tasks need none of this.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from miles.ckpt.errors import CheckpointError
from miles.ckpt.manifest import FileRecord, atomic_dir, finished, write_manifest
from miles.ckpt.shards import sha256_file

DATA_DIR_FIELD = "{data_dir}/"
STEP = "fetch-data"


@dataclass(frozen=True)
class Dataset:
    name: str  # the directory under the data dir
    repo: str  # Hugging Face dataset repository
    files: tuple[str, ...]  # what the recipes read, relative to the repository root
    revision: str | None = None  # None: the repository's main branch

    @property
    def source(self) -> str:
        return f"hf://datasets/{self.repo}@{self.revision or 'main'}"


# radixark/miles downloads these with `hf download --repo-type dataset <repo> --local-dir <data_dir>/<name>`.
DATASETS = {
    d.name: d
    for d in (
        Dataset("dapo-math-17k", "zhuzilin/dapo-math-17k", ("dapo-math-17k.jsonl",)),
        Dataset("aime-2024", "zhuzilin/aime-2024", ("aime-2024.jsonl",)),
        # radixark/miles tests/e2e/long/test_qwen2.5_0.5B_gsm8k.py@31f1ca961: hf_download_dataset("zhuzilin/gsm8k")
        # the seed's Qwen3-0.6B FSDP tests (tests/e2e/fsdp/test_qwen3_0.6B_fsdp_distributed.py) read these
        Dataset("gsm8k", "zhuzilin/gsm8k", ("train.parquet", "test.parquet")),
    )
}
DATA_FLAGS = ("--prompt-data", "--eval-prompt-data")  # the trainer flags that name prompt files


class UnknownDataset(CheckpointError):
    pass


def dataset_of(prompt_data: str, flag: str = "--prompt-data") -> Dataset | None:
    """The dataset a `--prompt-data` template names (`{data_dir}/<name>/<file>`); None for a
    value that is not under the data dir (a synthetic task, an absolute path the user owns).
    A data-dir path no dataset provides is an UnknownDataset."""
    if not prompt_data.startswith(DATA_DIR_FIELD):
        return None
    name, _, file = prompt_data[len(DATA_DIR_FIELD) :].partition("/")
    dataset = DATASETS.get(name)
    if dataset is None or file not in dataset.files:
        known = ", ".join(f"{d.name}/{f}" for d in DATASETS.values() for f in d.files)
        raise UnknownDataset(
            f"{flag} {prompt_data}: no fetch provides {name}/{file} (known: {known}); add it to "
            "miles.ckpt.datasets.DATASETS with the repository it comes from"
        )
    return dataset


def datasets_in(argv: tuple[str, ...] | list[str], data_dir: str) -> tuple[str, ...]:
    """The datasets a trainer command's `--prompt-data` / `--eval-prompt-data` values read from
    `data_dir` (a path `<data_dir>/<name>/<file>`), in order; a path there that no dataset
    provides is an UnknownDataset. Values elsewhere (a user's own file, a synthetic task) are
    not fetched."""
    prefix = data_dir.rstrip("/") + "/"
    found: list[str] = []
    flag = None
    for token in argv:
        if token.startswith("--"):
            flag = token if token in DATA_FLAGS else None
            continue
        if flag and token.startswith(prefix):
            dataset = dataset_of(DATA_DIR_FIELD + token[len(prefix) :], flag)
            if dataset is not None and dataset.name not in found:
                found.append(dataset.name)
    return tuple(found)


@dataclass(frozen=True)
class DataResult:
    dataset: Dataset
    status: str  # "ran" | "skipped" | "would run"
    path: Path


def fetch_dataset(dataset: Dataset, data_dir: Path | str, *, dry: bool = False) -> DataResult:
    """`<data_dir>/<dataset.name>/` holding the dataset's files, checksummed; skipped when its
    manifest already records them for this source."""
    out = Path(data_dir) / dataset.name
    inputs = f"{dataset.source}:{','.join(dataset.files)}"
    if finished(out, STEP, inputs, {}):
        return DataResult(dataset, "skipped", out)
    if dry:
        return DataResult(dataset, "would run", out)
    blobs = {name: _download(dataset, name) for name in dataset.files}
    with atomic_dir(out, reads=(), replaces=(STEP,)) as tmp:
        records = {}
        for name, blob in blobs.items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(blob, target)
            except OSError:
                shutil.copyfile(blob, target)
            records[name] = FileRecord(target.stat().st_size, _verified_sha256(dataset, name, blob))
        write_manifest(tmp, STEP, inputs, {}, records)
    return DataResult(dataset, "ran", out)


def fetch_for_plan(status: str, detail: str, names: tuple[str, ...], data_dir: str, *, dry: bool) -> dict:
    """The fetch step's status and detail once the plan's datasets are fetched too."""
    results = [fetch_dataset(DATASETS[name], data_dir, dry=dry) for name in names]
    states = {status, *(r.status for r in results)}
    for state in ("would run", "ran"):
        if state in states:
            status = state
            break
    data = ", ".join(f"{r.dataset.name} {r.status} ({r.path})" for r in results)
    return {"status": status, "detail": f"{detail}; data: {data}" if detail else f"data: {data}"}


def _download(dataset: Dataset, name: str) -> Path:
    """The file's blob in the huggingface_hub cache: from the cache alone first, then the hub."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from miles.ckpt.hub import offline

    for local_only in (True, False):
        if not local_only and offline():
            break
        try:
            path = hf_hub_download(
                dataset.repo,
                name,
                repo_type="dataset",
                revision=dataset.revision,
                local_files_only=local_only,
            )
        except (LocalEntryNotFoundError, FileNotFoundError):
            continue
        except (HfHubHTTPError, OSError) as exc:
            raise CheckpointError(f"cannot download {name} of {dataset.source}: {exc}") from exc
        except Exception as exc:  # the HTTP client's transport errors (a dropped connection, retried)
            raise CheckpointError(
                f"cannot download {name} of {dataset.source}: {type(exc).__name__}: {exc}; run the fetch again "
                "(files already fetched stay in the Hugging Face cache)"
            ) from exc
        return Path(path).resolve()
    hint = "HF_HUB_OFFLINE is set and " if offline() else ""
    raise CheckpointError(
        f"{dataset.source}: {hint}the Hugging Face cache lacks {name}; unset HF_HUB_OFFLINE or fetch it on a "
        "machine with network"
    )


def _verified_sha256(dataset: Dataset, name: str, blob: Path) -> str:
    """The blob's sha256, after checking its content against the checksum the hub named it by."""
    digest = sha256_file(blob)
    named = blob.name
    if len(named) == 64:
        ok = digest == named
    elif len(named) == 40:
        git = hashlib.sha1(f"blob {blob.stat().st_size}\0".encode())  # git's own object id
        with open(blob, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                git.update(chunk)
        ok = git.hexdigest() == named
    else:
        raise CheckpointError(f"{name} of {dataset.source}: the hub gave no checksum for it (blob {named})")
    if not ok:
        raise CheckpointError(
            f"{name} of {dataset.source}: {blob} does not match its checksum {named}; delete that blob and fetch again"
        )
    return digest
