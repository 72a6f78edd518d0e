"""The helper process of `miles.megatron.proof.prove`: gloo ranks that run megatron-core.

`python -m miles.megatron.ranks CASES.json VERDICTS.json` imports megatron-core once,
then for each world size forks that many ranks joined in a gloo process group; every rank
tries every layout of its world in turn (see miles.megatron.proof for what it runs) and
reports back one verdict per layout.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from miles.load import LoadClock
from miles.megatron.proof import FAMILY_STAGE, STAGES, ProofError
from miles.parallel.layout import ModelShape, ParallelLayout

_GROUPS = ("tp", "pp", "cp", "dp", "ep", "etp", "edp")
_HIDDEN_PER_HEAD = 8  # tiny widths: only the shapes' divisibility matters here
_RANK_TIMEOUT_S = 300  # without progress, counted at the machine's load (miles.load); 120 s cut a
# busy 2-core machine's 8-rank layout short (250 s wall at peak load 9.8) while nothing hung
_LOAD_STRETCH = 10.0


def _helper(inp: Path, out: Path) -> int:
    import warnings

    # Transformer Engine and Apex are GPU-only; megatron-core warns about each missing one.
    warnings.filterwarnings("ignore")
    import multiprocessing

    import megatron.core.parallel_state  # noqa: F401  (import once; forked ranks share it)
    import torch  # noqa: F401

    cases = json.loads(inp.read_text())
    results: list[dict | None] = [None] * len(cases)
    by_world: dict[int, list[int]] = {}
    for i, case in enumerate(cases):
        by_world.setdefault(case["world_size"], []).append(i)
    ctx = multiprocessing.get_context("fork")
    for world, indices in sorted(by_world.items()):
        verdicts = _run_world(ctx, world, [cases[i] for i in indices])
        for i, v in zip(indices, verdicts, strict=True):
            results[i] = v
    out.write_text(json.dumps(results))
    return 0


def _run_world(ctx, world: int, cases: list[dict]) -> list[dict]:
    import socket

    import torch.distributed as dist

    # The helper hosts the rendezvous store on a port of its own (so concurrent proofs cannot
    # collide), but starts it only after forking the ranks: a child forked while the store's
    # server thread holds a lock can hang forever. The listening socket reserves the port and
    # queues the ranks' connections until the store takes it over.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(world + 1)
    port = listener.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, world, port, cases, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    # The store owns the socket from here on (and closes it).
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world + 1,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    try:
        per_rank = _collect(queue, procs, world)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store  # stops its server thread before the next world forks
    return [_merge(world, [per_rank[r][i] for r in range(world)]) for i in range(len(cases))]


def _collect(queue, procs, world: int) -> dict[int, list[dict]]:
    import queue as queues
    import time

    per_rank: dict[int, list[dict]] = {}
    # The deadline counts from the last sign of progress, so a long batch of layouts on a busy
    # machine is not cut short while every layout still finishes in time; and at the machine's
    # load: eight ranks on a shared 2-core machine are slow, not hung.
    clock = LoadClock(_RANK_TIMEOUT_S, _LOAD_STRETCH, time.monotonic())
    while len(per_rank) < world:
        try:
            rank, verdicts = queue.get(timeout=1)
            clock.restart(time.monotonic())
            if verdicts is not None:  # None: one more layout done
                per_rank[rank] = verdicts
            continue
        except queues.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in per_rank]
        if dead:
            raise ProofError(
                f"gloo rank(s) {dead} of world size {world} died (exit {procs[dead[0]].exitcode})"
            )
        if clock.expired(time.monotonic()):
            waited = clock.last - clock.started
            raise ProofError(
                f"gloo ranks of world size {world} made no progress in {waited:.0f} s ({_RANK_TIMEOUT_S} s at the "
                f"machine's load, peak load average {clock.peak:.1f} on {clock.cores} cores): a layout hung"
            )
    return per_rank


def _merge(world: int, ranks: list[dict]) -> dict:
    """One verdict from every rank's: they must agree; groups are the union of each rank's own."""
    first = ranks[0]
    for rank, r in enumerate(ranks):
        if (r["ok"], r["stage"], r["error"]) != (first["ok"], first["stage"], first["error"]):
            raise ProofError(
                f"ranks 0 and {rank} of world {world} disagree: {first['error']} vs {r['error']}"
            )
    groups = {}
    for name in _GROUPS:
        seen = {tuple(r["groups"][name]) for r in ranks if r.get("groups")}
        if seen:
            groups[name] = sorted(seen)
    return {**first, "groups": groups}


def _rank(rank: int, world: int, port: int, cases: list[dict], queue) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=_RANK_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        verdicts = []
        for case in cases:
            verdicts.append(_try_layout(case))
            queue.put((rank, None))
        dist.barrier()  # nobody tears the group down while another rank still uses it
        queue.put((rank, verdicts))
    finally:
        dist.destroy_process_group()


def _try_layout(case: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.megatron.training import init_parallel_state

    before = set(dist.distributed_c10d._world.pg_map)
    layout = ParallelLayout(**case["layout"])
    model = ModelShape(**case["model"]) if case["model"] else None
    result: dict = {"ok": True, "stage": None, "error": None, "layers_per_stage": None, "groups": None}
    stage = STAGES[0]
    try:
        # the trainer's own call: the layout's one translation into megatron-core's arguments
        init_parallel_state(layout, gloo_groups=False)  # the default groups are gloo already on CPU
        result["groups"] = _own_groups(ps)
        if model is not None:
            stage = "TransformerConfig"
            transformer = _transformer_config(layout, model)
            stage = "get_num_layers_to_build"
            result["layers_per_stage"] = _layers_per_stage(transformer, layout)
            if model.shared_index_layers:
                stage = "miles.megatron.blocks"
                _check_chunk_starts(transformer, layout, model)
            if model.vocab_size is not None:
                from megatron.core.tensor_parallel.utils import VocabUtility

                stage = "VocabParallelEmbedding"  # its constructor's split of the vocabulary over tp
                VocabUtility.vocab_range_from_global_vocab_size(
                    model.vocab_size, ps.get_tensor_model_parallel_rank(), layout.tp
                )
            stage = FAMILY_STAGE  # what the family's own modules refuse when they are built
            problem = model.limits.cp_problem(layout.cp) or model.limits.tp_problem(layout.tp)
            if problem:
                raise ValueError(problem)
            if model.num_experts is not None:
                stage = "MoELayer"
                layer = _build_moe_layer(transformer)
                stage = "miles.megatron.training"
                _check_expert_replicas(layer, transformer)
                stage = "MoELayer.forward"
                _enter_moe_forward(layer)
    except Exception as exc:  # megatron-core raises ValueError, RuntimeError or AssertionError
        result.update(ok=False, stage=stage, error=_describe(exc))
    finally:
        # Every rank is done with this layout's groups before any tears them down: a rank that
        # fails early (a TransformerConfig assertion) would otherwise destroy a gloo group another
        # rank is still connecting, which then reports "Connection closed by peer" instead of the
        # layout's own verdict (seen on a loaded 2-core machine at world 8). The ranks run the same
        # deterministic checks, so they all get here.
        dist.barrier()
        ps.destroy_model_parallel()
        # destroy_model_parallel forgets megatron-core's groups but leaves them alive, each
        # with its gloo threads and sockets; hundreds of layouts would pile them up.
        for group in set(dist.distributed_c10d._world.pg_map) - before:
            dist.destroy_process_group(group)
    return result


def _own_groups(ps) -> dict:
    import torch.distributed as dist

    getters = {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "cp": ps.get_context_parallel_group,
        "dp": ps.get_data_parallel_group,
        "ep": ps.get_expert_model_parallel_group,
        "etp": ps.get_expert_tensor_parallel_group,
        "edp": ps.get_expert_data_parallel_group,
    }
    return {name: dist.get_process_group_ranks(get()) for name, get in getters.items()}


def _transformer_config(layout: ParallelLayout, model: ModelShape):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.num_attention_heads * _HIDDEN_PER_HEAD,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        add_bias_linear=model.bias,
        **layout.transformer_config_kwargs(),  # the trainer's translation
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    if model.num_experts is not None:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=_expert_width(model, layout.expert_tp),
            moe_token_dispatcher_type="alltoall",
        )
    if model.attention == "dsa":
        kwargs.update(experimental_attention_variant="dsa", apply_rope_fusion=False)
    return TransformerConfig(**kwargs)


def _expert_width(model: ModelShape, etp: int) -> int:
    """A small FFN width with the model's remainder modulo etp (so etp splits it exactly when it
    splits the real one); a model without a width gets one etp splits."""
    unit = 8 * etp
    if model.moe_ffn_hidden_size is None:
        return unit
    return model.moe_ffn_hidden_size % unit + unit


def _layers_per_stage(transformer, layout: ParallelLayout) -> list[int]:
    """Layers each pipeline rank builds: per virtual stage times the virtual stages."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    out = []
    for rank in range(layout.pp):
        chunks = [
            get_num_layers_to_build(transformer, vp_stage=v if layout.interleaved else None, pp_rank=rank)
            for v in range(layout.model_chunks)
        ]
        out.append(sum(chunks))
    return out


