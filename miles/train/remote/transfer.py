"""How a weight sync reaches engines in processes of their own (--update-weight-transfer-mode).

Every trainer rank produces the full weights (that may take collectives); trainer rank 0 sends
them, the others only drain the stream.

- `broadcast` (the default): trainer rank 0 and every engine rank form one collective group
  (miles.train.remote.group; gloo on the CPU, NCCL on GPUs), opened on the first sync and again
  whenever the engines change (one died and came back). Each bucket of about
  --update-weight-buffer-size bytes is announced to every engine
  (`/update_weights_from_distributed`: names, dtypes, shapes) and then broadcast tensor by
  tensor, inside a weight-update session (`/begin_weight_update` .. `/end_weight_update`,
  outside of which sglang 0.5.23 refuses the load).
- `disk`: each sync is a full version under --update-weight-disk-dir (miles.train.remote.disk),
  loaded by every engine with `/update_weights_from_disk`.
- `disk-delta`: the first sync is a full version, each later one holds only the changed bytes;
  an engine host applies it to its own copy (--update-weight-local-checkpoint-dir) and the
  engines reload from that: the built-in engine server does both in `/pull_weights`; stock
  SGLang 0.5.23 has no such route, so for it trainer rank 0 applies the version (its host is
  the engines' host: one node) and the engines load the copy with `/update_weights_from_disk`.

Each sync carries the weight version the engines then report with every output.
"""

from __future__ import annotations

import abc
import itertools
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles.train.remote.disk import Publisher, apply_version
from miles.train.remote.fleet import Engine, Fleet
from miles.train.remote.group import UpdateGroup, free_port, open_group
from miles.train.sglang_weights import buckets

GROUP_NAME = "miles_weight_update"
_GROUPS = itertools.count(1)  # group names are unique in a process (torch registers them by name)


class Transfer(abc.ABC):
    """One way of sending the trainer's weights to the fleet (trainer rank 0 calls `push`)."""

    @abc.abstractmethod
    def push(self, fleet: Fleet, engines: Sequence[Engine], named_tensors: Iterable, version: int) -> None:
        """Every tensor to every engine of `engines`, which then report `version`."""

    def close(self) -> None:  # noqa: B027 (nothing held by default)
        """Release what the transfer holds (a collective group)."""


class BroadcastTransfer(Transfer):
    def __init__(self, *, backend: str, address: str, bucket_bytes: int):
        self.backend, self.address, self.bucket_bytes = backend, address, bucket_bytes
        self.group: UpdateGroup | None = None
        self.members: tuple[tuple[str, str], ...] = ()

    def push(self, fleet: Fleet, engines: Sequence[Engine], named_tensors: Iterable, version: int) -> None:
        members = tuple((e.name, e.client.url) for e in engines)
        if members != self.members:
            self._open(fleet, engines)
            self.members = members
        fleet.call(engines, "/begin_weight_update")
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            for bucket in buckets(named_tensors, self.bucket_bytes):
                tensors = [(n, t.detach().contiguous()) for n, t in bucket]
                if self.backend == "gloo":
                    tensors = [(n, t.cpu()) for n, t in tensors]
                announce = {
                    "names": [n for n, _ in tensors],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                    "shapes": [list(t.shape) for _, t in tensors],
                    "group_name": self.group.name,
                    "flush_cache": False,
                    "weight_version": str(version),
                }
                answers = [
                    pool.submit(e.client.post, "/update_weights_from_distributed", announce) for e in engines
                ]
                for _, tensor in tensors:
                    self.group.broadcast(tensor)
                for answer in answers:
                    answer.result()
        fleet.call(engines, "/end_weight_update")

    def _open(self, fleet: Fleet, engines: Sequence[Engine]) -> None:
        """A fresh group: trainer rank 0 is rank 0, engine ranks follow in order."""
        if self.group is not None:
            previous = [e for e in engines if (e.name, e.client.url) in self.members]
            for engine in previous:  # engines that held the old group leave it
                try:
                    engine.client.post("/destroy_weights_update_group", {"group_name": self.group.name})
                except Exception:
                    pass
            self.group.close()
            self.group = None
        name = f"{GROUP_NAME}_{os.getpid()}_{next(_GROUPS)}"
        port = free_port(self.address)
        world = 1 + sum(e.ranks for e in engines)
        offsets, offset = [], 1
        for engine in engines:
            offsets.append(offset)
            offset += engine.ranks
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            joins = [
                pool.submit(
                    e.client.post,
                    "/init_weights_update_group",
                    {
                        "master_address": self.address,
                        "master_port": port,
                        "rank_offset": o,
                        "world_size": world,
                        "group_name": name,
                        "backend": self.backend,
                    },
                )
                for e, o in zip(engines, offsets, strict=True)
            ]
            self.group = open_group(
                backend=self.backend,
                address=self.address,
                port=port,
                rank=0,
                world_size=world,
                group_name=name,
            )
            for join in joins:
                join.result()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class DiskTransfer(Transfer):
    """`disk` (full versions) and `disk-delta` (see the module docstring)."""

    def __init__(self, publisher: Publisher, local_dir: str | None = None):
        self.publisher, self.local_dir = publisher, local_dir

    def push(self, fleet: Fleet, engines: Sequence[Engine], named_tensors: Iterable, version: int) -> None:
        path = self.publisher.publish(named_tensors, version)
        if not self.publisher.delta:
            fleet.call(
                engines,
                "/update_weights_from_disk",
                {"model_path": str(path), "weight_version": str(version)},
            )
            return
        pulling = [e for e in engines if e.kind == "torch"]
        if len(pulling) < len(engines):  # SGLang: this host applies it
            apply_version(path, self.local_dir)
        pull = {
            "version_dir": str(path),
            "local_checkpoint_dir": self.local_dir,
            "weight_version": str(version),
        }
        fleet.call(pulling, "/pull_weights", pull)
        reload = {"model_path": str(Path(self.local_dir)), "weight_version": str(version)}
        fleet.call([e for e in engines if e not in pulling], "/update_weights_from_disk", reload)
