"""The trainer's configuration: typed, frozen sections, one per concern, and the flags they are.

Every flag of `python -m miles.train` is a field of exactly one section: the field
`rollout_batch_size` of `RolloutConfig` is the flag `--rollout-batch-size`, declared with
argparse's own keywords (`flag(type=..., default=..., help=...)`), so the parser is built from
the sections (miles.train.args) and which section a flag belongs to is known without argparse.
Flag names follow the seeds' framework, so a recipe's command line runs unchanged on the CPU
trainer and on the Megatron trainer.

`RunConfig` holds one instance of every section, built once from the parsed flags; the
backends and engines take only the sections they consume (miles.train.consumption). The small
configs the algorithm code takes (`SamplingConfig`, `LossConfig`, `OptimConfig`) are derived
from the sections here. The file is long because it is the one list of every flag, kept whole
so that a recipe author reads all of them in one place. Standard library only: recipes and
tests parse commands without importing torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from miles.parallel import ParallelLayout

TRAIN_BACKENDS = ("fsdp", "ddp", "megatron")
ADVANTAGE_ESTIMATORS = ("grpo", "gspo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
ROLLOUT_ENGINES = ("auto", "torch", "sglang")
SGLANG_PREFIX = "--sglang-"
FLAG = "miles.flag"  # field metadata key: the add_argument keywords of a field that is a flag


# --- flag value types (argparse `type=`) ---------------------------------------------------


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


# --- declaring a flag ----------------------------------------------------------------------


def flag(**options: Any) -> Any:
    """A section field that is the flag `--<field name with dashes>`; `options` are the keywords
    argparse's add_argument takes (type, default, choices, nargs, action, required, help). The
    field's own default is the flag's (False for a switch, a tuple for a list)."""
    value = False if options.get("action") == "store_true" else options.get("default")
    if isinstance(value, list):
        value = tuple(value)
    return field(default=value, metadata={FLAG: options})


def _int() -> Any:
    return flag(type=int)


def _float() -> Any:
    return flag(type=float)


def _text() -> Any:
    return flag()


def _switch() -> Any:
    return flag(action="store_true")


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its option string, the section field it fills, argparse's keywords."""

    option: str  # --rollout-batch-size
    dest: str  # rollout_batch_size: the argparse attribute and the section field
    section: str  # the name of the section it belongs to
    options: Mapping[str, Any]

    @property
    def default(self) -> Any:
        """The value argparse gives when the flag is not passed."""
        return False if self.options.get("action") == "store_true" else self.options.get("default")


