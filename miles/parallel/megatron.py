"""Prove layout verdicts with megatron-core itself, on the CPU, under gloo.

`prove(cases)` starts one helper process that imports megatron-core once and, for each world
size, forks that many ranks joined in a gloo process group. Every rank tries every layout of
its world size in turn, the way a training start meets them: `initialize_model_parallel`
(the rank grids), `TransformerConfig` (the model config checks), `get_num_layers_to_build`
for every pipeline stage, and a MoE layer built on the expert groups; then
`destroy_model_parallel` before the next layout. megatron-core's verdict and exact message
come back as `MegatronVerdict`s. Its model forward does not run on CPU; none of this needs it.

The caller never imports megatron-core or torch: only the helper does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles.parallel.layout import ModelShape, ParallelConfig, Verdict

STAGES = ("initialize_model_parallel", "TransformerConfig", "get_num_layers_to_build", "MoELayer")
_GROUPS = ("tp", "pp", "cp", "dp", "ep", "etp", "edp")
_HIDDEN_PER_HEAD = 8  # tiny widths: only the shapes' divisibility matters here
_RANK_TIMEOUT_S = 120

# Which rule a megatron-core failure corresponds to: (stage, pattern in its message, rule id).
_MEGATRON_RULES = (
    ("initialize_model_parallel", r"expert_tensor_model_pipeline_parallel", "expert-grid"),
    ("initialize_model_parallel", r"world_size \(\d+\) is not divisible by \d+$", "dense-grid"),
    ("TransformerConfig", r"sequence parallelism without tensor parallelism", "sp-needs-tp"),
    ("TransformerConfig", r"num_attention_heads .* tensor_model_parallel_size", "heads-tp"),
    ("TransformerConfig", r"num_query_groups .* tensor_model_parallel_size", "kv-heads-tp"),
    ("TransformerConfig", r"num_moe_experts must be non None to use expert-parallel", "ep-needs-moe"),
    ("TransformerConfig", r"pipeline stage|middle (layers|stage|pipeline)", "stage-layers"),
    ("TransformerConfig", r"DSAttention", "dsa-cp"),
    ("get_num_layers_to_build", r"uneven pipelineing", "stage-layers"),
    (
        "get_num_layers_to_build",
        r"num_layers should be divisible by pipeline_model_parallel_size",
        "layers-pp",
    ),
    ("MoELayer", r"num_moe_experts % ep_size", "experts-ep"),
)


@dataclass(frozen=True)
class Case:
    config: ParallelConfig
    world_size: int
    model: ModelShape | None = None

    def to_json(self) -> dict:
        return {
            "config": self.config.to_json(),
            "world_size": self.world_size,
            "model": self.model.to_json() if self.model else None,
        }


@dataclass(frozen=True)
class MegatronVerdict:
    ok: bool
    stage: str | None = None  # the megatron-core call that refused the layout
    error: str | None = None  # "<ExceptionType>: <megatron-core's message>"
    layers_per_stage: tuple[int, ...] | None = None
    groups: dict = field(default_factory=dict)  # name -> sorted rank groups, from every rank

    @property
    def rule(self) -> str | None:
        """The miles rule id megatron-core's failure corresponds to (None when ok or unknown)."""
        if self.ok:
            return None
        for stage, pattern, rule in _MEGATRON_RULES:
            if stage == self.stage and re.search(pattern, self.error or ""):
                return rule
        return None

    def agrees_with(self, verdict: Verdict) -> bool:
        if verdict.ok or self.ok:
            return verdict.ok == self.ok
        return verdict.violations[0].rule == self.rule

    def summary(self) -> str:
        if self.ok:
            return "accepted"
        return f"{self.stage}: {self.error}"


class ProofError(RuntimeError):
    """megatron-core could not be run (not installed, a rank died or hung)."""


def prove(cases: Sequence[Case], timeout_s: float = 600) -> list[MegatronVerdict]:
    """megatron-core's verdict on each case, in order (one helper process for all of them)."""
    with tempfile.TemporaryDirectory(prefix="miles-megatron-") as tmp:
        inp, out = Path(tmp, "cases.json"), Path(tmp, "verdicts.json")
        inp.write_text(json.dumps([c.to_json() for c in cases]))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "miles.parallel.megatron", str(inp), str(out)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ProofError(
                f"megatron-core proof of {len(cases)} layout(s) did not finish in {timeout_s:g} s"
            ) from None
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise ProofError(f"megatron-core proof failed (exit {proc.returncode}):\n" + "\n".join(tail))
        raw = json.loads(out.read_text())
    return [_verdict(r) for r in raw]


