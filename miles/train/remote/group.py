"""The collective group a weight broadcast runs over: trainer rank 0 and every engine rank.

SGLang's side (sglang 0.5.23, `init_weights_update_group` -> utils/common.py
`init_custom_process_group`) joins with a TCP rendezvous at the trainer's address and port
(rank 0 serves the store), prefixes the store with the group's name and builds the group with torch's
`_new_process_group_helper`, every member numbered by its rank in the group (the trainer 0,
engine tp rank r at `rank_offset + r`). `open_group` joins the same way, so the trainer
meets SGLang's engines on GPUs (NCCL) and the built-in engine servers on the CPU (gloo).
A process that has no default process group (an engine server) gets a world of one first:
torch builds further groups only beside a default one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT = timedelta(minutes=30)


@dataclass
class UpdateGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any

    def broadcast(self, tensor) -> None:
        """`tensor` from group rank 0 to every member, in place."""
        import torch.distributed as dist

        dist.broadcast(tensor, src=0, group=self.pg)

    def close(self) -> None:
        import torch.distributed as dist

        if self.pg is not None:
            pg, self.pg = self.pg, None
            dist.destroy_process_group(pg)


def open_group(
    *,
    backend: str,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> UpdateGroup:
    """Join the group `group_name` of `world_size` members at `address:port` as `rank` (rank 0
    serves the rendezvous); blocks until every member has joined."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    # What torch's tcp:// rendezvous builds outside torchrun (rendezvous.py _create_c10d_store):
    # rank 0 serves the store. Under torchrun that rendezvous would make rank 0 a client of the
    # launcher's own store instead (TORCHELASTIC_USE_AGENT_STORE), so the store is built here.
    store = dist.TCPStore(
        host_name=address,
        port=port,
        world_size=world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    store = PrefixStore(group_name, store)
    options = (
        "backend_options"
        if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6)
        else "pg_options"
    )
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        **{options: None},
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return UpdateGroup(group_name, rank, world_size, backend, pg)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
