"""`python -m miles.train.standalone`: the Megatron model alone, one forward (and backward) of a fixed
prompt at a layout, its per-token logprobs and named tensors written per rank, and two layouts compared.

A debugging tool for layouts, as the seed framework has one (radixark/miles 31f1ca961,
miles/utils/debug_utils/run_megatron/, tests/e2e/short/test_run_megatron.py):

    python -m miles.train.standalone run-and-compare --hf-checkpoint H --ref-load H_torch_dist \\
        --output-base-dir OUT --baseline "--tp 1" --target "--tp 2 --pp 2 --cp 2 --ep 1" \\
        --seq-length 128 --batch-size 1 --prompt-mode math --sp \\
        --dumper-filter "layer_id is None or layer_id < 3" --diff-threshold 0.002 --logprob-threshold 0.06

`run` launches `torchrun --nproc-per-node tp*pp*cp -m miles.train.standalone worker`: each rank
builds the policy exactly as `--train-backend megatron` does (miles.train.backends.megatron, from
the trainer's own flags, `--extra-args` appended last), scores the prompt's tokens in one forward
(`--run-backward`: then also a training step at learning rate 0, so gradients exist and the weights
stay) and writes, under `--output-dir`, `logprobs/rank_<r>.json` (each target token's logprob by
row and position) and the forwards' tensors `standalone/rollout_0/*.pt` (miles.train.dumps, with
`--dumper-filter`). `run-and-compare` runs the baseline and the target layout into
`<output-base-dir>/<layout name>` (`tp2_pp2_cp2`) and then `compare`: the mean absolute logprob
difference over the positions both scored must be at most `--logprob-threshold`, and every tensor
both dumped under the same name and shape on rank 0 must agree to `--diff-threshold` (relative to
the baseline's largest magnitude); a tensor a layout shards differently is counted as skipped.
Exit 0 when both hold, 1 when either fails (the report says which), 2 on bad arguments.

The prompt (`--prompt-mode`): `math` ("1+1=2, 1+2=3, ..."), `text` (`--prompt-text`) or `file`
(`--prompt-file`), tokenized and cut to `--seq-length` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from miles.parallel import ParallelLayout

PHASE = "standalone"


def parse_layout(text: str, option: str) -> ParallelLayout:
    """A layout as `--baseline` / `--target` give it: `--tp 2 --pp 2 --cp 2 --ep 1 --etp 1`; EP
    defaults to 1 (the seed's tool defaults it to --tp, which a dense model refuses)."""
    parser = argparse.ArgumentParser(prog=option, add_help=False, exit_on_error=False)
    for name in ("tp", "pp", "cp", "ep", "etp"):
        parser.add_argument(f"--{name}", type=int)
    try:
        given = vars(parser.parse_args(shlex.split(text)))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise SystemExit(f"{option} {text!r}: expected --tp/--pp/--cp/--ep/--etp N ({exc})") from None
    given = {k: v for k, v in given.items() if v is not None}
    given.setdefault("etp", 1)
    try:
        return ParallelLayout(**given)
    except ValueError as exc:
        raise SystemExit(f"{option} {text!r}: {exc}") from None


def ranks(layout: ParallelLayout) -> int:
    """The ranks one launch uses: no data parallelism, every rank a model-parallel peer."""
    return layout.tp * layout.pp * layout.cp


def layout_name(layout: ParallelLayout) -> str:
    """The folder name: each degree other than its default (`tp1` alone for the plain layout)."""
    parts = [f"tp{layout.tp}"]
    parts += [
        f"{k}{v}"
        for k, v in (("pp", layout.pp), ("cp", layout.cp), ("ep", layout.ep), ("etp", layout.expert_tp))
        if v != 1
    ]
    return "_".join(parts)


def layout_flags(layout: ParallelLayout) -> list[str]:
    """The trainer flags that build the policy at `layout` on one node."""
    return [
        *layout.trainer_flags(),
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        str(ranks(layout)),
    ]


# --- the prompt -------------------------------------------------------------------------------


def math_text(chars: int) -> str:
    """ "1+1=2, 1+2=3, ..., 1+100=101, 2+1=3, ..." up to `chars` characters."""
    parts, total, a, b = [], 0, 1, 1
    while total < chars:
        part = f"{a}+{b}={a + b}, "
        parts.append(part)
        total += len(part)
        a, b = (a + 1, 1) if b == 100 else (a, b + 1)
    return "".join(parts)


def prompt_tokens(args: argparse.Namespace) -> list[int]:
    from transformers import AutoTokenizer

    if args.prompt_mode == "math":
        text = math_text(args.seq_length * 16)
    elif args.prompt_mode == "text":
        text = args.prompt_text or _fail("--prompt-mode text needs --prompt-text")
    else:
        text = Path(args.prompt_file or _fail("--prompt-mode file needs --prompt-file")).read_text()
    ids = AutoTokenizer.from_pretrained(str(args.hf_checkpoint)).encode(text)
    if len(ids) < args.seq_length:
        _fail(f"the prompt has {len(ids)} tokens, under --seq-length {args.seq_length}: give a longer one")
    return ids[: args.seq_length]


def _fail(message: str):
    raise SystemExit(f"miles.train.standalone: {message}")


# --- the worker (one rank) --------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch

    from miles.train import consumption
    from miles.train.args import parse_config
    from miles.train.batch import TokenBatch
    from miles.train.distributed import init_distributed, seed_everything
    from miles.train.dumps import Dumper, PhaseDump

    layout = parse_layout(args.layout, "--layout")
    argv = [
        "--hf-checkpoint", str(args.hf_checkpoint), "--train-backend", "megatron", *layout_flags(layout),
        # the rollout's shape only has to parse (a group has 2 samples at least): nothing is generated
        "--rollout-batch-size", "1", "--n-samples-per-prompt", str(max(2, args.batch_size)),
        "--micro-batch-size", str(args.batch_size),
        "--lr", "0", "--rollout-temperature", "1",
    ]  # fmt: skip
    if args.ref_load:
        argv += ["--ref-load", str(args.ref_load)]
    argv += ["--sequence-parallel"] if args.sp else []
    config = parse_config([*argv, *shlex.split(args.extra_args)], raising=True)
    dist_info = init_distributed(config.job.distributed_backend)
    seed_everything(config.job.seed)
    backend = consumption.build("backend", "megatron", config, dist_info)

    ids = torch.tensor(json.loads(Path(args.token_ids_file).read_text()), dtype=torch.long)
    rows = ids.unsqueeze(0).expand(args.batch_size, -1).contiguous()
    zeros = torch.zeros(rows.shape[0], rows.shape[1] - 1)
    batch = TokenBatch(
        input_ids=rows,
        attention_mask=torch.ones_like(rows),
        loss_mask=torch.ones_like(zeros),
        advantages=torch.ones(rows.shape[0]),
        rollout_logp=zeros,
    )
    out = Path(args.output_dir)
    phase = PhaseDump(enable=True, filter=args.dumper_filter or None, enable_model_grad=args.run_backward)
    dumper = Dumper(out, {PHASE: phase}, dist_info.rank, dist_info.world_size, args.dumper_max_bytes)
    with dumper.phase(PHASE, 0, backend.dump_chunks()):
        if args.run_backward:  # at learning rate 0: gradients, and the weights stay
            logp = backend.train_step([batch], float(batch.size)).logprobs[0]
        else:
            logp = backend.batch_logprobs([batch])[0]
    entries = [
        {"row": r, "position": t + 1, "token_id": int(rows[r, t + 1]), "logprob": float(logp[r, t])}
        for r in range(rows.shape[0])
        for t in range(rows.shape[1] - 1)
    ]
    folder = out / "logprobs"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": dist_info.rank, "layout": layout_name(layout), "entries": entries}
    (folder / f"rank_{dist_info.rank}.json").write_text(json.dumps(record))
    if dist_info.is_main:
        print(f"miles.train.standalone: {layout_name(layout)} wrote {out}", flush=True)
    torch.distributed.destroy_process_group()


# --- run, compare -----------------------------------------------------------------------------


def run(args: argparse.Namespace, layout: ParallelLayout, output_dir: Path, extra: str) -> None:
    """One layout: torchrun of the worker on tp*pp*cp ranks."""
    tokens = output_dir / "token_ids.json"
    output_dir.mkdir(parents=True, exist_ok=True)
    tokens.write_text(json.dumps(prompt_tokens(args)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks(layout)),
        "-m", "miles.train.standalone", "worker", "--layout", _layout_text(layout),
        "--hf-checkpoint", str(args.hf_checkpoint), "--token-ids-file", str(tokens),
        "--output-dir", str(output_dir), "--batch-size", str(args.batch_size),
        "--dumper-filter", args.dumper_filter, "--dumper-max-bytes", str(args.dumper_max_bytes),
        "--extra-args", f"{args.extra_args} {extra}".strip(),
    ]  # fmt: skip
    cmd += ["--ref-load", str(args.ref_load)] if args.ref_load else []
    cmd += ["--sp"] if args.sp else []
    cmd += ["--run-backward"] if args.run_backward else []
    print(f"miles.train.standalone: {layout_name(layout)} on {ranks(layout)} rank(s)", flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        _fail(f"the {layout_name(layout)} run failed (its output is above)")


def _layout_text(layout: ParallelLayout) -> str:
    return f"--tp {layout.tp} --pp {layout.pp} --cp {layout.cp} --ep {layout.ep} --etp {layout.expert_tp}"


def read_logprobs(folder: Path) -> dict[tuple[int, int], float]:
    """(row, position) -> logprob over every rank's file (ranks of one layout agree)."""
    files = sorted(folder.glob("rank_*.json"))
    if not files:
        _fail(f"{folder}: no rank_*.json (did the run finish?)")
    merged: dict[tuple[int, int], float] = {}
    for path in files:
        for e in json.loads(path.read_text())["entries"]:
            merged.setdefault((e["row"], e["position"]), e["logprob"])
    return merged


def compare_logprobs(baseline: Path, target: Path, threshold: float) -> tuple[bool, str]:
    base, other = read_logprobs(baseline / "logprobs"), read_logprobs(target / "logprobs")
    common = sorted(base.keys() & other.keys())
    if not common:
        return False, "logprobs: no position scored by both"
    diffs = [abs(base[k] - other[k]) for k in common]
    mean = statistics.mean(diffs)
    ok = mean <= threshold
    verdict = "passed" if ok else "FAILED"
    return ok, (
        f"logprobs {verdict}: {len(common)} positions, mean |diff| {mean:.3e} (threshold {threshold}), "
        f"max {max(diffs):.3e}"
    )


def compare_dumps(baseline: Path, target: Path, threshold: float) -> tuple[bool, str]:
    """Rank 0's tensors of both runs with the same step, name and shape, compared."""
    import torch

    def tensors(run_dir: Path) -> dict[tuple[str, str], Path]:
        folder = run_dir / PHASE / "rollout_0"
        manifest = json.loads((folder / "manifest_rank=0.json").read_text())
        return {(f["file"].split("___")[0], f["name"]): folder / f["file"] for f in manifest["files"]}

    base, other = tensors(baseline), tensors(target)
    compared, skipped, failed = 0, 0, []
    for key in sorted(base.keys() & other.keys()):
        a = torch.load(base[key], weights_only=False)["value"].float()
        b = torch.load(other[key], weights_only=False)["value"].float()
        if a.shape != b.shape:
            skipped += 1
            continue
        compared += 1
        rel = float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)) if a.numel() else 0.0
        if rel > threshold:
            failed.append(f"{key[1]} ({key[0]}): {rel:.3e}")
    ok = compared > 0 and not failed
    verdict = "passed" if ok else "FAILED"
    report = f"tensors {verdict}: {compared} compared, {skipped} skipped (sharded differently), threshold {threshold}"
    if failed:
        report += "; over it: " + ", ".join(failed[:10])
    return ok, report