class Section:
    """A typed, frozen group of flags. `name` is its attribute on RunConfig (and what the
    components' consumption declarations say), `title` the heading `--help` shows it under."""

    name: ClassVar[str]
    title: ClassVar[str]

    @classmethod
    def flags(cls) -> tuple[Flag, ...]:
        return tuple(
            Flag("--" + f.name.replace("_", "-"), f.name, cls.name, f.metadata[FLAG])
            for f in fields(cls)  # type: ignore[arg-type]
            if FLAG in f.metadata
        )

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace):
        """The section's fields from the parsed flags (lists become tuples: sections are frozen)."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if FLAG in f.metadata:
                value = getattr(namespace, f.name)
                values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def non_default(self) -> dict[str, Any]:
        """Option string -> value of each of the section's flags whose value is not its default:
        the section's share of the flags a command set (RunConfig.flags_set), and any value the
        validation filled in from another flag (--eps-clip-high from --eps-clip)."""
        defaults = {f.name: f.default for f in fields(self)}  # type: ignore[arg-type]
        return {
            f.option: getattr(self, f.dest) for f in self.flags() if getattr(self, f.dest) != defaults[f.dest]
        }


# --- the sections, in the order --help shows them -----------------------------------------


@dataclass(frozen=True)
class CheckpointConfig(Section):
    name: ClassVar[str] = "checkpoint"
    title: ClassVar[str] = "checkpoint"

    hf_checkpoint: str = flag(required=True, help="Hugging Face model dir: weights, config, tokenizer")
    ref_load: str | None = flag(help="reference model: an HF dir, or a torch_dist dir (megatron backend)")
    load: str | None = flag(help="resume from the latest checkpoint here (fresh start when there is none)")
    save: str | None = flag(help="write checkpoints here")
    save_interval: int | None = flag(type=_positive_int, help="save every N rollouts (and after the last)")
    ckpt_step: int | None = flag(type=int, help="resume from this rollout instead of the latest")
    no_save_optim: bool = flag(action="store_true", help="save model weights only")
    no_load_optim: bool = flag(action="store_true", help="resume weights but start a fresh optimizer")
    ckpt_format: str = flag(default="torch_dist", choices=("torch_dist", "torch"))
    megatron_to_hf_mode: str = flag(default="raw", choices=("raw", "bridge"))
    keep_old_actor: bool = _switch()
    finetune: bool = flag(action="store_true", help="(megatron) load weights without iteration state")


@dataclass(frozen=True)
class DataConfig(Section):
    name: ClassVar[str] = "data"
    title: ClassVar[str] = "data"

    prompt_data: str = flag(
        default="synthetic:fixed",
        help="JSONL or Parquet file, or synthetic:<task> (tasks: fixed, copy, echo, arith)",
    )
    input_key: str = flag(default="prompt")
    label_key: str = flag(default="label")
    metadata_key: str = flag(default="metadata")
    tool_key: str | None = _text()
    apply_chat_template: bool = flag(action="store_true", help="wrap each prompt in the chat template")
    system_prompt: str | None = flag(help="system message added when the chat template is applied")
    rollout_shuffle: bool = flag(action="store_true", help="shuffle prompts each epoch (seeded)")
    num_epoch: int | None = flag(type=_positive_int)


@dataclass(frozen=True)
class EvalConfig(Section):
    name: ClassVar[str] = "eval"
    title: ClassVar[str] = "evaluation"

    eval_prompt_data: tuple[str, ...] | None = flag(nargs="+", help="NAME PATH pairs, scored as eval/NAME")
    eval_interval: int | None = flag(type=_positive_int, help="evaluate after every N rollouts")
    n_samples_per_eval_prompt: int = flag(
        type=_positive_int, default=1, help="samples per eval prompt; above 1, pass@k is logged too"
    )
    eval_max_response_len: int | None = flag(type=_positive_int)
    eval_temperature: float | None = flag(type=_non_negative_float, help="0 = greedy")
    eval_top_p: float | None = flag(type=_fraction)
    eval_top_k: int | None = flag(type=int, help="-1 = off; 1 = greedy")
    eval_input_key: str | None = flag(help="prompt key of the eval sets (default: --input-key)")
    eval_label_key: str | None = flag(help="label key of the eval sets (default: --label-key)")
    skip_eval_before_train: bool = flag(
        action="store_true", help="no evaluation before the first rollout (by default there is one)"
    )


@dataclass(frozen=True)
class RolloutConfig(Section):
    name: ClassVar[str] = "rollout"
    title: ClassVar[str] = "rollout"

    num_rollout: int = flag(type=_positive_int, default=10, help="training steps (rollouts) in all")
    rollout_batch_size: int = flag(type=_positive_int, default=8, help="prompts per rollout")
    n_samples_per_prompt: int = flag(type=_positive_int, default=8, help="group size")
    rollout_max_response_len: int = flag(type=_positive_int, default=64)
    rollout_max_prompt_len: int | None = flag(type=_positive_int)
    rollout_temperature: float = flag(type=float, default=1.0)
    rollout_top_p: float = flag(type=_fraction, default=1.0)
    rollout_top_k: int = flag(type=int, default=-1, help="-1 = off")
    rollout_stop_token_ids: tuple[int, ...] = flag(type=int, nargs="*", default=[])
    rollout_seed: int | None = flag(type=int, help="sampling seed (default: --seed)")
    rollout_function_path: str | None = flag(help="(GPU lanes) custom rollout function, dotted path")
    over_sampling_batch_size: int | None = flag(type=_positive_int)
    dynamic_sampling_filter_path: str | None = _text()
    partial_rollout: bool = _switch()
    update_weights_interval: int = flag(type=_positive_int, default=1)

    @property
    def samples(self) -> int:
        """Samples per rollout: prompts x group size."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def sampling_config(self, eos_token_ids: Sequence[int] = ()) -> SamplingConfig:
        """What the rollout engine samples with; the model's end-of-sequence ids stop it too."""
        return SamplingConfig(
            temperature=self.rollout_temperature,
            top_p=self.rollout_top_p,
            top_k=self.rollout_top_k,
            max_response_len=self.rollout_max_response_len,
            stop_token_ids=tuple(dict.fromkeys([*self.rollout_stop_token_ids, *eos_token_ids])),
        )


