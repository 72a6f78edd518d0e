"""Worker of tests/e2e/test_remote_group.py: `engine PORT` joins the weight-update group as its
rank 1 and prints what it receives; `trainer PORT` runs under torchrun (world of 2): rank 0 opens
the group and broadcasts while rank 1 waits in the trainer's own collective, then both reduce."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from miles.train.remote.group import open_group

role, port = sys.argv[1], int(sys.argv[2])
if role == "engine":
    group = open_group(backend="gloo", address="127.0.0.1", port=port, rank=1, world_size=2, group_name="g")
    received = torch.zeros(3)
    group.broadcast(received)
    print(json.dumps({"engine": received.tolist()}), flush=True)
else:
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        group = open_group(
            backend="gloo", address="127.0.0.1", port=port, rank=0, world_size=2, group_name="g"
        )
        group.broadcast(torch.arange(3.0))
    total = torch.ones(1)
    dist.all_reduce(total)
    # one write(2) per line: the two ranks share torchrun's stdout pipe, and print's separate
    # writes of the text and its newline can interleave ('{...}{...}\n\n')
    os.write(1, (json.dumps({"rank": dist.get_rank(), "sum": total.item()}) + "\n").encode())
    dist.destroy_process_group()
