"""`python -m miles.parallel check`: is a parallel layout valid, and does megatron-core agree?

    python -m miles.parallel check --world-size 4 --tp 2 --pp 2 --ep 2 --etp 1 [--megatron]
    python -m miles.parallel check --world-size 4 --tp 2 --pp 2 --vpp 2 --layers 8 --heads 8
    python -m miles.parallel check --world-size 8 --tp 4 --sp --ep 8 --etp 1 --layers 48 --heads 32 --kv-heads 4 --experts 128

The first line printed is the verdict. Exit codes: 0 valid, 1 invalid (or miles and
megatron-core disagree), 2 bad usage, 3 megatron-core could not be run.
"""

from __future__ import annotations

import argparse
import json
import sys

from miles.megatron.proof import ProofError, check_proof_size
from miles.parallel.layout import ATTENTION_KINDS, CP_COMM_TYPES, ModelShape, ParallelLayout
from miles.parallel.verdict import Verdict, validate


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (the flag and what is wrong), not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m miles.parallel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    p = sub.add_parser("check", help="validate a layout (and prove it with megatron-core with --megatron)")
    p.add_argument("--world-size", type=int, required=True, help="ranks (GPUs) in the job")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument(
        "--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank (needs pp > 1)"
    )
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument(
        "--cp-comm-type", choices=(*CP_COMM_TYPES, "allgather"), help="context parallel communication"
    )
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    p.add_argument("--sp", "--sequence-parallel", dest="sp", action="store_true", help="sequence parallel")
    p.add_argument("--first-stage-layers", type=int, help="layers on the first pipeline stage")
    p.add_argument("--last-stage-layers", type=int, help="layers on the last pipeline stage")
    m = p.add_argument_group("model (optional; without it only the rank-grid rules apply)")
    m.add_argument("--layers", type=int, help="transformer layers")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--kv-heads", type=int, help="KV heads / query groups (default: --heads)")
    m.add_argument("--experts", type=int, help="routed experts (omit for a dense model)")
    m.add_argument("--moe-ffn-hidden-size", type=int, help="an expert's FFN width")
    m.add_argument(
        "--bias", action="store_true", help="linear layers carry biases (no --disable-bias-linear)"
    )
    m.add_argument("--attention", choices=ATTENTION_KINDS, default="gqa")
    m.add_argument(
        "--shared-index-layers",
        type=_layer_list,
        default=(),
        help="DSA layers (0-based, comma-separated) that reuse an earlier layer's top-k (GLM-5.2: 3,4,5,7,...)",
    )
    m.add_argument("--model-name", default="model", help="name shown in messages")
    m.add_argument(
        "--config",
        metavar="PATH",
        help="a config.json, or a model directory holding one: the model's shape and what its family supports "
        "(context parallelism, TP divisors) through its family's facts; the model flags above override it",
    )
    p.add_argument(
        "--megatron-core", metavar="VERSION", help="apply this release's rules (default: the installed one)"
    )
    p.add_argument("--megatron", action="store_true", help="also run megatron-core under gloo on the CPU")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ProofError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer numbers, got {text!r}") from None


def _model(args: argparse.Namespace) -> ModelShape | None:
    given = [args.layers, args.heads, args.kv_heads, args.experts, args.moe_ffn_hidden_size]
    if args.config:
        return _model_of_config(args)
    if all(v is None for v in given) and not args.bias:
        return None
    if args.layers is None or args.heads is None:
        raise ValueError("a model needs at least --layers and --heads")
    return ModelShape(
        args.model_name, args.layers, args.heads, args.kv_heads, args.experts, args.attention, args.bias,
        args.moe_ffn_hidden_size, args.shared_index_layers,
    )  # fmt: skip


def _model_of_config(args: argparse.Namespace) -> ModelShape:
    """The model a config.json describes (through its family), with the model flags given over it."""
    from dataclasses import replace
    from pathlib import Path

    from miles.families import model_shape

    path = Path(args.config)
    path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--config {args.config}: cannot read a config.json there ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {args.config}: {path} holds no JSON object")
    name = args.model_name if args.model_name != "model" else path.parent.name or "model"
    shape = model_shape(config, name)
    overrides = {
        "num_layers": args.layers, "num_attention_heads": args.heads, "num_query_groups": args.kv_heads,
        "num_experts": args.experts, "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
    }  # fmt: skip
    return replace(shape, **{k: v for k, v in overrides.items() if v is not None})


def cmd_check(args: argparse.Namespace) -> int:
    layout = ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        sp=args.sp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        vpp=args.vpp,
        cp_comm_type=args.cp_comm_type,
    )
    model = _model(args)
    if args.megatron:
        check_proof_size(args.world_size)
    verdict = validate(layout, args.world_size, model, args.megatron_core)
    proof = None
    if args.megatron:
        from miles.megatron.proof import Case, prove

        proof = prove([Case(layout, args.world_size, model)])[0]
    if args.json:
        print(json.dumps(_to_json(verdict, proof), indent=2))
    else:
        _print(verdict, proof)
    if proof is not None and not proof.agrees_with(verdict):
        return 1
    return 0 if verdict.ok else 1


def _print(verdict: Verdict, proof) -> None:
    layout, world = verdict.layout, verdict.world_size
    print(verdict.headline())
    if verdict.ok:
        print(f"  dp={layout.dp(world)}, expert dp={layout.expert_dp(world)}")
    for v in verdict.violations:
        print(f"  {v.rule}: {v.message}")
        for i, fix in enumerate(v.fixes):
            print(f"    {'fix:' if i == 0 else 'or: '} {fix}")
    for note in verdict.notes:
        print(f"  note: {note}")
    if proof is None:
        return
    from miles.megatron.proof import installed_version

    print(f"megatron-core {installed_version()} on {world} gloo rank(s): {proof.summary()}")
    if proof.ok:
        for name, groups in proof.groups.items():
            print(f"  {name} groups: {groups}")
        if proof.layers_per_stage is not None:
            print(f"  layers per pipeline stage: {list(proof.layers_per_stage)}")
    if proof.agrees_with(verdict):
        print("miles and megatron-core agree")
    else:
        print("miles and megatron-core DISAGREE: this is a bug in miles.parallel; please report the layout")


def _to_json(verdict: Verdict, proof) -> dict:
    payload = {
        "layout": verdict.layout.to_json(),
        "world_size": verdict.world_size,
        "model": verdict.model.to_json() if verdict.model else None,
        "megatron_core": verdict.megatron_core,
        "ok": verdict.ok,
        "violations": [
            {"rule": v.rule, "message": v.message, "fixes": list(v.fixes)} for v in verdict.violations
        ],
        "notes": list(verdict.notes),
    }
    if proof is not None:
        payload["megatron"] = {
            "ok": proof.ok,
            "stage": proof.stage,
            "error": proof.error,
            "rule": proof.rule,
            "layers_per_stage": proof.layers_per_stage,
            "groups": proof.groups,
            "agrees": proof.agrees_with(verdict),
        }
    return payload


if __name__ == "__main__":
    sys.exit(main())