@dataclass(frozen=True)
class BatchConfig(Section):
    """How a rollout's samples are cut into optimizer steps and micro-batches."""

    name: ClassVar[str] = "batch"
    title: ClassVar[str] = "training batches"

    global_batch_size: int | None = flag(type=_positive_int, help="samples per optimizer step (all ranks)")
    allow_partial_train_step: bool = flag(
        action="store_true",
        help="train a rollout's samples past the last whole --global-batch-size as one smaller final step "
        "(with --disable-rollout-trim-samples); its loss is normalised by its own sample or token count",
    )
    disable_rollout_trim_samples: bool = flag(
        action="store_true", help="keep a rollout's samples past the last whole --global-batch-size"
    )
    micro_batch_size: int = flag(
        type=_positive_int, default=8, help="samples per forward per rank (unless dynamic batch size)"
    )
    balance_data: bool = flag(
        action="store_true", help="deal a step's samples to data-parallel ranks by token count"
    )
    use_dynamic_batch_size: bool = flag(
        action="store_true", help="fill each forward up to --max-tokens-per-gpu"
    )
    max_tokens_per_gpu: int | None = flag(
        type=_positive_int,
        help="padded tokens (rows x widest row) per forward per GPU and context-parallel rank; a longer sample "
        "runs alone; without dynamic batch size, a ceiling on the micro-batch size",
    )


@dataclass(frozen=True)
class SGLangConfig(Section):
    """The SGLang rollout engine; `server_args` are the `--sglang-<name> [values]` flags the
    parser does not define itself, passed to SGLang's ServerArgs unchanged."""

    name: ClassVar[str] = "sglang"
    title: ClassVar[str] = "SGLang rollout engine"

    rollout_num_gpus_per_engine: int = flag(type=_positive_int, default=1)
    update_weight_buffer_size: int | None = flag(
        type=_positive_int, help="bytes per weight push to SGLang (512 MiB)"
    )
    sglang_mem_fraction_static: float | None = flag(type=_fraction, help="SGLang KV-cache memory share")
    server_args: Mapping[str, str | bool | list[str]] = field(default_factory=dict)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> SGLangConfig:
        base = super().from_namespace(namespace)
        return cls(**{**vars(base), "server_args": dict(getattr(namespace, "sglang_args", {}))})


@dataclass(frozen=True)
class RewardConfig(Section):
    name: ClassVar[str] = "reward"
    title: ClassVar[str] = "reward"

    rm_type: str = flag(
        default="synthetic",
        help="math | deepscaler | dapo | gsm8k | synthetic | a dotted path module.func / module:func",
    )
    custom_rm_path: str | None = flag(help="dotted path of a reward function; wins over --rm-type")
    reward_key: str | None = flag(help="when the reward function returns a dict, the key to train on")
    rm_url: str | None = flag(help="remote reward model (not supported by the built-in rollout)")


@dataclass(frozen=True)
class AlgorithmConfig(Section):
    name: ClassVar[str] = "algorithm"
    title: ClassVar[str] = "algorithm"

    advantage_estimator: str = flag(default="grpo", choices=ADVANTAGE_ESTIMATORS)
    disable_grpo_std_normalization: bool = flag(action="store_true", help="Dr. GRPO: no std division")
    eps_clip: float = flag(type=_non_negative_float, default=0.2)
    eps_clip_high: float | None = flag(type=_non_negative_float, help="upper clip (default: --eps-clip)")
    eps_clip_c: float | None = flag(type=float, help="dual-clip constant (> 1) for negative advantages")
    use_kl_loss: bool = flag(action="store_true", help="add a KL loss against the frozen reference")
    kl_loss_type: str = flag(default="low_var_kl", choices=KL_LOSS_TYPES)
    kl_loss_coef: float = flag(type=_non_negative_float, default=0.0)
    kl_coef: float = flag(type=_non_negative_float, default=0.0, help="KL in the reward (must be 0)")
    entropy_coef: float = flag(type=_non_negative_float, default=0.0)
    use_tis: bool = flag(action="store_true", help="truncated importance sampling vs rollout logprobs")
    tis_clip: float = flag(type=_non_negative_float, default=2.0)
    tis_clip_low: float = flag(type=_non_negative_float, default=0.0)
    calculate_per_token_loss: bool = flag(action="store_true", help="average over tokens, not samples")
    use_rollout_logprobs: bool = flag(action="store_true", help="old logprobs from the rollout engine")

    def loss_config(self, temperature: float) -> LossConfig:
        """The loss terms' settings; `temperature` is the rollout's, so trainer and engine logprobs agree."""
        return LossConfig(
            advantage_estimator=self.advantage_estimator,
            eps_clip=self.eps_clip,
            eps_clip_high=self.eps_clip if self.eps_clip_high is None else self.eps_clip_high,
            eps_clip_c=self.eps_clip_c,
            use_kl_loss=self.use_kl_loss,
            kl_loss_type=self.kl_loss_type,
            kl_loss_coef=self.kl_loss_coef,
            entropy_coef=self.entropy_coef,
            use_tis=self.use_tis,
            tis_clip=self.tis_clip,
            tis_clip_low=self.tis_clip_low,
            per_token_loss=self.calculate_per_token_loss,
            temperature=temperature,
        )


