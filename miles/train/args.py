"""The flags of `python -m miles.train`: the one place where trainer flags are defined.

Flag names follow the seeds' framework so that a recipe's command line runs unchanged on
the CPU trainer and on the Megatron trainer (`--hf-checkpoint`, `--rollout-batch-size`,
`--advantage-estimator grpo`, `--tensor-model-parallel-size`, ...). Megatron model and
performance flags are parsed here too: the CPU backends ignore them (the model shape comes
from the Hugging Face config) but a typo in one is still an error. `--sglang-<name> [values]`
is passed through to the SGLang engine unchanged, because SGLang's own server arguments are
its source of truth.

`parse_args(argv)` returns the validated namespace; the small frozen configs the other
modules take (`SamplingConfig`, `LossConfig`, `OptimConfig`) are derived from it here.
The file is long because it is the one list of every flag, kept whole so that a recipe
author reads all of them in one place. Standard library only: recipes and tests parse
commands without importing torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from miles.parallel import ParallelLayout

TRAIN_BACKENDS = ("fsdp", "ddp", "megatron")
ADVANTAGE_ESTIMATORS = ("grpo", "gspo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
ROLLOUT_ENGINES = ("auto", "torch", "sglang")
SGLANG_PREFIX = "--sglang-"


class ArgsError(ValueError):
    """A flag value breaks a rule; the message names the flag(s), the rule and a fix."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LossConfig:
    advantage_estimator: str
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None  # dual-clip bound for negative advantages; None = off
    use_kl_loss: bool
    kl_loss_type: str
    kl_loss_coef: float
    entropy_coef: float
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    per_token_loss: bool
    temperature: float  # logits are divided by it so trainer and rollout logprobs agree


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int | None
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    clip_grad: float


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _window(text: str) -> tuple[int, int]:
    """Megatron-LM's --window-size: two token counts, LEFT,RIGHT (a lone number would be a
    one-element tuple there, which its attention cannot use)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be LEFT,RIGHT (e.g. 512,0), got {text!r}")
    return int(parts[0]), int(parts[1])


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint")
    g.add_argument(
        "--hf-checkpoint", required=True, help="Hugging Face model dir: weights, config, tokenizer"
    )
    g.add_argument("--ref-load", help="reference model: an HF dir, or a torch_dist dir (megatron backend)")
    g.add_argument("--load", help="resume from the latest checkpoint here (fresh start when there is none)")
    g.add_argument("--save", help="write checkpoints here")
    g.add_argument("--save-interval", type=_positive_int, help="save every N rollouts (and after the last)")
    g.add_argument("--ckpt-step", type=int, help="resume from this rollout instead of the latest")
    g.add_argument("--no-save-optim", action="store_true", help="save model weights only")
    g.add_argument("--no-load-optim", action="store_true", help="resume weights but start a fresh optimizer")
    g.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist", "torch"))
    g.add_argument("--megatron-to-hf-mode", default="raw", choices=("raw", "bridge"))
    g.add_argument("--keep-old-actor", action="store_true")
    g.add_argument("--finetune", action="store_true", help="(megatron) load weights without iteration state")


def _add_data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--prompt-data",
        default="synthetic:fixed",
        help="JSONL or Parquet file, or synthetic:<task> (tasks: fixed, copy)",
    )
    g.add_argument("--input-key", default="prompt")
    g.add_argument("--label-key", default="label")
    g.add_argument("--metadata-key", default="metadata")
    g.add_argument("--tool-key")
    g.add_argument("--apply-chat-template", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--system-prompt", help="system message added when the chat template is applied")
    g.add_argument("--rollout-shuffle", action="store_true", help="shuffle prompts each epoch (seeded)")
    g.add_argument("--num-epoch", type=_positive_int)
    g.add_argument("--eval-prompt-data", nargs="+", help="NAME PATH pairs, scored as eval/NAME")
    g.add_argument("--eval-interval", type=_positive_int)
    g.add_argument("--n-samples-per-eval-prompt", type=_positive_int, default=1)
    g.add_argument("--eval-max-response-len", type=_positive_int)
    g.add_argument("--eval-temperature", type=_non_negative_float)
    g.add_argument("--eval-top-p", type=_fraction)


def _add_rollout(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rollout")
    g.add_argument("--num-rollout", type=_positive_int, default=10, help="training steps (rollouts) in all")
    g.add_argument("--rollout-batch-size", type=_positive_int, default=8, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=_positive_int, default=8, help="group size")
    g.add_argument("--global-batch-size", type=_positive_int, help="samples per optimizer step (all ranks)")
    g.add_argument("--micro-batch-size", type=_positive_int, default=8, help="samples per forward per rank")
    g.add_argument("--rollout-max-response-len", type=_positive_int, default=64)
    g.add_argument("--rollout-max-prompt-len", type=_positive_int)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=_fraction, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="*", default=[])
    g.add_argument("--rollout-seed", type=int, help="sampling seed (default: --seed)")
    g.add_argument("--rollout-engine", default="auto", choices=ROLLOUT_ENGINES, help="auto: sglang on GPU")
    g.add_argument("--rollout-num-gpus", type=_positive_int)
    g.add_argument("--rollout-num-gpus-per-engine", type=_positive_int, default=1)
    g.add_argument("--rollout-function-path", help="(GPU lanes) custom rollout function, dotted path")
    g.add_argument("--over-sampling-batch-size", type=_positive_int)
    g.add_argument("--dynamic-sampling-filter-path")
    g.add_argument("--partial-rollout", action="store_true")
    g.add_argument("--balance-data", action="store_true")
    g.add_argument("--use-dynamic-batch-size", action="store_true")
    g.add_argument("--max-tokens-per-gpu", type=_positive_int)
    g.add_argument("--log-passrate", action="store_true")
    g.add_argument("--update-weights-interval", type=_positive_int, default=1)
    g.add_argument(
        "--update-weight-buffer-size", type=_positive_int, help="bytes per weight push to SGLang (512 MiB)"
    )
    g.add_argument("--sglang-mem-fraction-static", type=_fraction, help="SGLang KV-cache memory share")


def _add_reward(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reward")
    g.add_argument(
        "--rm-type",
        default="synthetic",
        help="math | deepscaler | dapo | gsm8k | synthetic | a dotted path module.func / module:func",
    )
    g.add_argument("--custom-rm-path", help="dotted path of a reward function; wins over --rm-type")
    g.add_argument("--reward-key", help="when the reward function returns a dict, the key to train on")
    g.add_argument("--rm-url", help="remote reward model (not supported by the built-in rollout)")


def _add_algorithm(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", default="grpo", choices=ADVANTAGE_ESTIMATORS)
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr. GRPO: no std division")
    g.add_argument("--eps-clip", type=_non_negative_float, default=0.2)
    g.add_argument("--eps-clip-high", type=_non_negative_float, help="upper clip (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, help="dual-clip constant (> 1) for negative advantages")
    g.add_argument("--use-kl-loss", action="store_true", help="add a KL loss against the frozen reference")
    g.add_argument("--kl-loss-type", default="low_var_kl", choices=KL_LOSS_TYPES)
    g.add_argument("--kl-loss-coef", type=_non_negative_float, default=0.0)
    g.add_argument("--kl-coef", type=_non_negative_float, default=0.0, help="KL in the reward (must be 0)")
    g.add_argument("--entropy-coef", type=_non_negative_float, default=0.0)
    g.add_argument("--use-tis", action="store_true", help="truncated importance sampling vs rollout logprobs")
    g.add_argument("--tis-clip", type=_non_negative_float, default=2.0)
    g.add_argument("--tis-clip-low", type=_non_negative_float, default=0.0)
    g.add_argument("--calculate-per-token-loss", action="store_true", help="average over tokens, not samples")
    g.add_argument("--use-rollout-logprobs", action="store_true", help="old logprobs from the rollout engine")


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="adam", choices=("adam",), help="AdamW (decoupled weight decay)")
    g.add_argument("--lr", type=_non_negative_float, default=1e-6)
    g.add_argument("--min-lr", type=_non_negative_float, default=0.0)
    g.add_argument("--lr-decay-style", default="constant", choices=("constant", "linear", "cosine"))
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=_positive_int)
    g.add_argument("--weight-decay", type=_non_negative_float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=_non_negative_float, default=1.0, help="max grad norm; 0 = off")
    g.add_argument(
        "--max-skipped-steps",
        type=int,
        default=3,
        help="stop after this many optimizer steps in a row skipped for a non-finite loss or grad norm; 0 = never",
    )
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true")
    g.add_argument("--use-precision-aware-optimizer", action="store_true")
    g.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 compute with float32 master weights, gradient reduction and optimizer state",
    )
    g.add_argument("--fp16", action="store_true")


def _add_distributed(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed and parallel layout")
    g.add_argument("--train-backend", default="fsdp", choices=TRAIN_BACKENDS)
    g.add_argument("--distributed-backend", choices=("gloo", "nccl"), help="default: nccl on GPU, else gloo")
    g.add_argument("--actor-num-nodes", type=_positive_int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=_positive_int, default=1)
    g.add_argument("--colocate", action="store_true", help="rollout and training share the GPUs")
    g.add_argument("--offload", action="store_true")
    g.add_argument("--offload-train", action="store_true")
    g.add_argument("--offload-rollout", action="store_true")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--context-parallel-size", type=_positive_int, default=1)
    g.add_argument("--expert-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=_positive_int, help="default: the TP size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--decoder-first-pipeline-num-layers", type=_positive_int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=_positive_int)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int)
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank", type=_positive_int, help="virtual pipeline (vpp)"
    )
    g.add_argument("--cp-comm-type", choices=("p2p", "a2a", "all_gather", "allgather", "a2a+p2p"))
    g.add_argument("--gradient-checkpointing", action="store_true", help="(fsdp/ddp) recompute activations")


def _add_megatron_model(p: argparse.ArgumentParser) -> None:
    """Megatron's model-shape flags, as recipes emit them; read by the megatron backend only."""
    g = p.add_argument_group("megatron model (megatron backend; fsdp/ddp read the HF config)")
    ints = (
        "--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --num-query-groups "
        "--kv-channels --vocab-size --seq-length --max-position-embeddings --num-experts "
        "--moe-ffn-hidden-size --moe-shared-expert-intermediate-size --moe-router-topk "
        "--moe-router-num-groups --moe-router-group-topk --moe-layer-recompute --q-lora-rank "
        "--kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim --mtp-num-layers "
        "--original-max-position-embeddings --make-vocab-size-divisible-by --rotary-interleaved-groups "
        "--moe-router-topk-limited-devices --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk "
        "--num-dense-layers --window-attn-skip-freq"
    ).split()
    floats = (
        "--norm-epsilon --rotary-base --rotary-percent --rotary-scaling-factor --moe-aux-loss-coeff "
        "--moe-router-topk-scaling-factor --moe-router-bias-update-rate --moe-z-loss-coeff --mscale "
        "--mscale-all-dim --beta-fast --beta-slow --attention-dropout --hidden-dropout "
        "--init-method-std --moe-input-jitter-eps --mtp-loss-scaling-factor --moe-expert-capacity-factor"
    ).split()
    strings = (
        "--normalization --position-embedding-type --moe-router-score-function --moe-token-dispatcher-type "
        "--moe-router-dtype --moe-router-load-balancing-type --attention-backend --recompute-granularity "
        "--recompute-method --transformer-impl --moe-layer-freq --tokenizer-type --tokenizer-model "
        "--spec --moe-pad-expert-input-to-capacity --qk-layernorm-type --kv-lora-dtype "
        "--experimental-attention-variant"
    ).split()
    flags = (
        "--swiglu --group-query-attention --use-rotary-position-embeddings --disable-bias-linear "
        "--add-qkv-bias --qk-layernorm --untie-embeddings-and-output-weights --moe-grouped-gemm "
        "--moe-permute-fusion --moe-router-pre-softmax --moe-router-enable-expert-bias "
        "--multi-latent-attention --no-rope-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
        "--no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-position-embedding "
        "--use-flash-attn --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
        "--apply-layernorm-1p --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--moe-shared-expert-overlap --use-mcore-models --no-load-rng --no-save-rng "
        "--moe-apply-probs-on-input --use-dsa --vocab-extra-ids"
    ).split()
    for name in ints:
        g.add_argument(name, type=int)
    for name in floats:
        g.add_argument(name, type=float)
    for name in strings:
        g.add_argument(name)
    for name in flags:
        g.add_argument(name, action="store_true")
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--recompute-modules", nargs="+")
    g.add_argument(
        "--window-size", type=_window, help="sliding window as Megatron-LM's LEFT,RIGHT (-1: unbounded)"
    )


