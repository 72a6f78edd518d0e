"""A training run of several nodes as a Ray job: `python -m miles.recipes.ray_job --nodes N
--procs-per-node G [--gpus-per-node G] -- python -m miles.train FLAGS...` is the entrypoint the
launcher submits to an existing Ray cluster (miles.recipes.launch).

Ray places the run: one placement group with a bundle per node (`STRICT_SPREAD`: every bundle
on another node; G GPUs each on GPU clusters, one CPU on the CPU), and one actor per bundle,
which starts the node's share of the trainer's ranks with torch's launcher (`--nnodes N
--node-rank I --nproc-per-node G`, rendezvous at the first actor's node and a free port there).
The trainer's own process groups do the rest, as under a one-node torchrun. Each actor's output
is the job's log; the job exits with the worst rank's exit code. Ray is the distributed engine:
miles starts no cluster and runs no manager of its own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("python -m miles.recipes.ray_job: give the trainer's command after --")
    split = argv.index("--")
    parser = argparse.ArgumentParser(
        prog="python -m miles.recipes.ray_job", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--procs-per-node", type=int, required=True, help="trainer ranks on each node")
    parser.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs each node's bundle holds (0 on CPU)"
    )
    parser.add_argument("--workdir", help="where the ranks run (the submitter's directory: relative paths)")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def trainer_module(command: list[str]) -> list[str]:
    """`python -m miles.train FLAGS` -> the part after the interpreter (`-m miles.train FLAGS`)."""
    if len(command) < 3 or command[1] != "-m":
        raise SystemExit(
            f"python -m miles.recipes.ray_job: expected `python -m MODULE ...` after --, got {command[:3]}"
        )
    return command[1:]


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    args, command = parse(list(sys.argv[1:] if argv is None else argv))
    module = trainer_module(command)
    ray.init(address="auto")
    bundle = {"CPU": 1, **({"GPU": args.gpus_per_node} if args.gpus_per_node else {})}
    group = placement_group([dict(bundle) for _ in range(args.nodes)], strategy="STRICT_SPREAD")
    ray.get(group.ready())

    @ray.remote
    class NodeRanks:
        """The trainer ranks of one node."""

        def address(self) -> tuple[str, int]:
            import socket

            host = ray.util.get_node_ip_address()
            with socket.socket() as sock:
                sock.bind((host, 0))
                return host, sock.getsockname()[1]

        def run(self, node_rank: int, master: tuple[str, int]) -> int:
            launcher = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                "--node-rank", str(node_rank), "--nproc-per-node", str(args.procs_per_node),
                "--master-addr", master[0], "--master-port", str(master[1]),
            ]  # fmt: skip
            node = ray.get_runtime_context().get_node_id()
            print(f"miles.ray_job: node rank {node_rank} on Ray node {node} starts its ranks", flush=True)
            done = subprocess.run([*launcher, *module], env=dict(os.environ), cwd=args.workdir, check=False)
            return done.returncode

    actors = [
        NodeRanks.options(
            num_cpus=1,
            num_gpus=args.gpus_per_node,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote()
        for i in range(args.nodes)
    ]
    master = ray.get(actors[0].address.remote())
    codes = ray.get([actor.run.remote(i, master) for i, actor in enumerate(actors)])
    print(f"miles.ray_job: node exit codes {codes}", flush=True)
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
