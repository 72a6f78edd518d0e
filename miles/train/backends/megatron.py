"""`--train-backend megatron`: the policy as a megatron-core GPTModel, on GPUs or on CPU under gloo.

The layout of the recipe (TP, SP, PP, VPP, CP, EP, ETP, DP) becomes megatron's process groups;
the model is built from the HF config with the Transformer Engine layer spec and loaded
from the torch_dist checkpoint `prepare-ckpt` writes (`--ref-load`); micro-batches go
through megatron's `forward_backward_func` (so pipeline parallelism runs its real
schedule) with the GRPO/GSPO loss of `miles.train.algorithm` computed on vocabulary-parallel
logits; gradients are reduced by megatron's DDP and applied by its distributed optimizer
(fp32 main parameters). Without a GPU, `compat.install()` first redirects megatron-core's
CUDA assumptions to the CPU.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from miles.megatron import checkpoint as ckpt
from miles.megatron import model as mg
from miles.megatron import training as mt
from miles.megatron.export import WeightExporter
from miles.megatron.loss import gather_context_parallel, micro_batches, vocab_parallel_logprobs
from miles.train.args import loss_config, optim_config
from miles.train.backends import BackendUnavailable, StepResult, TrainBackend, batch_loss
from miles.train.batch import TokenBatch


class MegatronSetupError(BackendUnavailable):
    """The Megatron backend cannot start with these flags; the message names the fix."""


class MegatronBackend(TrainBackend):
    def __init__(self, args, dist_info):
        self.args = args
        self.on_cpu = dist_info.device == "cpu"
        if self.on_cpu:
            from miles.megatron import compat

            compat.install()
        self.device = dist_info.device
        self.loss_cfg = loss_config(args)
        self.optim_cfg = optim_config(args)
        self.config = json.loads((Path(args.hf_checkpoint) / "config.json").read_text())
        check_model_flags(args, self.config, args.hf_checkpoint)
        self.source = _weights_source(args)
        self.layout = args.layout  # parsed and checked with the flags (miles.train.args)
        mt.init_parallel_state(self.layout, args.seed)
        self.tc = _transformer_config(args, self.config, self.layout, on_cpu=self.on_cpu)
        # The reference model gets a config of its own: the policy's gains DDP hooks below.
        ref_tc = copy.copy(self.tc)
        self.vocab = ckpt.embedding_rows(self.source) or int(self.config["vocab_size"])
        chunks = self._load_chunks(self.tc)
        mg.freeze_padding_embedding(chunks, self.config.get("pad_token_id"))
        self.chunks = [c.to(self.device) for c in chunks]
        self.model = mt.wrap_ddp(self.chunks, self.tc)
        self.optimizer = mt.build_optimizer(self.model, self.optim_cfg, self.tc)
        mt.connect_schedule(self.tc, self.model)
        if dist_info.is_main:
            print(f"miles.train: megatron {self.schedule()}", flush=True)
        self.ref_chunks = None
        self.ref_source = self.source
        if args.use_kl_loss:
            self.ref_chunks = [
                c.to(self.device).eval().requires_grad_(False) for c in self._load_chunks(ref_tc)
            ]
        self.fused_experts = _hf_fuses_experts(args.hf_checkpoint)
        steps_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
        self.total_steps = args.num_rollout * steps_per_rollout
        self.steps_done = 0

    def _load_chunks(self, tc) -> list:
        from miles.megatron.families import UnmappedModel

        try:
            chunks = mg.build_chunks(self.config, tc, self.vocab)
        except UnmappedModel as exc:  # a model chunk the layout cannot build (the message says why)
            raise MegatronSetupError(f"{self.args.hf_checkpoint}: {exc}") from exc
        try:
            ckpt.load_weights(chunks, self.source)
        except ckpt.CheckpointMismatch as exc:
            raise MegatronSetupError(str(exc)) from exc
        return chunks

    # --- the trainer's interface -------------------------------------------------------

    @property
    def data_parallel(self) -> tuple[int, int, object]:
        return mt.data_parallel()

    def logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        return self.batch_logprobs(batch, batch.size, reference=reference)

    def batch_logprobs(
        self, batch: TokenBatch, micro_batch_size: int, *, reference: bool = False
    ) -> torch.Tensor:
        """All micro-batches of the batch in one pass of megatron's schedule (a pipeline stays full)."""
        chunks = self.ref_chunks if reference else self.chunks
        for chunk in chunks:
            chunk.eval()
        parts = [batch.rows(slice(s, s + micro_batch_size)) for s in range(0, batch.size, micro_batch_size)]
        with torch.no_grad():
            results = self._run(parts, chunks, self._logprob_loss, forward_only=True)
        out = torch.zeros_like(batch.loss_mask)
        for start, result in zip(range(0, batch.size, micro_batch_size), results, strict=False):
            logp = result["logp"]
            out[start : start + logp.shape[0], : logp.shape[1]] = logp
        return out

    def train_step(self, micro: Sequence[TokenBatch], normalizer: float) -> StepResult:
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_fn = functools.partial(
            self._policy_loss, normalizer=normalizer, count=self._schedule_count(len(micro))
        )
        results = self._run(micro, self.model, loss_fn, forward_only=False)
        lr = self._set_lr()
        terms = tuple(r["terms"] for r in results)
        loss = sum(float(t.loss) for t in terms)
        applied, grad_norm = self._guarded_step(loss)
        if applied:
            self.steps_done += 1
        return StepResult(grad_norm=float(grad_norm), lr=lr, terms=terms, skipped=not applied)

    def full_weights(self, names: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
        fused = self.fused_experts and names == "model"
        # carried MTP layers go to an engine that loads checkpoint names (SGLang drafts with them)
        yield from WeightExporter(self.chunks, self.config, fused_experts=fused, extras=names == "checkpoint")

    def save(self, directory: str, *, with_optimizer: bool) -> None:
        steps = self.steps_done if with_optimizer else None
        ckpt.save_training_state(self.chunks, self.optimizer, directory, steps_done=steps)

    def load(self, directory: str, *, with_optimizer: bool) -> None:
        steps = ckpt.load_training_state(
            self.chunks, self.optimizer, directory, with_optimizer=with_optimizer
        )
        if steps is not None:
            self.steps_done = steps
        dist.barrier()

    def schedule(self) -> str:
        """The pipeline schedule megatron runs for this layout, and the model chunks per rank."""
        chunks = len(self.chunks)
        return f"{self.layout.describe()}: {mt.schedule_name()}, {chunks} model chunk{'s' if chunks > 1 else ''} per rank"

    # --- machinery ----------------------------------------------------------------------

    def _run(self, parts: Sequence[TokenBatch], chunks, loss_fn, *, forward_only: bool) -> list[dict]:
        """The micro-batches through megatron's schedule; the last stage's loss outputs, on every rank."""
        rows = max(self.args.micro_batch_size, max(p.size for p in parts))
        cp = self.layout.cp
        # sequence parallelism splits each rank's tokens over TP; context parallelism the
        # sequence into 2·cp chunks
        seq_multiple = (self.layout.tp if self.tc.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
        # The interleaved (VPP) schedule takes micro-batches in multiples of the pipeline size;
        # extra ones are all padding and add nothing to any loss or result.
        parts = list(parts)
        if self.layout.interleaved:
            pp = self.layout.pp
            parts += [parts[-1].rows(slice(0, 0))] * (-len(parts) % pp)
        micro, seq = micro_batches(parts, rows, seq_multiple, self.device, cp, mt.context_parallel_rank())

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return model(mb.model_tokens, mb.model_position_ids, None), functools.partial(loss_fn, mb)

        return mt.run_schedule(
            forward_step, chunks, micro, seq_length=seq, micro_batch_size=rows, forward_only=forward_only
        )

    def _schedule_count(self, parts: int) -> int:
        """How many micro-batches _run hands megatron's schedule for `parts` of them."""
        if self.layout.interleaved:
            return parts + (-parts % self.layout.pp)
        return parts

    def _token_logprobs(self, mb, output, *, with_entropy: bool):
        """Logprob and entropy [rows, width-1] of each target token of the micro-batch's own rows."""
        logp, entropy = vocab_parallel_logprobs(
            output,
            mb.local_targets(),
            self.loss_cfg.temperature,
            self.config["vocab_size"],
            with_entropy=with_entropy,
        )
        cp = self.layout.cp
        logp, entropy = gather_context_parallel(logp, cp), gather_context_parallel(entropy, cp)
        rows, width = mb.batch.size, mb.width - 1
        return logp[:rows, :width], entropy[:rows, :width]

    def _logprob_loss(self, mb, output):
        logp, _ = self._token_logprobs(mb, output, with_entropy=False)
        return output.sum() * 0.0, {"logp": logp.detach().float().cpu()}

    def _policy_loss(self, mb, output, *, normalizer: float, count: int):
        logp, entropy = self._token_logprobs(mb, output, with_entropy=True)
        terms = batch_loss(logp, entropy, mb.batch, self.loss_cfg)
        # megatron's schedule divides each micro-batch's loss by their count (and multiplies it by
        # the context-parallel size, whose ranks' gradients DDP then averages with the data-
        # parallel ones); the trainer's normaliser (samples or tokens of this rank's minibatch)
        # is what it must be divided by.
        loss = terms.loss * count / normalizer
        return loss, {"terms": replace(terms, loss=terms.loss.detach().cpu())}

    def _set_lr(self) -> float:
        from miles.train.backends.torch_dp import lr_factor

        lr = self.optim_cfg.lr * lr_factor(self.steps_done, self.optim_cfg, self.total_steps)
        mt.set_lr(self.optimizer, lr)
        return lr

    def _guarded_step(self, loss: float) -> tuple[bool, float]:
        """megatron's optimizer step, except that a non-finite loss or gradient norm on any rank
        applies nothing (miles.train.guards); returns whether it was applied, and the norm."""
        from miles.train.guards import all_finite_on_every_rank

        found_inf, grad_norm = mt.grads_ready(self.optimizer)
        if found_inf or not all_finite_on_every_rank(loss, grad_norm):
            return False, grad_norm
        return mt.apply_step(self.optimizer, self.optim_cfg.clip_grad, grad_norm), grad_norm


def _weights_source(args) -> str:
    """The torch_dist checkpoint the policy (and reference) start from."""
    if ckpt.is_torch_dist_dir(args.ref_load):
        return args.ref_load
    given = f"--ref-load {args.ref_load} is not a torch_dist checkpoint" if args.ref_load else "no --ref-load"
    raise BackendUnavailable(
        f"--train-backend megatron loads its starting weights from a Megatron torch_dist checkpoint; {given}. "
        f"Convert {args.hf_checkpoint} with `invoke prepare-ckpt` (it writes <model>_torch_dist) and pass that "
        "directory as --ref-load"
    )


def _hf_fuses_experts(path: str) -> bool:
    """Whether the installed transformers class keeps a layer's experts as fused 3-D tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(config).state_dict().keys()
    return any(name.endswith("mlp.experts.gate_up_proj") for name in names)


def check_model_flags(args, config: dict, path: str) -> None:
    """Every Megatron model flag the command sets agrees with config.json (through its family's
    facts table, `miles.models`, and the flags its architecture fixes), or one error lists every
    one that does not: the model is built from config.json, so a flag that says otherwise
    describes another model."""
    from miles import models
    from miles.models.facts import disagreements, text_config
    from miles.parallel.layout import dest

    keys = models.keys_of(config)
    family = models.family_of(text_config(config))
    fixed = family.fixed if family else ()
    given = {row.flag: getattr(args, dest(row.flag), None) for row in (*keys, *fixed)}
    wrong = disagreements(keys, config, {f: v for f, v in given.items() if v not in (None, False)}, fixed)
    if wrong:
        raise MegatronSetupError(
            f"{path}/config.json describes another model than the Megatron flags: {'; '.join(wrong)}. The model "
            "is built from config.json; fix the recipe's model flags or point --hf-checkpoint at the right model"
        )


def _transformer_config(args, config: dict, layout, *, on_cpu: bool):
    """The TransformerConfig of the run: the HF model's math, the layout, the recipe's MoE switches."""
    from miles.megatron.config import transformer_config
    from miles.megatron.families import UnmappedModel

    overrides = {}
    if args.moe_router_dtype:
        overrides["moe_router_dtype"] = args.moe_router_dtype
    if args.moe_aux_loss_coeff:
        overrides["moe_aux_loss_coeff"] = args.moe_aux_loss_coeff
        overrides["moe_router_load_balancing_type"] = args.moe_router_load_balancing_type or "aux_loss"
    if args.moe_token_dispatcher_type:
        overrides["moe_token_dispatcher_type"] = args.moe_token_dispatcher_type
    if args.recompute_granularity and not on_cpu:
        overrides["recompute_granularity"] = args.recompute_granularity
        overrides["recompute_method"] = args.recompute_method
        overrides["recompute_num_layers"] = args.recompute_num_layers
    if on_cpu:
        # gloo pairs point-to-point messages first-in first-out per pair of ranks. Batched p2p
        # posts a two-stage pipeline's activation and gradient to the same peer in an order the
        # peer does not mirror (the interleaved schedule swaps them); megatron's unbatched path
        # sends the two directions over two communicators.
        overrides["batch_p2p_comm"] = False
    dtype = torch.bfloat16 if args.bf16 and not on_cpu else torch.float32
    try:
        return transformer_config(config, layout, dtype=dtype, on_cpu=on_cpu, initialize=True, **overrides)
    except UnmappedModel as exc:
        raise MegatronSetupError(f"{args.hf_checkpoint}: {exc}") from exc
