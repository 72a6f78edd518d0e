"""Runs the SGLang adapter against sglang's own code, one scenario per process (test helper).

    python tests/unit/sglang_scenarios.py WORKDIR SCENARIO [SCENARIO ...]

prints {scenario: findings} as JSON on its last stdout line. The engine is
tests/unit/sglang_local.py's LocalEngine: a real `sglang.Engine` whose scheduler runs in this
process (see that file for what is sglang's own code and what stands in for the GPU). A
process of its own because importing sglang patches transformers and installs import
stand-ins, and because the `died` scenario has this process sent SIGQUIT. `group` runs two
ranks (gloo) of one two-GPU engine: it starts its second rank itself. `died` leaves the
engine stopped: give it last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: the project root on the path, as the tests have it
    sys.path.insert(0, str(HERE.parents[1]))

from tests.unit import sglang_imports  # noqa: E402

sglang_imports.install()

from tests.unit.sglang_local import LocalEngine  # noqa: E402


def tiny(workdir: Path, fp8: bool = False) -> Path:
    from miles.ckpt.tiny import make_tiny_checkpoint

    bf16 = workdir / "qwen3"
    if not (bf16 / "config.json").exists():
        make_tiny_checkpoint("qwen3", 2, bf16, dtype="bfloat16")
    if not fp8:
        return bf16
    out = workdir / "qwen3_fp8"
    if not (out / "config.json").exists():
        from miles.ckpt.fp8 import convert_to_fp8

        out.mkdir()
        convert_to_fp8(bf16, out, workers=1)
    return out


def tensors(path: Path) -> dict:
    from miles.ckpt.shards import CheckpointReader

    with CheckpointReader(path) as reader:
        return {name: reader.read(name) for name in reader.files.weight_map}


def adapter(checkpoint: Path, *flags: str, rank: int = 0, world: int = 1):
    from sglang.srt.server_args import ServerArgs

    from miles.train.args import parse_config
    from miles.train.distributed import DistInfo
    from miles.train.sglang_engine import SGLangRolloutEngine

    config = parse_config(["--hf-checkpoint", str(checkpoint), *flags])
    # The adapter only reads the device's name: the engine is the GPU stand-in.
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=f"cuda:{rank}", backend="gloo")
    return SGLangRolloutEngine(
        sglang=config.sglang,
        checkpoint=config.checkpoint,
        rollout=config.rollout,
        job=config.job,
        dist_info=info,
        engine_cls=LocalEngine,
        server_args_cls=ServerArgs,
    )


def sampling(**changes):
    from miles.train.config import SamplingConfig

    return SamplingConfig(**{"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_response_len": 4} | changes)


def bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def scenario_server_args(workdir: Path) -> list[dict]:
    """The engine's keyword arguments for each case of WORKDIR/server_args.json (trainer flags and
    rank layout), built against sglang's ServerArgs and constructed into a real one."""
    import pickle

    import msgspec
    from sglang.srt.server_args import ServerArgs

    from miles.train.args import parse_config
    from miles.train.distributed import DistInfo
    from miles.train.sglang_server import SGLangUnavailable, server_kwargs

    answers = []
    for case in json.loads((workdir / "server_args.json").read_text()):
        config = parse_config(case["argv"])
        dist = DistInfo(
            rank=case.get("rank", 0),
            world_size=case.get("local_world", 1),
            local_rank=case.get("local_rank", 0),
            device=f"cuda:{case.get('local_rank', 0)}",
            backend="nccl",
        )
        try:
            kwargs = server_kwargs(
                config.sglang,
                dist,
                ServerArgs,
                model_path=config.checkpoint.hf_checkpoint,
                seed=config.rollout.rollout_seed,
                local_world_size=case.get("local_world", 1),
            )
        except SGLangUnavailable as exc:
            answers.append({"error": str(exc)})
            continue
        built = ServerArgs(**kwargs)
        answers.append(
            {
                "kwargs": {k: v for k, v in kwargs.items() if k != "custom_sigquit_handler"},
                "built": {k: getattr(built, k) for k in kwargs if k != "custom_sigquit_handler"},
                "types": {
                    k: type(getattr(built, k)).__name__ for k in kwargs if k != "custom_sigquit_handler"
                },
                "is_msgspec_struct": issubclass(ServerArgs, msgspec.Struct),
                # sglang pickles the server arguments into the engine's processes (spawn)
                "pickles": pickle.loads(pickle.dumps(built)).custom_sigquit_handler
                is kwargs["custom_sigquit_handler"],
                "rollout_seed": config.rollout.rollout_seed,
            }
        )
    return answers