@dataclass(frozen=True)
class OptimizerConfig(Section):
    name: ClassVar[str] = "optimizer"
    title: ClassVar[str] = "optimizer"

    optimizer: str = flag(default="adam", choices=("adam",), help="AdamW (decoupled weight decay)")
    lr: float = flag(type=_non_negative_float, default=1e-6)
    min_lr: float = flag(type=_non_negative_float, default=0.0)
    lr_decay_style: str = flag(default="constant", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = flag(type=int, default=0)
    lr_decay_iters: int | None = flag(type=_positive_int)
    weight_decay: float = flag(type=_non_negative_float, default=0.0)
    adam_beta1: float = flag(type=float, default=0.9)
    adam_beta2: float = flag(type=float, default=0.999)
    adam_eps: float = flag(type=float, default=1e-8)
    clip_grad: float = flag(type=_non_negative_float, default=1.0, help="max grad norm; 0 = off")
    max_skipped_steps: int = flag(
        type=int,
        default=3,
        help="stop after this many optimizer steps in a row skipped for a non-finite loss or grad norm; 0 = never",
    )
    bf16: bool = flag(
        action="store_true",
        help="bfloat16 compute with float32 master weights, gradient reduction and optimizer state",
    )
    fp16: bool = _switch()

    def optim_config(self) -> OptimConfig:
        return OptimConfig(
            lr=self.lr,
            min_lr=self.min_lr,
            lr_decay_style=self.lr_decay_style,
            lr_warmup_iters=self.lr_warmup_iters,
            lr_decay_iters=self.lr_decay_iters,
            weight_decay=self.weight_decay,
            beta1=self.adam_beta1,
            beta2=self.adam_beta2,
            eps=self.adam_eps,
            clip_grad=self.clip_grad,
        )


@dataclass(frozen=True)
class JobConfig(Section):
    """Which backend and engine run, on how many GPUs, where, and the run's seed."""

    name: ClassVar[str] = "job"
    title: ClassVar[str] = "job (backend, engine, GPUs, placement, seed)"

    train_backend: str = flag(default="fsdp", choices=TRAIN_BACKENDS)
    rollout_engine: str = flag(default="auto", choices=ROLLOUT_ENGINES, help="auto: sglang on GPU")
    distributed_backend: str | None = flag(choices=("gloo", "nccl"), help="default: nccl on GPU, else gloo")
    actor_num_nodes: int = flag(type=_positive_int, default=1)
    actor_num_gpus_per_node: int = flag(type=_positive_int, default=1)
    rollout_num_gpus: int | None = flag(type=_positive_int)
    colocate: bool = flag(action="store_true", help="rollout and training share the GPUs")
    offload: bool = _switch()
    offload_train: bool = _switch()
    offload_rollout: bool = _switch()
    seed: int = flag(type=int, default=1234)
    num_threads: int | None = flag(type=_positive_int, help="torch intra-op threads per rank (CPU)")
    deterministic_mode: bool = flag(
        action="store_true",
        help="deterministic kernels: a rerun with the same seed and layout is bit-identical",
    )
    debug_deterministic_collective: bool = flag(
        action="store_true",
        help="(debugging; slow) all-reduce and reduce-scatter as an all-gather and a fixed-order sum "
        "(miles.train.deterministic)",
    )

    @property
    def world_size(self) -> int:
        """The ranks the job asks for: --actor-num-nodes x --actor-num-gpus-per-node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(frozen=True)
class ParallelFlags(Section):
    """The parallel layout's flags; the run carries them as one `ParallelLayout` (RunConfig.layout),
    resolved once by miles.parallel."""

    name: ClassVar[str] = "layout"
    title: ClassVar[str] = "parallel layout (megatron backend)"

    tensor_model_parallel_size: int = flag(type=_positive_int, default=1)
    pipeline_model_parallel_size: int = flag(type=_positive_int, default=1)
    context_parallel_size: int = flag(type=_positive_int, default=1)
    expert_model_parallel_size: int = flag(type=_positive_int, default=1)
    expert_tensor_parallel_size: int | None = flag(type=_positive_int, help="default: the TP size")
    sequence_parallel: bool = _switch()
    decoder_first_pipeline_num_layers: int | None = flag(type=_positive_int)
    decoder_last_pipeline_num_layers: int | None = flag(type=_positive_int)
    num_layers_per_virtual_pipeline_stage: int | None = flag(type=_positive_int)
    num_virtual_stages_per_pipeline_rank: int | None = flag(type=_positive_int, help="virtual pipeline (vpp)")
    cp_comm_type: str | None = flag(choices=("p2p", "a2a", "all_gather", "allgather", "a2a+p2p"))


@dataclass(frozen=True)
class TorchDPConfig(Section):
    """Options only the data-parallel backends (FSDP2, DDP) act on."""

    name: ClassVar[str] = "fsdp"
    title: ClassVar[str] = "fsdp/ddp backend"

    gradient_checkpointing: bool = flag(action="store_true", help="(fsdp/ddp) recompute activations")


@dataclass(frozen=True)
class ModelConfig(Section):
    """Megatron's model-shape flags, as recipes emit them. The megatron backend builds the model
    from config.json and refuses a flag that describes another model; fsdp/ddp read config.json."""

    name: ClassVar[str] = "model"
    title: ClassVar[str] = "megatron model shape (megatron backend; fsdp/ddp read the HF config)"

    num_layers: int | None = _int()
    hidden_size: int | None = _int()
    ffn_hidden_size: int | None = _int()
    num_attention_heads: int | None = _int()
    num_query_groups: int | None = _int()
    kv_channels: int | None = _int()
    vocab_size: int | None = _int()
    max_position_embeddings: int | None = _int()
    original_max_position_embeddings: int | None = _int()
    make_vocab_size_divisible_by: int | None = _int()
    num_experts: int | None = _int()
    moe_ffn_hidden_size: int | None = _int()
    moe_shared_expert_intermediate_size: int | None = _int()
    moe_router_topk: int | None = _int()
    moe_router_num_groups: int | None = _int()
    moe_router_group_topk: int | None = _int()
    q_lora_rank: int | None = _int()
    kv_lora_rank: int | None = _int()
    qk_head_dim: int | None = _int()
    qk_pos_emb_head_dim: int | None = _int()
    v_head_dim: int | None = _int()
    mtp_num_layers: int | None = _int()
    rotary_interleaved_groups: int | None = _int()
    dsa_indexer_n_heads: int | None = _int()
    dsa_indexer_head_dim: int | None = _int()
    dsa_indexer_topk: int | None = _int()
    num_dense_layers: int | None = _int()
    window_attn_skip_freq: int | None = _int()
    norm_epsilon: float | None = _float()
    rotary_base: float | None = _float()
    rotary_percent: float | None = _float()
    rotary_scaling_factor: float | None = _float()
    moe_router_topk_scaling_factor: float | None = _float()
    mscale: float | None = _float()
    mscale_all_dim: float | None = _float()
    beta_fast: float | None = _float()
    beta_slow: float | None = _float()
    normalization: str | None = _text()
    position_embedding_type: str | None = _text()
    moe_router_score_function: str | None = _text()
    moe_layer_freq: str | None = _text()
    qk_layernorm_type: str | None = _text()
    kv_lora_dtype: str | None = _text()
    experimental_attention_variant: str | None = _text()
    swiglu: bool = _switch()
    group_query_attention: bool = _switch()
    use_rotary_position_embeddings: bool = _switch()
    disable_bias_linear: bool = _switch()
    add_qkv_bias: bool = _switch()
    qk_layernorm: bool = _switch()
    untie_embeddings_and_output_weights: bool = _switch()
    moe_router_pre_softmax: bool = _switch()
    moe_router_enable_expert_bias: bool = _switch()
    moe_apply_probs_on_input: bool = _switch()
    multi_latent_attention: bool = _switch()
    no_position_embedding: bool = _switch()
    apply_layernorm_1p: bool = _switch()
    use_dsa: bool = _switch()
    vocab_extra_ids: bool = _switch()
    window_size: tuple[int, int] | None = flag(
        type=_window, help="sliding window as Megatron-LM's LEFT,RIGHT (-1: unbounded)"
    )


@dataclass(frozen=True)
class MegatronConfig(Section):
    """Megatron-LM's training, performance and memory options: only the megatron backend can act
    on them (which ones it does is its consumption declaration, miles.train.backends.megatron)."""

    name: ClassVar[str] = "megatron"
    title: ClassVar[str] = "megatron training, performance and memory"

    seq_length: int | None = _int()
    attention_dropout: float | None = _float()
    hidden_dropout: float | None = _float()
    init_method_std: float | None = _float()
    moe_router_dtype: str | None = _text()
    moe_router_load_balancing_type: str | None = _text()
    moe_aux_loss_coeff: float | None = _float()
    moe_z_loss_coeff: float | None = _float()
    moe_router_bias_update_rate: float | None = _float()
    moe_router_topk_limited_devices: int | None = _int()
    moe_input_jitter_eps: float | None = _float()
    moe_expert_capacity_factor: float | None = _float()
    moe_pad_expert_input_to_capacity: str | None = _text()
    moe_token_dispatcher_type: str | None = _text()
    mtp_loss_scaling_factor: float | None = _float()
    moe_grouped_gemm: bool = _switch()
    moe_permute_fusion: bool = _switch()
    moe_shared_expert_overlap: bool = _switch()
    moe_layer_recompute: int | None = _int()
    recompute_granularity: str | None = _text()
    recompute_method: str | None = _text()
    recompute_num_layers: int | None = flag(type=int)
    recompute_modules: tuple[str, ...] | None = flag(nargs="+")
    attention_backend: str | None = _text()
    transformer_impl: str | None = _text()
    spec: str | None = _text()
    tokenizer_type: str | None = _text()
    tokenizer_model: str | None = _text()
    no_rope_fusion: bool = _switch()
    no_bias_swiglu_fusion: bool = _switch()
    no_bias_dropout_fusion: bool = _switch()
    no_masked_softmax_fusion: bool = _switch()
    no_gradient_accumulation_fusion: bool = _switch()
    use_flash_attn: bool = _switch()
    accumulate_allreduce_grads_in_fp32: bool = _switch()
    attention_softmax_in_fp32: bool = _switch()
    use_distributed_optimizer: bool = _switch()
    overlap_grad_reduce: bool = _switch()
    overlap_param_gather: bool = _switch()
    optimizer_cpu_offload: bool = _switch()
    overlap_cpu_optimizer_d2h_h2d: bool = _switch()
    use_precision_aware_optimizer: bool = _switch()
    use_mcore_models: bool = _switch()
    no_load_rng: bool = _switch()
    no_save_rng: bool = _switch()


@dataclass(frozen=True)
class ChecksConfig(Section):
    name: ClassVar[str] = "checks"
    title: ClassVar[str] = "checks and CI"

    ci_test: bool = flag(action="store_true", help="assert the in-loop checks (see miles.train.checks)")
    ci_disable_kl_checker: bool = flag(action="store_true", help="skip the step-0 ppo_kl check")
    check_weight_update_equal: bool = flag(action="store_true", help="check weight sync every step")
    check_weight_update_skip_list: tuple[str, ...] = flag(
        nargs="*", default=[], help="name substrings to skip"
    )
    ci_logprob_abs_diff_tol: float = flag(type=_non_negative_float, default=1e-3)
    ci_step0_kl_tol: float = flag(type=_non_negative_float, default=1e-6)
    ci_metric_checker_key: str | None = _text()
    ci_metric_checker_threshold: float | None = flag(type=float)
    dry_start: bool = flag(
        action="store_true",
        help="check the flags and the starting checkpoint: build the model at the layout, load its weights, stop",
    )
    debug_rollout_only: bool = _switch()
    debug_train_only: bool = _switch()
    save_debug_rollout_data: str | None = _text()
    load_debug_rollout_data: str | None = _text()


@dataclass(frozen=True)
class LoggingConfig(Section):
    name: ClassVar[str] = "logging"
    title: ClassVar[str] = "logging"

    log_interval: int = flag(type=_positive_int, default=1)
    log_passrate: bool = _switch()
    use_wandb: bool = _switch()
    wandb_project: str | None = _text()
    wandb_group: str | None = _text()
    wandb_key: str | None = _text()
    wandb_host: str | None = _text()
    wandb_mode: str | None = _text()
    wandb_team: str | None = _text()
    disable_wandb_random_suffix: bool = _switch()
    use_tensorboard: bool = _switch()


SECTIONS: tuple[type[Section], ...] = (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    RolloutConfig,
    BatchConfig,
    SGLangConfig,
    RewardConfig,
    AlgorithmConfig,
    OptimizerConfig,
    JobConfig,
    ParallelFlags,
    TorchDPConfig,
    ModelConfig,
    MegatronConfig,
    ChecksConfig,
    LoggingConfig,
)
FLAGS: tuple[Flag, ...] = tuple(f for section in SECTIONS for f in section.flags())
SECTION_NAMES: tuple[str, ...] = tuple(s.name for s in SECTIONS)


def flag_of(option: str) -> Flag | None:
    """The flag an option string names (None: not a flag of the trainer)."""
    return _BY_OPTION.get(option)


_BY_OPTION = {f.option: f for f in FLAGS}


# --- the run's configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Every section of one command, built once from its parsed flags. `layout` is the section
    of the layout flags as the one `ParallelLayout`; `flags_set` the options the command sets to
    a value other than their default (in section order, then the `--sglang-<name>` ones)."""

    checkpoint: CheckpointConfig
    data: DataConfig
    eval: EvalConfig
    rollout: RolloutConfig
    batch: BatchConfig
    sglang: SGLangConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    job: JobConfig
    layout: ParallelLayout
    fsdp: TorchDPConfig
    model: ModelConfig
    megatron: MegatronConfig
    checks: ChecksConfig
    logging: LoggingConfig
    flags_set: tuple[str, ...] = ()

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> RunConfig:
        """The sections of a namespace `miles.train.args.parse_args` returned (validated, with
        the layout resolved and the flags it sets recorded)."""
        sections: dict[str, Any] = {
            s.name: s.from_namespace(namespace) for s in SECTIONS if s is not ParallelFlags
        }
        return cls(**sections, layout=namespace.layout, flags_set=tuple(namespace.flags_set))

    def section(self, name: str) -> Any:
        """The section called `name` (a name of SECTION_NAMES)."""
        if name not in SECTION_NAMES:
            raise KeyError(f"no section {name!r}; sections: {', '.join(SECTION_NAMES)}")
        return getattr(self, name)


def flags_set(namespace: argparse.Namespace) -> tuple[str, ...]:
    """The options whose parsed value is not their default, and every passed-through `--sglang-*`."""
    changed = [f.option for f in FLAGS if getattr(namespace, f.dest, f.default) != f.default]
    passthrough = [SGLANG_PREFIX + k.replace("_", "-") for k in getattr(namespace, "sglang_args", {})]
    return tuple(changed + passthrough)


def step_sizes(samples: int, global_batch_size: int, *, partial: bool = False) -> list[int]:
    """The samples of each optimizer step of a rollout of `samples`: whole --global-batch-size
    steps, then, with `partial` (--allow-partial-train-step with --disable-rollout-trim-samples),
    the rest as one smaller step (as the seed framework plans them: radixark/miles 31f1ca961,
    miles/utils/dp_schedule.py)."""
    sizes = [global_batch_size] * (samples // global_batch_size)
    rest = samples % global_batch_size
    return sizes + [rest] if rest and partial else sizes


def optimizer_steps(rollout: RolloutConfig, batch: BatchConfig) -> int:
    """Optimizer steps of the whole run (the learning-rate schedule's length; a partial step counts)."""
    partial = batch.allow_partial_train_step and batch.disable_rollout_trim_samples
    return rollout.num_rollout * len(step_sizes(rollout.samples, batch.global_batch_size, partial=partial))


# --- what the algorithm code takes, derived from the sections ------------------------------


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