def compare(baseline: Path, target: Path, *, logprob_threshold: float, diff_threshold: float) -> int:
    results = [
        compare_logprobs(baseline, target, logprob_threshold),
        compare_dumps(baseline, target, diff_threshold),
    ]
    for _, line in results:
        print(f"miles.train.standalone: {line}", flush=True)
    return 0 if all(ok for ok, _ in results) else 1


# --- the command line -------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-checkpoint", type=Path, required=True)
    parser.add_argument("--ref-load", type=Path, help="the torch_dist checkpoint (prepare-ckpt writes it)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--run-backward", action="store_true")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dumper-filter", default="", help="miles.train.dumps' filter expression")
    parser.add_argument("--dumper-max-bytes", type=int, default=2**30)
    parser.add_argument(
        "--extra-args", default="", help="trainer flags appended last (e.g. --attention-backend flash)"
    )


def _prompt(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-length", type=int, default=137)
    parser.add_argument("--prompt-mode", choices=("math", "text", "file"), default="math")
    parser.add_argument("--prompt-text")
    parser.add_argument("--prompt-file", type=Path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m miles.train.standalone", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one layout's forward: logprobs and tensors per rank")
    _common(one)
    _prompt(one)
    one.add_argument("--layout", default="--tp 1", help='"--tp 2 --pp 2 --cp 2 --ep 1"')
    one.add_argument("--output-dir", type=Path, required=True)
    both = commands.add_parser("run-and-compare", help="the baseline and the target layout, then compare")
    _common(both)
    _prompt(both)
    both.add_argument("--output-base-dir", type=Path, required=True)
    both.add_argument("--baseline", required=True)
    both.add_argument("--target", required=True)
    both.add_argument("--baseline-extra-args", default="")
    both.add_argument("--target-extra-args", default="")
    for sub in (both, cmp := commands.add_parser("compare", help="compare two runs' outputs")):
        sub.add_argument("--diff-threshold", type=float, default=1e-3)
        sub.add_argument("--logprob-threshold", type=float, default=1e-3)
    cmp.add_argument("--baseline-dir", type=Path, required=True)
    cmp.add_argument("--target-dir", type=Path, required=True)
    work = commands.add_parser("worker", help="(launched by run) one rank")
    _common(work)
    work.add_argument("--layout", required=True)
    work.add_argument("--token-ids-file", type=Path, required=True)
    work.add_argument("--output-dir", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    thresholds = {}
    if args.command in ("compare", "run-and-compare"):
        thresholds = {"logprob_threshold": args.logprob_threshold, "diff_threshold": args.diff_threshold}
    if args.command == "worker":
        worker(args)
    elif args.command == "run":
        run(args, parse_layout(args.layout, "--layout"), args.output_dir, "")
    elif args.command == "compare":
        return compare(args.baseline_dir, args.target_dir, **thresholds)
    else:
        base, target = parse_layout(args.baseline, "--baseline"), parse_layout(args.target, "--target")
        if layout_name(base) == layout_name(target):
            _fail(f"--baseline and --target are the same layout ({layout_name(base)})")
        base_dir, target_dir = (
            args.output_base_dir / layout_name(base),
            args.output_base_dir / layout_name(target),
        )
        run(args, base, base_dir, args.baseline_extra_args)
        run(args, target, target_dir, args.target_extra_args)
        return compare(base_dir, target_dir, **thresholds)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
