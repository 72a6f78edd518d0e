"""One rank of tests/e2e/test_det_process_group.py (launched by torchrun, 4 ranks): every check
of the deterministic process group against hand-computed sums; exits non-zero on the first miss."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import miles.train.deterministic as det

BACKEND = sys.argv[1]  # gloo | nccl
DEVICE = "cpu" if BACKEND == "gloo" else None


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(
            f"rank {dist.get_rank()}: {name}: {got.flatten()[:4].tolist()} != {want.flatten()[:4].tolist()}"
        )


def tree4(p: list[torch.Tensor]) -> torch.Tensor:
    return (p[0] + p[1]) + (p[2] + p[3])


def order_sensitive(rank: int, n: int = 4096) -> torch.Tensor:
    """Values whose float sum depends on the order: magnitudes from 1e-8 to 1e8."""
    g = torch.Generator().manual_seed(1234 + rank)
    scale = 10.0 ** torch.randint(-8, 9, (n,), generator=g).float()
    return (torch.randn(n, generator=g) * scale).to(DEVICE)


def main() -> None:
    global DEVICE
    det.register_backends()
    dist.init_process_group(det.DET_BACKENDS[BACKEND])
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    if DEVICE is None:
        DEVICE = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(DEVICE)
    assert dist.get_backend() == det.DET_BACKENDS[BACKEND], dist.get_backend()
    parts = [order_sensitive(r) for r in range(world)]
    x, tree = parts[rank], tree4(parts)

    # the bracketing: a sequential fold would lose the two halves of an ulp that the tree keeps
    tiny = torch.tensor([0.5, 0.5, 2.0**-53, 2.0**-53], dtype=torch.float64, device=DEVICE)[rank].reshape(1)
    dist.all_reduce(tiny)
    check("pairwise tree of 4 ranks", tiny, torch.tensor([1.0 + 2.0**-52], dtype=torch.float64))

    y = x.clone()
    dist.all_reduce(y)
    check("all_reduce SUM == tree", y, tree)
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.AVG)
    check("all_reduce AVG == tree / world", y, tree / world)
    y = x.reshape(64, 64).t().clone().t()  # another memory layout, same values
    dist.all_reduce(y)
    check("all_reduce of a non-contiguous view", y.reshape(-1), tree)

    shard = torch.empty(x.numel() // world, device=DEVICE)
    dist.reduce_scatter_tensor(shard, x.clone())
    check("reduce_scatter_tensor == its slice of all_reduce", shard, tree.chunk(world)[rank])
    listed = torch.empty_like(shard)
    dist.reduce_scatter(listed, [c.contiguous() for c in x.clone().chunk(world)])
    check("reduce_scatter (list) == its slice", listed, tree.chunk(world)[rank])

    reduced = x.clone()
    dist.reduce(reduced, dst=0)
    if rank == 0:
        check("reduce to rank 0 == tree", reduced, tree)

    with _coalescing_manager(async_ops=False):
        a, b = x.clone(), (x * 3).clone()
        dist.all_reduce(a)
        dist.all_reduce(b)
    check("coalesced all_reduce", a, tree)
    check("coalesced all_reduce (second)", b, tree4([p * 3 for p in parts]))

    saved = det.GATHER_CAP_BYTES
    det.GATHER_CAP_BYTES = world * 64 * x.element_size()  # 64 elements per gather
    try:
        y = x.clone()
        dist.all_reduce(y)
        check("all_reduce in chunks == in one piece", y, tree)
    finally:
        det.GATHER_CAP_BYTES = saved

    # a three-rank group folds in rank order: 1 + 2^-53 + 2^-53 stays 1 (a tree would keep 2^-52)
    trio = dist.new_group([0, 1, 2])
    if rank < 3:
        value = torch.tensor([1.0, 2.0**-53, 2.0**-53], dtype=torch.float64, device=DEVICE)[rank].reshape(1)
        dist.all_reduce(value, group=trio)
        check("ascending fold of 3 ranks", value, torch.tensor([1.0], dtype=torch.float64))

    # everything else goes to the inner group
    top = torch.full((4,), float(rank), device=DEVICE)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    check("MAX", top, torch.full((4,), float(world - 1)))
    sent = torch.full((4,), float(rank), device=DEVICE)
    dist.broadcast(sent, src=0)
    check("broadcast", sent, torch.zeros(4))
    pieces = [torch.empty(2, device=DEVICE) for _ in range(world)]
    dist.all_gather(pieces, torch.full((2,), float(rank), device=DEVICE))
    check("all_gather", torch.stack(pieces)[:, 0], torch.arange(world, dtype=torch.float32))
    flat = torch.empty(2 * world, device=DEVICE)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device=DEVICE))
    check("all_gather_into_tensor", flat[::2], torch.arange(world, dtype=torch.float32))
    swapped = torch.empty(world, device=DEVICE)
    dist.all_to_all_single(swapped, torch.arange(world, dtype=torch.float32, device=DEVICE) + 10 * rank)
    check("all_to_all_single", swapped, torch.tensor([float(rank + 10 * q) for q in range(world)]))
    peer = rank ^ 1
    incoming = torch.empty(3, device=DEVICE)
    if rank % 2 == 0:
        dist.send(torch.full((3,), float(rank), device=DEVICE), dst=peer)
        dist.recv(incoming, src=peer)
    else:
        dist.recv(incoming, src=peer)
        dist.send(torch.full((3,), float(rank), device=DEVICE), dst=peer)
    check("send/recv", incoming, torch.full((3,), float(peer)))
    objects: list[object] = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world)], objects
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.write(f"rank {rank}: every check passed\n")  # one write: ranks share the pipe
    sys.stdout.flush()


if __name__ == "__main__":
    main()