def _add_ci(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checks and CI")
    g.add_argument(
        "--ci-test", action="store_true", help="assert the in-loop checks (see miles.train.checks)"
    )
    g.add_argument("--ci-disable-kl-checker", action="store_true", help="skip the step-0 ppo_kl check")
    g.add_argument("--check-weight-update-equal", action="store_true", help="check weight sync every step")
    g.add_argument("--check-weight-update-skip-list", nargs="*", default=[], help="name substrings to skip")
    g.add_argument("--ci-logprob-abs-diff-tol", type=_non_negative_float, default=1e-3)
    g.add_argument("--ci-step0-kl-tol", type=_non_negative_float, default=1e-6)
    g.add_argument("--ci-metric-checker-key")
    g.add_argument("--ci-metric-checker-threshold", type=float)
    g.add_argument(
        "--dry-start",
        action="store_true",
        help="check the flags and the starting checkpoint: build the model at the layout, load its weights, stop",
    )
    g.add_argument("--debug-rollout-only", action="store_true")
    g.add_argument("--debug-train-only", action="store_true")
    g.add_argument("--save-debug-rollout-data")
    g.add_argument("--load-debug-rollout-data")


def _add_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and misc")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=_positive_int, default=1)
    g.add_argument("--use-wandb", action="store_true")
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-group")
    g.add_argument("--wandb-key")
    g.add_argument("--wandb-host")
    g.add_argument("--wandb-mode")
    g.add_argument("--wandb-team")
    g.add_argument("--disable-wandb-random-suffix", action="store_true")
    g.add_argument("--use-tensorboard", action="store_true")
    g.add_argument("--num-threads", type=_positive_int, help="torch intra-op threads per rank (CPU)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # The full usage of ~250 flags would bury the one line that matters.
        self.exit(2, f"{self.prog}: error: {message}\n(python -m miles.train --help lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m miles.train",
        description="GRPO/GSPO trainer: rollout, reward, advantage, clipped loss, step, weight sync.",
        epilog="--sglang-<name> [VALUE ...] is passed to the SGLang engine unchanged.",
        allow_abbrev=False,
    )
    for add in (
        _add_checkpoint,
        _add_data,
        _add_rollout,
        _add_reward,
        _add_algorithm,
        _add_optimizer,
        _add_distributed,
        _add_megatron_model,
        _add_ci,
        _add_logging,
    ):
        add(parser)
    return parser


# Flags the recipes emit for the GPU stack that the data-parallel backends and the built-in
# engine do not act on; run_notes() names the ones a command sets, so none is silently dropped.
GPU_STACK_ONLY = (
    "colocate offload offload_train offload_rollout balance_data use_dynamic_batch_size max_tokens_per_gpu "
    "partial_rollout over_sampling_batch_size dynamic_sampling_filter_path rollout_function_path "
    "rollout_num_gpus optimizer_cpu_offload overlap_cpu_optimizer_d2h_h2d "
    "use_precision_aware_optimizer fp16 keep_old_actor finetune use_wandb wandb_project wandb_group "
    "wandb_key wandb_host wandb_mode wandb_team disable_wandb_random_suffix use_tensorboard log_passrate "
    "megatron_to_hf_mode ckpt_format num_epoch log_interval "
    "num_layers_per_virtual_pipeline_stage debug_train_only tool_key"
).split()
# Of those, the ones the megatron backend does act on.
MEGATRON_USES = ("num_layers_per_virtual_pipeline_stage",)
SGLANG_ONLY = ("rollout_num_gpus_per_engine", "sglang_mem_fraction_static", "update_weight_buffer_size")
MEGATRON_GROUP = "megatron model (megatron backend; fsdp/ddp read the HF config)"


def run_notes(args: argparse.Namespace, engine: str) -> list[str]:
    """Flags this command sets that the chosen backend and rollout engine ignore."""
    parser = build_parser()
    changed = {
        a.dest: a.option_strings[0]
        for a in parser._actions
        if a.option_strings and getattr(args, a.dest, None) != a.default and a.default != argparse.SUPPRESS
    }
    notes = []
    if args.train_backend == "megatron":
        ignored = [changed[d] for d in GPU_STACK_ONLY if d in changed and d not in MEGATRON_USES]
        if ignored:
            notes.append(f"without effect on --train-backend megatron: {' '.join(ignored)}")
    if args.train_backend != "megatron":
        megatron = [
            a.dest for g in parser._action_groups if g.title == MEGATRON_GROUP for a in g._group_actions
        ]
        ignored = [changed[d] for d in GPU_STACK_ONLY if d in changed]
        if ignored:
            notes.append(f"without effect on --train-backend {args.train_backend}: {' '.join(ignored)}")
        count = sum(d in changed for d in megatron)
        if count:
            notes.append(
                f"{count} Megatron model flag(s) are read by the megatron backend only (shape from the HF config)"
            )
    if engine != "sglang":
        ignored = [changed[d] for d in SGLANG_ONLY if d in changed] + [
            f"--sglang-{k.replace('_', '-')}" for k in args.sglang_args
        ]
        if ignored:
            notes.append(f"without effect on the {engine} rollout engine: {' '.join(ignored)}")
    return notes


def split_sglang_args(
    argv: Sequence[str], known: set[str]
) -> tuple[list[str], dict[str, str | bool | list[str]]]:
    """Take `--sglang-<name> [values]` out of argv (except flags the parser defines itself).

    A flag followed by no value is a switch (True); one value is a string; several are a list.
    """
    rest: list[str] = []
    passthrough: dict[str, str | bool | list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name.startswith(SGLANG_PREFIX) and name not in known:
            key = name[len(SGLANG_PREFIX) :].replace("-", "_")
            if eq:
                passthrough[key] = inline
                i += 1
                continue
            values = []
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            passthrough[key] = True if not values else values[0] if len(values) == 1 else values
            continue
        rest.append(token)
        i += 1
    return rest, passthrough


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the trainer's flags; exits with argparse's message on a bad flag."""
    import sys

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    known = {opt for action in parser._actions for opt in action.option_strings}
    rest, sglang = split_sglang_args(argv, known)
    args = parser.parse_args(rest)
    args.sglang_args = sglang
    try:
        validate(args)
    except ArgsError as exc:
        parser.error(str(exc))
    return args


def validate(args: argparse.Namespace) -> None:
    """Rules that need more than one flag; each message names the flags and a value that fits."""
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.rollout_seed is None:
        args.rollout_seed = args.seed
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is None:
        args.global_batch_size = samples
    if samples % args.global_batch_size:
        raise ArgsError(
            f"--rollout-batch-size ({args.rollout_batch_size}) x --n-samples-per-prompt "
            f"({args.n_samples_per_prompt}) = {samples} samples per rollout must be a multiple of "
            f"--global-batch-size ({args.global_batch_size}); e.g. --global-batch-size {samples}"
        )
    if args.n_samples_per_prompt < 2:
        raise ArgsError(
            f"--advantage-estimator {args.advantage_estimator} normalises rewards within a group, so "
            f"--n-samples-per-prompt must be >= 2 (got {args.n_samples_per_prompt})"
        )
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        raise ArgsError(
            f"--eps-clip-c must be > 1 (dual clip bounds the loss at c*|A|), got {args.eps_clip_c}"
        )
    if args.rollout_temperature <= 0:
        raise ArgsError(
            f"--rollout-temperature must be > 0 (got {args.rollout_temperature}); GRPO needs sampled groups"
        )
    if args.kl_coef:
        raise ArgsError(f"--kl-coef {args.kl_coef}: KL in the reward is not supported; use --use-kl-loss")
    if args.rm_url:
        raise ArgsError(
            f"--rm-url {args.rm_url}: a remote reward model is not supported; use --rm-type or --custom-rm-path"
        )
    if args.tis_clip_low > args.tis_clip:
        raise ArgsError(f"--tis-clip-low ({args.tis_clip_low}) must not exceed --tis-clip ({args.tis_clip})")
    if args.train_backend != "megatron":
        model_parallel = {
            "--tensor-model-parallel-size": args.tensor_model_parallel_size,
            "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
            "--context-parallel-size": args.context_parallel_size,
            "--expert-model-parallel-size": args.expert_model_parallel_size,
        }
        wrong = {k: v for k, v in model_parallel.items() if v != 1}
        if wrong:
            shown = ", ".join(f"{k} {v}" for k, v in wrong.items())
            raise ArgsError(
                f"--train-backend {args.train_backend} is data-parallel only, but {shown} was given; "
                "use --train-backend megatron for model parallelism or set them to 1"
            )
    args.layout = _megatron_layout(args) if args.train_backend == "megatron" else ParallelLayout()
    if (args.ci_metric_checker_key is None) != (args.ci_metric_checker_threshold is None):
        raise ArgsError("--ci-metric-checker-key and --ci-metric-checker-threshold go together")
    if args.eval_prompt_data and len(args.eval_prompt_data) % 2:
        raise ArgsError(
            f"--eval-prompt-data takes NAME PATH pairs, got {len(args.eval_prompt_data)} value(s): "
            f"{' '.join(args.eval_prompt_data)}"
        )
    if args.load_debug_rollout_data and args.debug_rollout_only:
        raise ArgsError("--load-debug-rollout-data and --debug-rollout-only exclude each other")


def _megatron_layout(args: argparse.Namespace) -> ParallelLayout:
    """The Megatron layout, parsed once; it must fit the GPUs the job asks for, checked before
    anything starts."""
    from miles.train.layout import parallel_layout

    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    try:
        return parallel_layout(args, world)
    except ValueError as exc:  # InvalidParallelism, or virtual pipeline flags Megatron-LM refuses
        raise ArgsError(
            f"{exc} (world = --actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{args.actor_num_gpus_per_node})"
        ) from exc


def validate_world(args: argparse.Namespace, world_size: int) -> None:
    """Rules that need the number of ranks (known once the process group is up)."""
    try:
        dp = args.layout.dp(world_size)  # the data-parallel backends' layout: dp = every rank
    except ValueError as exc:
        raise ArgsError(f"{exc} (the process group has {world_size} rank(s))") from exc
    per_rank, rest = divmod(args.global_batch_size, dp)
    if rest:
        raise ArgsError(
            f"--global-batch-size ({args.global_batch_size}) must split evenly over {dp} "
            f"data-parallel ranks; e.g. --global-batch-size {args.global_batch_size + dp - rest}"
        )
    if args.rollout_batch_size % world_size:
        raise ArgsError(
            f"--rollout-batch-size ({args.rollout_batch_size}) must split evenly over {world_size} "
            "ranks (each rank rolls out whole groups)"
        )


def sampling_config(args: argparse.Namespace, eos_token_ids: Sequence[int] = ()) -> SamplingConfig:
    return SamplingConfig(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_response_len=args.rollout_max_response_len,
        stop_token_ids=tuple(dict.fromkeys([*args.rollout_stop_token_ids, *eos_token_ids])),
    )


def loss_config(args: argparse.Namespace) -> LossConfig:
    return LossConfig(
        advantage_estimator=args.advantage_estimator,
        eps_clip=args.eps_clip,
        eps_clip_high=args.eps_clip_high,
        eps_clip_c=args.eps_clip_c,
        use_kl_loss=args.use_kl_loss,
        kl_loss_type=args.kl_loss_type,
        kl_loss_coef=args.kl_loss_coef,
        entropy_coef=args.entropy_coef,
        use_tis=args.use_tis,
        tis_clip=args.tis_clip,
        tis_clip_low=args.tis_clip_low,
        per_token_loss=args.calculate_per_token_loss,
        temperature=args.rollout_temperature,
    )


def optim_config(args: argparse.Namespace) -> OptimConfig:
    return OptimConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters,
        weight_decay=args.weight_decay,
        beta1=args.adam_beta1,
        beta2=args.adam_beta2,
        eps=args.adam_eps,
        clip_grad=args.clip_grad,
    )
