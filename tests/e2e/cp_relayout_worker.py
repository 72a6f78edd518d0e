"""Checks the context-parallel relayout (miles.megatron.cp_relayout) on every rank; run under torchrun.

Not a test module: tests/e2e/test_cp_relayout.py (gloo, CPU) and
tests/e2e/precision/test_hf_attention_cp_relayout.py (NCCL/RCCL, GPUs) launch it at 2 and 4
ranks. Each rank prints one line; any failed check exits 1.

1. The seed's case (radixark/miles 31f1ca961, tests/e2e/precision/test_hf_attention_cp_relayout.py):
   sequences of 2·cp sub-chunks of 3 and 5 rows whose values name (sequence, sub-chunk, row), and
   a tail of 3 padding rows per rank laid out contiguously; zigzag -> packed gives each rank its
   contiguous shard of the stream, packed -> zigzag gives the input back, and the gradient of the
   round trip's sum is ones, all compared exactly (torch.equal).
2. Random packs (seeded alike on every rank): random lengths, random float rows; both round trips
   exact, each relayout against the stream built on one rank, and each backward exact.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from miles.megatron.cp_relayout import packed_shard_to_zigzag, zigzag_positions, zigzag_to_packed_shard


def seed_case(rank: int, cp: int, device) -> list[str]:
    zigzag, stream, cu = [], [], [0]
    for sample, chunk in enumerate((3, 5)):
        subs = [
            torch.arange(sample * 1000 + sub * 100, sample * 1000 + sub * 100 + chunk, dtype=torch.float32)
            for sub in range(2 * cp)
        ]
        zigzag += [subs[rank], subs[2 * cp - 1 - rank]]
        stream += subs
        cu.append(cu[-1] + 2 * cp * chunk)
    tail = [r * 10000 + torch.arange(3, dtype=torch.float32) for r in range(cp)]
    zigzag.append(tail[rank])
    stream += tail
    cu.append(cu[-1] + 3 * cp)
    x = torch.cat(zigzag).view(-1, 1, 1).to(device).requires_grad_(True)
    whole = torch.cat(stream).view(-1, 1, 1).to(device)
    n = x.shape[0]
    packed = zigzag_to_packed_shard(x, torch.tensor(cu, dtype=torch.int32))
    back = packed_shard_to_zigzag(packed, torch.tensor(cu, dtype=torch.int32))
    back.sum().backward()
    failures = []
    if not torch.equal(packed, whole[rank * n : (rank + 1) * n]):
        failures.append("seed case: zigzag -> packed is not the rank's contiguous shard")
    if not torch.equal(back, x):
        failures.append("seed case: the round trip changed the rows")
    if not torch.equal(x.grad, torch.ones_like(x)):
        failures.append("seed case: the round trip's gradient is not ones")
    return failures


def random_case(rank: int, cp: int, device, trial: int) -> list[str]:
    gen = torch.Generator().manual_seed(trial)
    lengths = [
        int(2 * cp * torch.randint(1, 6, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen)))
    ]
    if trial % 2:
        lengths.append(cp * 3)  # a padding tail split contiguously
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    stream = torch.randn(sum(lengths), 2, 3, generator=gen).to(device)
    n = stream.shape[0] // cp
    mine = zigzag_positions(lengths, cp, rank).to(device)
    x = stream[mine].clone().requires_grad_(True)
    packed = zigzag_to_packed_shard(x, cu)
    weights = torch.randn(packed.shape, generator=gen).to(device)
    (packed * weights).sum().backward()
    failures = []
    if not torch.equal(packed, stream[rank * n : (rank + 1) * n]):
        failures.append(f"random pack {lengths}: zigzag -> packed differs from the stream's shard")
    # the gradient reaches each zigzag row from the rank whose shard holds it
    whole_weights = torch.cat([torch.empty_like(weights)] * cp)
    dist.all_gather(list(whole_weights.chunk(cp)), weights.contiguous())
    if not torch.equal(x.grad, whole_weights[mine]):
        failures.append(f"random pack {lengths}: the gradient of zigzag -> packed is misplaced")
    shard = stream[rank * n : (rank + 1) * n].clone().requires_grad_(True)
    zig = packed_shard_to_zigzag(shard, cu)
    if not torch.equal(zig, stream[mine]):
        failures.append(f"random pack {lengths}: packed -> zigzag differs from the rank's zigzag rows")
    if not torch.equal(zigzag_to_packed_shard(zig.detach(), cu), shard.detach()):
        failures.append(f"random pack {lengths}: packed -> zigzag -> packed is not the identity")
    zig.sum().backward()
    if not torch.equal(shard.grad, torch.ones_like(shard)):
        failures.append(f"random pack {lengths}: the gradient of packed -> zigzag is not ones")
    return failures


def main() -> int:
    gpu = os.environ.get("MILES_RELAYOUT_BACKEND", "gloo") == "nccl"
    rank = int(os.environ["RANK"])
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    cp = dist.get_world_size()
    try:
        failures = seed_case(rank, cp, device)
        for trial in range(8):
            failures += random_case(rank, cp, device, trial)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    # one write of the whole line: with an unbuffered stdout, print writes the text and its newline
    # apart, and the two ranks' lines interleave on the shared pipe
    sys.stdout.write(
        f"rank {rank} of {cp}: " + ("; ".join(failures) if failures else "relayout exact") + "\n"
    )
    sys.stdout.flush()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