def _check_chunk_starts(transformer, layout: ParallelLayout, model: ModelShape) -> None:
    """What miles' GLM model refuses when it builds each model chunk: one that starts on a layer
    reusing the DSA top-k of a layer in another chunk."""
    from miles.megatron.blocks import check_chunk_start

    shared = set(model.shared_index_layers)
    kinds = tuple("shared" if i in shared else "full" for i in range(model.num_layers))
    for rank in range(layout.pp):
        for v in range(layout.model_chunks):
            check_chunk_start(transformer, kinds, vp_stage=v if layout.interleaved else None, pp_rank=rank)


def _build_moe_layer(transformer):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from miles.megatron.compat import without_dispatcher_stream

    without_dispatcher_stream()
    spec = get_gpt_layer_local_spec(num_experts=transformer.num_moe_experts, moe_grouped_gemm=False)
    return MoELayer(
        transformer,
        submodules=spec.submodules.mlp.submodules,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def _check_expert_replicas(layer, transformer) -> None:
    """What miles' trainer refuses before wrapping a model in DDP: expert weights copied over a
    tensor-parallel group that megatron-core reduces over data parallel only (read from the
    built layer's own `allreduce` marks)."""
    from miles.megatron.training import check_expert_replicas

    check_expert_replicas(layer, transformer)


def _enter_moe_forward(layer) -> None:
    """Run MoELayer.forward's entry checks: its first statement refuses MoE with tp > 1 and no
    sequence parallel in training; without input it then stops before any communication."""
    layer.train()
    try:
        layer(None)
    except ValueError as exc:
        if "tensor parallelism" in str(exc):
            raise
    except Exception:  # the missing input, past the checks: the layout was accepted
        pass


def _describe(exc: BaseException) -> str:
    message = str(exc).strip()
    if not message:
        # A bare `assert` carries no message; its source line is megatron-core's rule.
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"{frame.line} ({_site_relative(frame.filename)}:{frame.lineno})"
    return f"{type(exc).__name__}: {' '.join(message.split())}"


def _site_relative(path: str) -> str:
    marker = f"{os.sep}megatron{os.sep}"
    return "megatron/" + path.split(marker, 1)[1] if marker in path else path


if __name__ == "__main__":
    sys.exit(_helper(Path(sys.argv[1]), Path(sys.argv[2])))
