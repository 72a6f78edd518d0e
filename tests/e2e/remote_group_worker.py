"""Worker of tests/e2e/test_remote_group.py: `engine PORT` joins the weight-update group as its
rank 1 and prints what it receives; `trainer PORT` runs under torchrun (world of 2): rank 0 opens
the group and broadcasts while rank 1 waits in the trainer's own collective, then both reduce."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from miles.train.remote.group import open_group
from tests.support.results import emit

role, port = sys.argv[1], int(sys.argv[2])
if role == "engine":
    group = open_group(backend="gloo", address="127.0.0.1", port=port, rank=1, world_size=2, group_name="g")
    received = torch.zeros(3)
    group.broadcast(received)
    emit({"engine": received.tolist()})
    # closed before the interpreter exits: gloo's threads torn down at exit instead abort the
    # process now and then ("terminate called without an active exception", exit -6)
    group.close()
else:
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        group = open_group(
            backend="gloo", address="127.0.0.1", port=port, rank=0, world_size=2, group_name="g"
        )
        group.broadcast(torch.arange(3.0))
        group.close()
    total = torch.ones(1)
    dist.all_reduce(total)
    emit({"rank": dist.get_rank(), "sum": total.item()})  # one write: the ranks share the pipe
    dist.destroy_process_group()