def _verdict(r: dict) -> MegatronVerdict:
    layers = r.get("layers_per_stage")
    return MegatronVerdict(
        ok=r["ok"],
        stage=r.get("stage"),
        error=r.get("error"),
        layers_per_stage=tuple(layers) if layers is not None else None,
        groups={k: [list(g) for g in v] for k, v in (r.get("groups") or {}).items()},
    )


def megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"


# --- the helper process ----------------------------------------------------------------------


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
    import torch.distributed as dist

    # The helper hosts the rendezvous store on a free port, so concurrent proofs cannot collide.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, world, store.port, cases, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        per_rank = _collect(queue, procs, world)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [_merge(world, [per_rank[r][i] for r in range(world)]) for i in range(len(cases))]


def _collect(queue, procs, world: int) -> dict[int, list[dict]]:
    import queue as queues
    import time

    per_rank: dict[int, list[dict]] = {}
    deadline = time.monotonic() + _RANK_TIMEOUT_S
    while len(per_rank) < world:
        try:
            rank, verdicts = queue.get(timeout=1)
            per_rank[rank] = verdicts
            continue
        except queues.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in per_rank]
        if dead:
            raise ProofError(
                f"gloo rank(s) {dead} of world size {world} died (exit {procs[dead[0]].exitcode})"
            )
        if time.monotonic() > deadline:
            raise ProofError(f"gloo ranks of world size {world} did not finish in {_RANK_TIMEOUT_S} s")
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
        verdicts = [_try_layout(case) for case in cases]
        dist.barrier()  # nobody tears the group down while another rank still uses it
        queue.put((rank, verdicts))
    finally:
        dist.destroy_process_group()


def _try_layout(case: dict) -> dict:
    from megatron.core import parallel_state as ps

    config = ParallelConfig(**case["config"])
    model = ModelShape(**case["model"]) if case["model"] else None
    result: dict = {"ok": True, "stage": None, "error": None, "layers_per_stage": None, "groups": None}
    stage = STAGES[0]
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=config.tp,
            pipeline_model_parallel_size=config.pp,
            context_parallel_size=config.cp,
            expert_model_parallel_size=config.ep,
            expert_tensor_parallel_size=config.etp,
            create_gloo_process_groups=False,  # the default groups are gloo already on CPU
        )
        result["groups"] = _own_groups(ps)
        if model is not None:
            stage = "TransformerConfig"
            transformer = _transformer_config(config, model)
            stage = "get_num_layers_to_build"
            result["layers_per_stage"] = _layers_per_stage(transformer, config.pp)
            if model.num_experts is not None:
                stage = "MoELayer"
                _build_moe_layer(transformer)
    except Exception as exc:  # megatron-core raises ValueError, RuntimeError or AssertionError
        result.update(ok=False, stage=stage, error=_describe(exc))
    finally:
        ps.destroy_model_parallel()
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


def _transformer_config(config: ParallelConfig, model: ModelShape):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.num_attention_heads * _HIDDEN_PER_HEAD,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        context_parallel_size=config.cp,
        expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.etp,
        sequence_parallel=config.sp,
        num_layers_in_first_pipeline_stage=config.first_stage_layers,
        num_layers_in_last_pipeline_stage=config.last_stage_layers,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    if model.num_experts is not None:
        kwargs.update(num_moe_experts=model.num_experts, moe_ffn_hidden_size=4 * _HIDDEN_PER_HEAD)
    if model.attention == "dsa":
        kwargs.update(experimental_attention_variant="dsa", apply_rope_fusion=False)
    return TransformerConfig(**kwargs)


def _layers_per_stage(transformer, pp: int) -> list[int]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return [get_num_layers_to_build(transformer, pp_rank=r) for r in range(pp)]


def _build_moe_layer(transformer) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec = get_gpt_layer_local_spec(num_experts=transformer.num_moe_experts, moe_grouped_gemm=False)
    MoELayer(
        transformer,
        submodules=spec.submodules.mlp.submodules,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


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