def scenario_session(workdir: Path) -> dict:
    """A training step's memory release, a weight push in buckets, then a rollout."""
    from miles.train.sglang_weights import FLATTENED, serialize_bucket

    ckpt = tiny(workdir)
    engine = adapter(ckpt, "--update-weight-buffer-size", "60000", "--colocate")
    new = {name: t * 0.5 for name, t in tensors(ckpt).items()}
    payload, _keep = serialize_bucket(list(new.items())[:1])
    outside = engine.engine.update_weights_from_tensor(
        named_tensors=[payload], load_format=FLATTENED, flush_cache=False
    )
    LocalEngine.log.clear()
    _record_clear_memory()
    engine.release_memory()
    engine.release_memory()
    engine.update_weights(iter(new.items()))
    generations = engine.generate([[5, 6, 7], [9]], sampling(), seed=3)
    model = engine.engine.tokenizer_manager.scheduler.models[0]
    params = model.params()
    return {
        "outside_session": list(outside),
        "colocated": engine.colocated,
        "log": [list(e) for e in LocalEngine.log],
        "all_pushed": all(bits_equal(params[n], t) for n, t in new.items()),
        "loaded": len(model.loaded),
        "tensors": len(new),
        "generations": [[g.finish_reason, len(g.response_ids), len(g.logprobs)] for g in generations],
    }


def _record_clear_memory() -> None:
    """Log the adapter's allocator-cache clears among the engine's requests (and still clear)."""
    import miles.train.sglang_engine as adapter_module

    clear = adapter_module.clear_memory

    def recorded():
        LocalEngine.log.append(("clear_memory",))
        clear()

    adapter_module.clear_memory = recorded


def scenario_fp8(workdir: Path) -> dict:
    """The bf16 weights pushed into an engine serving the FP8 checkpoint made from them."""
    fp8 = tiny(workdir, fp8=True)
    engine = adapter(fp8)
    engine.update_weights(iter(tensors(tiny(workdir)).items()))
    params = engine.engine.tokenizer_manager.scheduler.models[0].params()
    written = tensors(fp8)
    return {
        "differing": sorted(n for n, t in written.items() if not bits_equal(params[n], t)),
        "fp8_tensors": sum(str(t.dtype) == "torch.float8_e4m3fn" for t in written.values()),
    }


def scenario_oversized(workdir: Path) -> dict:
    from miles.train.rollout import RolloutEngineError

    engine = adapter(tiny(workdir))
    context = json.loads((tiny(workdir) / "config.json").read_text())["max_position_embeddings"]
    try:
        engine.generate([[5] * context], sampling(), seed=0)
    except RolloutEngineError as exc:
        return {"error": str(exc), "colocated": engine.colocated}
    return {"error": None, "colocated": engine.colocated}


def scenario_probe_sampling(workdir: Path) -> dict:
    """What miles sends for rollouts and for the weight check, through sglang's SamplingParams."""
    from dataclasses import replace

    from sglang.srt.sampling.sampling_params import SamplingParams

    from miles.train.checks import probe_sampling
    from miles.train.sglang_engine import sampling_params

    out = {}
    for name, config in (
        ("rollout", sampling(top_k=20)),
        ("probe", probe_sampling(sampling(temperature=0.7))),
    ):
        params = SamplingParams(**sampling_params(config, None))
        params.normalize(None)
        params.verify(512)
        out[name] = {"temperature": params.temperature, "top_k": params.top_k}
    greedy = SamplingParams(**sampling_params(replace(sampling(), temperature=0.0), None))
    greedy.normalize(None)
    out["temperature_0"] = {"temperature": greedy.temperature, "top_k": greedy.top_k}
    return out


