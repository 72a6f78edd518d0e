"""`--train-backend megatron`: the policy as a megatron-core GPTModel, on GPUs or on CPU under gloo.

The layout of the recipe (TP, SP, PP, VPP, CP, EP, ETP, DP) becomes megatron's process groups;
the model is built from the HF config with the Transformer Engine layer spec (TE's own modules
where TE loads on a GPU, the stand-in ones otherwise: `miles.megatron.spec`) and loaded
from the torch_dist checkpoint `prepare-ckpt` writes (`--ref-load`); micro-batches go
through megatron's `forward_backward_func` (so pipeline parallelism runs its real
schedule) with the GRPO/GSPO loss of `miles.train.algorithm` computed on vocabulary-parallel
logits; gradients are reduced by megatron's DDP and applied by its distributed optimizer
(fp32 main parameters). The flags it acts on name it on their fields (`by=megatron`,
miles.train.config); how, one row per flag of `miles.megatron.options`, whose refusals and needs (TE's spec, a GPU, another flag) are
checked when the backend starts. On the CPU, `compat.install()` first redirects
megatron-core's CUDA assumptions. The run's first line names the spec, attention, experts and
optimizer actually built.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from miles.families import megatron_family, read_config
from miles.families import model as mg
from miles.megatron import checkpoint as ckpt
from miles.megatron import options
from miles.megatron import training as mt
from miles.megatron.export import WeightExporter
from miles.megatron.loss import gather_context_parallel, micro_batches, vocab_parallel_logprobs
from miles.parallel import ParallelLayout
from miles.train import lora as lora_adapters
from miles.train import micro_batches as split
from miles.train.backends import (
    ACTOR,
    CRITIC,
    BackendUnavailable,
    StepResult,
    TrainBackend,
    batch_loss,
    value_batch_loss,
)
from miles.train.batch import TokenBatch
from miles.train.config import (
    AlgorithmConfig,
    BatchConfig,
    CheckpointConfig,
    JobConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    optimizer_steps,
)


class MegatronSetupError(BackendUnavailable):
    """The Megatron backend cannot start with these flags; the message names the fix."""


class MegatronBackend(TrainBackend):
    # It is built from the sections of the flags that name it (miles.train.config: by=megatron).
    # The model shape is built from config.json, and a model flag that describes another model is
    # refused (check_model_flags, check_built_model); each megatron field it acts on does so through
    # its row of miles.megatron.options (the layer spec, a TransformerConfig, DDP or optimizer
    # field), and so does the checkpoint's megatron_to_hf_mode (raw is how it loads; bridge is refused).

    def __init__(
        self,
        *,
        job: JobConfig,
        checkpoint: CheckpointConfig,
        rollout: RolloutConfig,
        batch: BatchConfig,
        algorithm: AlgorithmConfig,
        optimizer: OptimizerConfig,
        layout: ParallelLayout,
        model: ModelConfig,
        megatron: MegatronConfig,
        lora: LoraConfig,
        dist_info,
        role: str = ACTOR,
    ):
        self.on_cpu = dist_info.device == "cpu"
        self.device = dist_info.device
        # first: a Transformer Engine that is installed but broken fails megatron-core's imports
        self.impl, why = _layer_spec(megatron, checkpoint, model, self.device)
        if self.on_cpu:
            from miles.megatron import compat

            compat.install()
        self.batching = batch
        self.role = role
        self.loss_cfg = algorithm.loss_config(rollout.rollout_temperature)
        self.value_clip = algorithm.value_clip
        self.optim_cfg = optimizer.optim_config(algorithm, critic=role == CRITIC)
        hf = self.hf_checkpoint = checkpoint.hf_checkpoint
        self.config = read_config(hf)  # the decoder's config (a multimodal release's text_config)
        check_model_flags(model, self.config, hf, megatron)
        self.source = _weights_source(checkpoint)
        self.layout = layout  # parsed and checked with the flags (miles.train.args)
        if role == ACTOR:  # the critic shares the policy's process groups (remaking them would end its)
            mt.init_parallel_state(self.layout, job.seed)
        dtype = torch.bfloat16 if optimizer.bf16 and not self.on_cpu else torch.float32
        self.tc = _transformer_config(
            megatron,
            self.config,
            self.layout,
            hf,
            dtype=dtype,
            on_cpu=self.on_cpu,
            impl=self.impl,
            deterministic=job.deterministic_mode,
        )
        _shape_each_micro_batch(self.tc, self.layout)
        self.pipeline_rows = _pipeline_rows(self.config)  # the config is mapped: transformer_config built
        self.forward_is_deterministic = not _noisy_in_training(self.tc)
        # The reference model gets a config of its own: the policy's gains DDP hooks below.
        ref_tc = copy.copy(self.tc)
        self.vocab = ckpt.embedding_rows(self.source) or int(self.config["vocab_size"])
        check_built_model(
            model, self.tc, self.vocab, hf, megatron_family(self.config).position_embedding_type
        )
        chunks = self._load_chunks(self.tc)
        if role == CRITIC:
            from miles.megatron.value_head import NoValueHead, attach_value_head

            try:
                attach_value_head(chunks, self.tc)
            except NoValueHead as exc:
                raise MegatronSetupError(f"{hf}: {exc}") from exc
        mg.freeze_padding_embedding(chunks, self.config.get("pad_token_id"))
        self.mtp = (
            _mtp_training(megatron, model, self.config, self.layout, lora, hf) if role == ACTOR else None
        )
        self.trains_mtp = self.mtp is not None
        if self.mtp is not None:
            from miles.megatron.mtp import train_mtp

            # the last pipeline stage carries the block
            if chunks[-1].post_process and getattr(chunks[-1], "mtp", None) is None:
                raise MegatronSetupError(
                    f"--enable-mtp-training: the {megatron_family(self.config).name} family builds no MTP block "
                    f"for {hf}'s MTP layers (its finish_model carries none: miles.megatron.mtp.carry_mtp)"
                )
            for chunk in chunks:
                if getattr(chunk, "mtp", None) is not None:
                    train_mtp(chunk)
                if megatron.mtp_only_training:  # only the MTP layers train: the policy stays as it is
                    for name, param in chunk.named_parameters():
                        param.requires_grad_(name.startswith("mtp."))
        self.lora = lora if lora.enabled and role == ACTOR else None  # adapters on the policy only
        self.adapted = self._attach_adapters(chunks, job.seed) if self.lora else []
        self.chunks = [c.to(self.device) for c in chunks]
        if self.mtp is not None:  # a last pipeline stage's MTP block reads the first stage's embedding
            from miles.megatron.mtp import share_word_embedding

            share_word_embedding(self.chunks)
        self.model = mt.wrap_ddp(self.chunks, self.tc, options.ddp_fields(megatron))
        self.optimizer = mt.build_optimizer(
            self.model, self.optim_cfg, self.tc, options.optimizer_fields(megatron)
        )
        self.params_stale = False  # overlapped parameter gathering leaves them stale after a step
        mt.connect_schedule(self.tc, self.model)
        if dist_info.is_main:
            from miles.megatron.spec import built_spec_line

            line = built_spec_line(self.chunks, self.optimizer, self.impl, why, self.tc.attention_backend)
            print(f"miles.train: {line}", flush=True)
            print(f"miles.train: megatron {self.schedule()}", flush=True)
        self.ref_chunks = None
        self.ref_source = self.source
        if algorithm.use_kl_loss and role == ACTOR:
            self.ref_chunks = [
                c.to(self.device).eval().requires_grad_(False) for c in self._load_chunks(ref_tc)
            ]
        # --use-rollout-routing-replay: the policy's routers take the rollout engine's experts (the
        # reference model and the critic route by their own top-k, as the seed framework's do)
        self.routing = None
        if rollout.use_rollout_routing_replay and role == ACTOR:
            from miles.megatron import routing as megatron_routing

            self.routing = megatron_routing.install(self.chunks, self.tc)
        self.optimizer_format = ckpt.optimizer_format(megatron.dist_ckpt_optim_fully_reshardable)
        self.fused_experts = _hf_fuses_experts(hf)
        self.total_steps = optimizer_steps(rollout, batch)
        self.steps_done = 0
        from miles.train import offload

        inner = [opt.optimizer for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        self.streamed = offload.setup(job, self, dist_info.rank, inner)

    def _attach_adapters(self, chunks, seed: int) -> list[str]:
        """The base frozen and the targeted layers given adapters (miles.megatron.lora): DDP and the
        optimizer then hold the adapters alone."""
        from miles.megatron import lora as adapters

        try:
            return adapters.attach(chunks, self.lora, self.tc, seed)
        except adapters.LoraRefused as exc:
            raise MegatronSetupError(f"{self.hf_checkpoint}: {exc}") from exc

    def _load_chunks(self, tc) -> list:
        from miles.families import UnmappedModel

        try:
            chunks = mg.build_chunks(self.config, tc, self.vocab, impl=self.impl)
        except UnmappedModel as exc:  # a model chunk the layout cannot build (the message says why)
            raise MegatronSetupError(f"{self.hf_checkpoint}: {exc}") from exc
        try:
            ckpt.load_weights(chunks, self.source)
        except ckpt.CheckpointMismatch as exc:
            raise MegatronSetupError(str(exc)) from exc
        return chunks

    # --- the trainer's interface -------------------------------------------------------

    @property
    def data_parallel(self) -> tuple[int, int, object]:
        return mt.data_parallel()

    @property
    def geometry(self) -> split.Geometry:
        cp = self.layout.cp
        # sequence parallelism splits each rank's tokens over TP; context parallelism the
        # sequence into 2·cp chunks
        seq_multiple = (self.layout.tp if self.tc.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
        return split.Geometry(seq_multiple=seq_multiple, context_parallel=cp, shared_shape=self._shared_shape)

    @property
    def _shared_shape(self) -> bool:
        """A two-stage interleaved pipeline pads a step's micro-batches to one shape: megatron-core's
        shape exchange (p2p_communication.py, _communicate_shapes) posts both directions' shapes
        to the one peer in an order that peer does not mirror, so the shapes cannot vary there."""
        return self.layout.interleaved and self.layout.pp == 2

    def logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        return self.batch_logprobs([batch], reference=reference)[0]

    def batch_logprobs(self, micro: Sequence[TokenBatch], *, reference: bool = False) -> list[torch.Tensor]:
        """All the micro-batches in one pass of megatron's schedule (a pipeline stays full)."""
        chunks = self.ref_chunks if reference else self.chunks
        if not reference:
            self._gather_params()
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            results = self._run(micro, chunks, self._logprob_loss, forward_only=True)
        return [result["logp"] for result in results[: len(micro)]]

    def batch_values(self, micro: Sequence[TokenBatch]) -> list[torch.Tensor]:
        """(critic) Every micro-batch's values in one pass of megatron's schedule."""
        self._gather_params()
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            results = self._run(micro, self.chunks, self._value_output, forward_only=True)
        return [result["logp"] for result in results[: len(micro)]]

    def train_step(self, micro: Sequence[TokenBatch], normalizer: float) -> StepResult:
        if self.mtp is not None and self.layout.pp > 1:
            # the last stage's MTP block reads the first stage's embedding as the last step left it
            from miles.megatron.mtp import share_word_embedding

            self._gather_params()
            share_word_embedding(self.chunks)
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_fn = functools.partial(
            self._value_loss if self.role == CRITIC else self._policy_loss,
            normalizer=normalizer,
            count=self._schedule_count(len(micro)),
        )
        results = self._run(micro, self.model, loss_fn, forward_only=False)
        lr = self._set_lr()
        terms = tuple(r["terms"] for r in results)
        loss = sum(float(t.loss) for t in terms)
        applied, grad_norm = self._guarded_step(loss)
        if applied:
            self.steps_done += 1
            self.params_stale = self.model[0].ddp_config.overlap_param_gather
        logprobs = tuple(r["logp"] for r in results[: len(micro)])
        return StepResult(
            grad_norm=float(grad_norm), lr=lr, terms=terms, skipped=not applied, logprobs=logprobs
        )

    def dump_chunks(self) -> list:
        return list(self.chunks)  # DDP's wrappers (self.model) run these

    def full_weights(self, names: str = "model", dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
        if names == "model":
            from miles.families.weights import OUTER_NAMES

            family = megatron_family(self.config)
            outer = family.outer_names(self.config)
            if (
                outer != OUTER_NAMES and family.renames_on_load
            ):  # the names transformers' causal LM gives them
                outer = tuple(family.model_name(n) for n in outer)
            if outer != OUTER_NAMES:
                raise MegatronSetupError(
                    f"{self.hf_checkpoint}: model_type {self.config.get('model_type')} is a multimodal release "
                    "that transformers' AutoModelForCausalLM (the built-in rollout engine's loader) does not "
                    "load; its weights are handed over under the checkpoint's names, to SGLang (--rollout-engine "
                    "sglang)"
                )
        fused = self.fused_experts and names == "model"
        self._gather_params()
        # carried MTP layers go to an engine that loads checkpoint names (SGLang drafts with them)
        family = megatron_family(self.config)
        exporter = WeightExporter(
            self.chunks,
            self.config,
            family.weights(self.config),
            rename=family.model_name if names == "model" and family.renames_on_load else None,
            fused_experts=fused,
            extras=names == "checkpoint" or self.mtp is not None,
            adjust=self._merged if self.lora else None,
        )
        yield from self._with_mtp(exporter, names, dtype)

    def _with_mtp(self, exporter, names: str, dtype):
        """The exporter's tensors; with --enable-mtp-training under the transformers class's names,
        the trained MTP layers too, as the built-in engine's drafter holds them (experts fused)."""
        from miles.ckpt.families import mtp_prefixes
        from miles.train.speculative import as_model_names

        style = megatron_family(self.config).mtp_style
        prefixes = tuple(mtp_prefixes(self.config, style))
        held = {}
        for name, tensor in exporter:
            if names == "model" and prefixes and name.startswith(prefixes):
                held[name] = tensor
                continue
            yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        for name, tensor in as_model_names(held, style).items():
            yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    def _merged(self, local: dict) -> dict:
        from miles.megatron.lora import merged

        return merged(local, self.lora.scaling)

    def offload_tensors(self) -> tuple[list, list]:
        buffers = [b for chunk in self.model for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]
        # parameters are views of their DDP buffer's param_data (frozen ones are not in a buffer)
        state = [b.param_data for b in buffers if b.param_data is not None]
        state += [
            p for chunks in (self.chunks, self.ref_chunks or []) for c in chunks for p in c.parameters()
        ]
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            held = opt.optimizer.state.values()
            state += [v for entry in held for v in entry.values() if torch.is_tensor(v) and v.dim()]
            # bf16 runs keep fp32 main parameters apart from the model's (fp32 runs: views of them)
            state += [p for group in getattr(opt, "shard_fp32_from_float16_groups", []) for p in group]
        return state, [b.grad_data for b in buffers]

    def _optimizer_resident(self):
        """--stream-optimizer-state-to-disk: the optimizer state in memory inside the block."""
        import contextlib

        stack = contextlib.ExitStack()
        for streamed in self.streamed:
            stack.enter_context(streamed.resident())
        return stack

    def save(self, directory: str, *, with_optimizer: bool) -> None:
        with self._optimizer_resident():
            self._save(directory, with_optimizer=with_optimizer)

    def _save(self, directory: str, *, with_optimizer: bool) -> None:
        self._gather_params()
        steps = self.steps_done if with_optimizer else None
        ckpt.save_training_state(
            self.chunks, self.optimizer, directory, steps_done=steps, layout=self.layout,
            optimizer_format=self.optimizer_format, adapters_only=self.lora is not None,
        )  # fmt: skip
        if self.lora:
            self._save_adapter(f"{directory}/{lora_adapters.ADAPTER_DIR}")

    def _save_adapter(self, directory: str) -> None:
        """The adapters as PEFT saves them, under the transformers class's module names (all ranks
        gather; rank 0 writes): each B cut into its HF parts as the weight is, each part with its
        layer's whole A."""
        from miles.megatron import lora

        family = megatron_family(self.config)
        exporter = WeightExporter(
            self.chunks,
            self.config,
            family.weights(self.config),
            rename=family.model_name if family.renames_on_load else None,
            adjust=lora.b_in_place_of_w,
        )
        parts = list(exporter)
        tensors = lora.peft_tensors(parts, lora.whole_a(self.chunks))
        if dist.get_rank() == 0:
            lora_adapters.save_adapter(
                directory,
                tensors,
                self.lora,
                self.hf_checkpoint,
                target_modules=lora.hf_targets(lora.targets(self.lora)),
            )

    def load(self, directory: str, *, with_optimizer: bool) -> None:
        try:
            with self._optimizer_resident():
                steps = ckpt.load_training_state(
                    self.chunks, self.optimizer, directory, with_optimizer=with_optimizer, layout=self.layout,
                    adapters_only=self.lora is not None,
                )  # fmt: skip
        except ckpt.CheckpointMismatch as exc:
            raise MegatronSetupError(str(exc)) from exc
        if steps is not None:
            self.steps_done = steps
        dist.barrier()

    def schedule(self) -> str:
        """The pipeline schedule megatron runs for this layout, and the model chunks per rank."""
        chunks = len(self.chunks)
        return f"{self.layout.describe()}: {mt.schedule_name()}, {chunks} model chunk{'s' if chunks > 1 else ''} per rank"

    # --- machinery ----------------------------------------------------------------------

    def _gather_params(self) -> None:
        """Before anything reads the weights outside a training forward: with overlapped parameter
        gathering they are stale after a step (megatron gathers them in the next training forward)."""
        if self.params_stale:
            mt.gather_params(self.model)
            self.params_stale = False

    def _run(self, parts: Sequence[TokenBatch], chunks, loss_fn, *, forward_only: bool) -> list[dict]:
        """The micro-batches through megatron's schedule, each in its own shape (pipeline stages
        tell each other the shapes: variable_seq_lengths); the last stage's loss outputs, on every rank."""
        cp = self.layout.cp
        # The interleaved (VPP) schedule takes micro-batches in multiples of the pipeline size;
        # extra ones are all padding and add nothing to any loss or result.
        parts = list(parts)
        if self.layout.interleaved:
            pp = self.layout.pp
            parts += [parts[-1].rows(slice(0, 0))] * (-len(parts) % pp)
        geometry = self.geometry
        shape = None
        if geometry.shared_shape:
            shape = (
                max(p.size for p in parts),
                geometry.padded_width(max(p.input_ids.shape[1] for p in parts)),
            )
        micro = micro_batches(
            parts, geometry.seq_multiple, self.device, cp, mt.context_parallel_rank(), shape
        )
        seq, rows = max(mb.tokens.shape[1] for mb in micro), max(mb.tokens.shape[0] for mb in micro)

        routing = self.routing if chunks is not self.ref_chunks else None

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if routing is not None:
                routing.set(mb)
            return model(mb.model_tokens, mb.model_position_ids, None), functools.partial(loss_fn, mb)

        try:
            results = mt.run_schedule(
                forward_step,
                chunks,
                micro,
                seq_length=seq,
                micro_batch_size=rows * self.pipeline_rows,
                forward_only=forward_only,
            )
        except BaseException:
            if routing is not None:
                routing.clear(check=False)
            raise
        if routing is not None:
            routing.clear()
        return results

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

    def _token_values(self, mb, output):
        """The critic's value [rows, width-1] at each position of the micro-batch's own rows."""
        values = gather_context_parallel(output[..., 0].float(), self.layout.cp)
        return values[: mb.batch.size, : mb.width - 1]

    def _value_output(self, mb, output):
        values = self._token_values(mb, output)
        return output.sum() * 0.0, {"logp": values.detach().cpu() * mb.batch.loss_mask}

    def _value_loss(self, mb, output, *, normalizer: float, count: int):
        values = self._token_values(mb, output)
        terms = value_batch_loss(values, mb.batch, self.value_clip, self.loss_cfg.per_token_loss)
        loss = terms.loss * count / normalizer  # as _policy_loss: megatron divides by the count
        logp = values.detach().cpu() * mb.batch.loss_mask
        return loss, {"terms": replace(terms, loss=terms.loss.detach().cpu()), "logp": logp}

    def _logprob_loss(self, mb, output):
        logp, _ = self._token_logprobs(mb, output, with_entropy=False)
        return output.sum() * 0.0, {"logp": logp.detach().float().cpu()}

    def _policy_loss(self, mb, output, *, normalizer: float, count: int):
        output, mtp_outputs = output if isinstance(output, tuple) else (output, None)
        logp, entropy = self._token_logprobs(mb, output, with_entropy=True)
        terms = batch_loss(logp, entropy, mb.batch, self.loss_cfg)
        # megatron's schedule divides each micro-batch's loss by their count (and multiplies it by
        # the context-parallel size, whose ranks' gradients DDP then averages with the data-
        # parallel ones); the trainer's normaliser (samples or tokens of this rank's minibatch)
        # is what it must be divided by.
        loss = terms.loss * count / normalizer
        if mtp_outputs is not None:
            mtp = self._mtp_loss(mb, mtp_outputs)
            # the MTP layers' mean token loss, averaged over micro-batches by the schedule's division
            loss = loss + self.mtp * mtp
            terms = replace(terms, mtp_loss=float(mtp.detach()) * terms.tokens)
        logp = logp.detach().float().cpu() * mb.batch.loss_mask
        return loss, {"terms": replace(terms, loss=terms.loss.detach().cpu()), "logp": logp}

    def _mtp_loss(self, mb, outputs) -> torch.Tensor:
        """The MTP layers' cross-entropy per response token they predict, averaged over the layers."""
        from miles.megatron.mtp import mtp_targets

        rows, width = mb.batch.size, mb.width - 1
        total = 0.0
        for depth, logits in enumerate(outputs):
            targets, mask = mtp_targets(mb.tokens, mb.batch.loss_mask, mb.width, depth)
            # this context-parallel rank's positions (megatron-core's MTP block rolls its inputs
            # across the chunks), then every token's, as the RL loss gathers them
            logp, _ = vocab_parallel_logprobs(
                logits, targets[:, mb.positions], 1.0, self.config["vocab_size"], with_entropy=False
            )
            logp = gather_context_parallel(logp, self.layout.cp)
            mask = mask.to(logp.device, logp.dtype)
            total = total - (logp[:rows, :width] * mask).sum() / mask.sum().clamp(min=1)
        return total / len(outputs)

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


def _mtp_training(
    megatron: MegatronConfig, model: ModelConfig, config: dict, layout: ParallelLayout, lora, path: str
):
    """--enable-mtp-training's loss scale, or None; what cannot train the MTP layers is refused."""
    from miles.ckpt.families import mtp_layers

    if megatron.mtp_only_training and not megatron.enable_mtp_training:
        raise MegatronSetupError("--mtp-only-training trains the MTP layers alone: add --enable-mtp-training")
    if not megatron.enable_mtp_training:
        return None
    count = mtp_layers(config)
    family = megatron_family(config)

    def refuse(why: str) -> None:
        raise MegatronSetupError(f"--enable-mtp-training: {why}")

    if not count:
        refuse(
            f"{path}/config.json declares no MTP layers (num_nextn_predict_layers); use a checkpoint with them"
        )
    gpt_block = family.mtp_style in ("layers", "mtp_layers", "mimo") and hasattr(family, "layer_weights")
    if not gpt_block and family.mtp_style != "mtp":
        refuse(
            f"the {family.name} family's MTP layers ({family.mtp_style} style) have no MTP forward here; miles "
            "trains the MTP layers that GPTModel families carry as megatron-core's MTP block (GLM's "
            "model.layers.{L+k}.*, Qwen3.5's mtp.*, MiMo's model.mtp_layers.*) and DeepSeek-V4's mtp.{k}.*"
        )
    if family.mtp_style == "mtp" and layout.pp > 1:
        refuse(
            f"with pipeline parallelism ({layout.pp}): DeepSeek-V4's MTP layers read the word embedding, which "
            "only the first stage holds, and its model sends no copy to the last; train them with "
            "--pipeline-model-parallel-size 1"
        )
    if model.mtp_num_layers not in (None, count):
        refuse(f"--mtp-num-layers {model.mtp_num_layers}, but {path}/config.json has {count} MTP layer(s)")
    if megatron.mtp_only_training and layout.pp > 1:
        refuse(
            f"--mtp-only-training with pipeline parallelism ({layout.pp}): the MTP layers sit on the last stage, so "
            "every other stage would train nothing, and megatron-core's distributed optimizer cannot save a stage "
            "without a trained parameter; train the MTP layers alone with --pipeline-model-parallel-size 1"
        )
    if lora.enabled:
        refuse(
            "with LoRA adapters: the MTP layers would train whole beside a frozen, adapted policy; drop one"
        )
    return float(megatron.mtp_loss_scaling_factor)


def _pipeline_rows(config: dict) -> int:
    """Rows a pipeline stage sends per micro-batch row (the family's streams; 1 for a GPTModel)."""
    return megatron_family(config).pipeline_rows(config)


def _shape_each_micro_batch(tc, layout: ParallelLayout) -> None:
    """Let each micro-batch keep its own shape (miles.train.micro_batches pads it to its own
    widest row): pipeline stages then send each other every activation's shape first
    (megatron-core's variable_seq_lengths). The all-gather token dispatcher cannot take that
    across expert-parallel ranks, whose micro-batches hold different rows."""
    tc.variable_seq_lengths = layout.pp > 1 and not (layout.interleaved and layout.pp == 2)
    if tc.num_moe_experts and layout.ep > 1 and tc.moe_token_dispatcher_type == "allgather":
        raise MegatronSetupError(
            f"--moe-token-dispatcher-type allgather gathers the tokens of the {layout.ep} expert-parallel ranks "
            "into one tensor, so their micro-batches would need one shape, but each rank pads its micro-batches "
            "to their own widest rows; use --moe-token-dispatcher-type alltoall"
        )


def _noisy_in_training(tc) -> bool:
    """Whether megatron's training forward draws random numbers (dropout, router input jitter,
    Sinkhorn routing), so it differs from the no-grad forward of the same rows."""
    balancing = tc.moe_router_load_balancing_type
    sinkhorn = "sinkhorn" in (balancing if isinstance(balancing, str) else " ".join(balancing or ()))
    return bool(tc.hidden_dropout or tc.attention_dropout or tc.moe_input_jitter_eps or sinkhorn)


def _weights_source(checkpoint: CheckpointConfig) -> str:
    """The torch_dist checkpoint the policy (and reference) start from (--megatron-to-hf-mode raw:
    the weights are the checkpoint's own; bridge would load them through Megatron-Bridge)."""
    if checkpoint.megatron_to_hf_mode == "bridge":
        raise MegatronSetupError(
            "--megatron-to-hf-mode bridge: Megatron-Bridge is not part of miles; convert the checkpoint to "
            "torch_dist (invoke prepare-ckpt) and leave the flag at raw"
        )
    ref_load = checkpoint.ref_load
    if ckpt.is_torch_dist_dir(ref_load):
        return ref_load
    given = f"--ref-load {ref_load} is not a torch_dist checkpoint" if ref_load else "no --ref-load"
    raise BackendUnavailable(
        f"--train-backend megatron loads its starting weights from a Megatron torch_dist checkpoint; {given}. "
        f"Convert {checkpoint.hf_checkpoint} with `invoke prepare-ckpt` (it writes <model>_torch_dist) and pass that "
        "directory as --ref-load"
    )


def _hf_fuses_experts(path: str) -> bool:
    """Whether the installed transformers class keeps a layer's experts as fused 3-D tensors (the
    decoder's class, for a multimodal release)."""
    from transformers import AutoModelForCausalLM

    from miles.families import transformers_config

    config = transformers_config(path).get_text_config()
    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(config).state_dict().keys()
    return any(name.endswith("mlp.experts.gate_up_proj") for name in names)


def check_model_flags(
    model: ModelConfig, config: dict, path: str, megatron: MegatronConfig | None = None
) -> None:
    """Every Megatron model flag the command sets agrees with config.json (through its family's
    facts table, `miles.families`, and the flags its architecture fixes), or one error lists every
    one that does not: the model is built from config.json, so a flag that says otherwise
    describes another model. A fixed flag may live in the megatron section (the router's bias
    update rate), so both sections are read."""
    from miles import families
    from miles.families.facts import disagreements, text_config
    from miles.parallel.layout import dest

    keys = families.keys_of(config)
    family = families.family_of(text_config(config))
    fixed = family.fixed if family else ()
    sections = (model,) if megatron is None else (model, megatron)
    given = {
        row.flag: next((getattr(s, dest(row.flag)) for s in sections if hasattr(s, dest(row.flag))), None)
        for row in (*keys, *fixed)
    }
    wrong = disagreements(keys, config, {f: v for f, v in given.items() if v not in (None, False)}, fixed)
    if wrong:
        raise MegatronSetupError(
            f"{path}/config.json describes another model than the Megatron flags: {'; '.join(wrong)}. The model "
            "is built from config.json; fix the recipe's model flags or point --hf-checkpoint at the right model"
        )


def _layer_spec(
    megatron: MegatronConfig, checkpoint: CheckpointConfig, model: ModelConfig, device: str
) -> tuple[str, str]:
    """The layer spec to build (and why), after every flag the backend refuses, or cannot act on
    with that spec on `device`, is refused in one line (miles.megatron.options)."""
    from miles.megatron.spec import SpecRefused, choose_impl

    try:
        impl, why = choose_impl(megatron.transformer_impl, device)
    except SpecRefused as exc:
        raise MegatronSetupError(str(exc)) from exc
    given = {**megatron.non_default(), **checkpoint.non_default(), **model.non_default()}
    problems = options.start_problems(given, impl, device)
    if problems:
        spec = (
            "Transformer Engine's layer spec"
            if impl == "transformer_engine"
            else f"the stand-in layer spec ({why})"
        )
        raise MegatronSetupError(
            f"--train-backend megatron cannot act on {len(problems)} flag(s) of this command with {spec} on "
            f"{device}: {'; '.join(problems)}. Remove them, or run where what they need is"
        )
    return impl, why


def check_built_model(model: ModelConfig, tc, vocab: int, path: str, position: str = "rope") -> None:
    """The model flags that name a TransformerConfig field agree with the model built from config.json."""
    wrong = options.model_disagreements(model, tc, vocab, position)
    if wrong:
        raise MegatronSetupError(
            f"{path}/config.json describes another model than the Megatron flags: {'; '.join(wrong)}. The model "
            "is built from config.json; fix the recipe's model flags or point --hf-checkpoint at the right model"
        )


def _transformer_config(
    megatron: MegatronConfig,
    config: dict,
    layout: ParallelLayout,
    path: str,
    *,
    dtype,
    on_cpu: bool,
    impl: str = "local",
    deterministic: bool = False,
):
    """The TransformerConfig of the run: the HF model's math, the layout, the fields the
    `megatron` section sets (miles.megatron.options.transformer_fields), and megatron-core's
    deterministic_mode under --deterministic-mode (its kernels choose deterministic paths)."""
    from miles.families import UnmappedModel
    from miles.families.transformer import transformer_config

    overrides = options.transformer_fields(megatron, impl)
    if deterministic:
        overrides["deterministic_mode"] = True
    if on_cpu:
        # gloo pairs point-to-point messages first-in first-out per pair of ranks. Batched p2p
        # posts a two-stage pipeline's activation and gradient to the same peer in an order the
        # peer does not mirror (the interleaved schedule swaps them); megatron's unbatched path
        # sends the two directions over two communicators.
        overrides["batch_p2p_comm"] = False
    try:
        return transformer_config(config, layout, dtype=dtype, on_cpu=on_cpu, initialize=True, **overrides)
    except UnmappedModel as exc:
        raise MegatronSetupError(f"{path}: {exc}") from exc
    except ValueError as exc:  # megatron-core's own refusal of a combination of fields
        raise MegatronSetupError(f"megatron-core refuses the flags' TransformerConfig: {exc}") from exc