def scenario_died(workdir: Path) -> dict:
    """An engine process dies while a rollout waits on it (sglang's watchdog sends SIGQUIT)."""
    import multiprocessing

    from sglang.srt.utils.watchdog import SubprocessWatchdog

    from miles.train.rollout import RolloutEngineError

    engine = adapter(tiny(workdir))
    engine.generate([[5]], sampling(), seed=0)  # the handle loop (and its SIGQUIT handler) starts
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), name="scheduler_TP0")
    child.start()
    tm = engine.engine.tokenizer_manager
    tm._subprocess_watchdog = SubprocessWatchdog([child], ["scheduler_TP0"], interval=0.1)
    tm._subprocess_watchdog.start()
    tm.scheduler_alive = child.is_alive
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    started = time.monotonic()
    try:
        engine.generate([[5]], sampling(), seed=0)
    except RolloutEngineError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started, "alive": True}
    return {"error": None}


def scenario_group(workdir: Path) -> dict:
    """Rank 0 of a two-rank engine group; starts rank 1 and merges both ranks' findings."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tiny(workdir)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    follower = subprocess.Popen(
        [sys.executable, __file__, str(workdir), "group-rank"], env={**env, "RANK": "1"},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.environ.update({**env, "RANK": "0"})
    mine = scenario_group_rank(workdir)
    out, _ = follower.communicate(timeout=300)
    return {
        "leader": mine,
        "follower": json.loads(out.strip().splitlines()[-1])["group-rank"],
        "follower_rc": follower.returncode,
    }


def scenario_group_rank(workdir: Path) -> dict:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    # CPU tensors cross processes as shared-memory files (GPU tensors go as CUDA IPC handles);
    # the default, file descriptors, needs the two ranks to share a multiprocessing authkey
    torch.multiprocessing.set_sharing_strategy("file_system")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    ckpt = tiny(workdir)
    engine = adapter(ckpt, "--rollout-num-gpus-per-engine", "2", "--update-weight-buffer-size", "60000",
                     rank=rank, world=2)  # fmt: skip
    # each rank pushes its own values, so the engine shows which rank's payload each TP rank loaded
    mine = {name: torch.full_like(t, rank + 1) for name, t in tensors(ckpt).items()}
    engine.update_weights(iter(mine.items()))
    prompts = [[5, 6]] if rank == 0 else [[7, 8, 9], [10]]
    generations = engine.generate(prompts, sampling(), seed=1)
    found = {
        "prompts_back": [list(g.prompt_ids) for g in generations],
        "group_backend": str(dist.get_backend(engine.group.group)),
        "group_ranks": list(engine.group.ranks),
    }
    if engine.engine is not None:
        models = engine.engine.tokenizer_manager.scheduler.models
        found["tp_rank_values"] = [
            sorted({float(p.float().unique()[0]) for p in m.params().values() if p.numel()}) for m in models
        ]
    dist.barrier()
    return found


SCENARIOS = {
    "server-args": scenario_server_args,
    "session": scenario_session,
    "fp8": scenario_fp8,
    "oversized": scenario_oversized,
    "probe-sampling": scenario_probe_sampling,
    "died": scenario_died,
    "group": scenario_group,
    "group-rank": scenario_group_rank,
}


if __name__ == "__main__":
    workdir = Path(sys.argv[1])
    print(json.dumps({name: SCENARIOS[name](workdir) for name in sys.argv[2:]}), flush=True)
    os._exit(0)  # sglang's atexit shutdown would kill this process's children, the test's own included
