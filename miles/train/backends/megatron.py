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
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from miles.megatron import training as mm
from miles.megatron.export import WeightExporter
from miles.megatron.loss import gather_context_parallel, micro_batches, vocab_parallel_logprobs
from miles.train.args import loss_config, optim_config
from miles.train.backends import BackendUnavailable, StepResult, TrainBackend, batch_loss
from miles.train.batch import TokenBatch

# The distributed optimizer's shards as they are: a run resumes at the same model-parallel
# layout with any number of data-parallel replicas (weights alone load at any layout).
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


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
        self.config = mm.hf_config(args.hf_checkpoint)
        mm.check_model_flags(args, self.config, args.hf_checkpoint)
        self.source = _weights_source(args)
        self.layout = args.layout  # parsed and checked with the flags (miles.train.args)
        mm.init_parallel_state(self.layout, args.seed)
        self.tc = mm.transformer_config_for(args, self.config, self.layout, on_cpu=self.on_cpu)
        # The reference model gets a config of its own: the policy's gains DDP hooks below.
        ref_tc = copy.copy(self.tc)
        self.vocab = _checkpoint_vocab(self.source, self.config)
        chunks = mm.build_chunks(self.config, self.tc, self.vocab)
        mm.load_weights(chunks, self.source)
        mm.freeze_padding_embedding(chunks, self.config.get("pad_token_id"))
        self.chunks = [c.to(self.device) for c in chunks]
        self.model = mm.wrap_ddp(self.chunks, self.tc)
        self.optimizer = mm.build_optimizer(self.model, self.optim_cfg, self.tc)
        self._connect_schedule(self.tc, self.model)
        if dist_info.is_main:
            print(f"miles.train: megatron {self.schedule()}", flush=True)
        self.ref_chunks = None
        self.ref_source = self.source
        if args.use_kl_loss:
            ref = mm.build_chunks(self.config, ref_tc, self.vocab)
            mm.load_weights(ref, self.source)
            self.ref_chunks = [c.to(self.device).eval().requires_grad_(False) for c in ref]
        self.fused_experts = _hf_fuses_experts(args.hf_checkpoint)
        steps_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
        self.total_steps = args.num_rollout * steps_per_rollout
        self.steps_done = 0

    # --- the trainer's interface -------------------------------------------------------

    @property
    def data_parallel(self) -> tuple[int, int, object]:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

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
        applied, grad_norm = guarded_step(self.optimizer, self.optim_cfg.clip_grad, loss)
        if applied:
            self.steps_done += 1
        return StepResult(grad_norm=float(grad_norm), lr=lr, terms=terms, skipped=not applied)

    def full_weights(self, names: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
        fused = self.fused_experts and names == "model"
        yield from WeightExporter(self.chunks, self.config, fused_experts=fused)

    def save(self, directory: str, *, with_optimizer: bool) -> None:
        from megatron.core import dist_checkpointing

        state = mm.model_state_template(self.chunks)
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                state, is_loading=False, metadata=OPTIMIZER_FORMAT
            )
            state["schedule"] = {"steps_done": self.steps_done}  # plain values: kept once, in common.pt
        dist_checkpointing.save(state, directory)

    def load(self, directory: str, *, with_optimizer: bool) -> None:
        from megatron.core import dist_checkpointing

        state = mm.model_state_template(self.chunks)
        if with_optimizer:
            _materialize_adam_state(self.optimizer)
            state["optimizer"] = self.optimizer.sharded_state_dict(
                state, is_loading=True, metadata=OPTIMIZER_FORMAT
            )
            state["schedule"] = {"steps_done": 0}
        loaded = dist_checkpointing.load(state, directory)
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        if with_optimizer:
            with torch.no_grad():  # fp32 main parameters are views of the model's own
                self.optimizer.load_state_dict(loaded["optimizer"])
            self.steps_done = int(loaded["schedule"]["steps_done"])
            _set_adam_steps(self.optimizer, self.steps_done)
        dist.barrier()

    def schedule(self) -> str:
        """The pipeline schedule megatron runs for this layout, and the model chunks per rank."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = len(self.chunks)
        return (
            f"{self.layout.describe()}: {get_forward_backward_func().__name__}, "
            f"{chunks} model chunk{'s' if chunks > 1 else ''} per rank"
        )

    # --- machinery ----------------------------------------------------------------------

    def _connect_schedule(self, tc, wrapped) -> None:
        """What megatron's schedule calls around the micro-batches: no gradient sync until the
        last one, then the DP/SP/embedding gradient reductions."""
        from megatron.core.distributed import finalize_model_grads

        no_sync = [m.no_sync for m in wrapped]
        tc.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        tc.finalize_model_grads_func = finalize_model_grads
        tc.grad_scale_func = None

    def _run(self, parts: Sequence[TokenBatch], chunks, loss_fn, *, forward_only: bool) -> list[dict]:
        """The micro-batches through megatron's schedule; the last stage's loss outputs, on every rank."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

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
        micro, seq = micro_batches(parts, rows, seq_multiple, self.device, cp, ps.get_context_parallel_rank())

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return model(mb.model_tokens, mb.model_position_ids, None), functools.partial(loss_fn, mb)

        iterators = [iter(micro) for _ in chunks]
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=list(chunks),
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
        if ps.get_pipeline_model_parallel_world_size() > 1:
            box = [results if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
            last = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
            dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
            results = box[0]
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
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr


def guarded_step(optimizer, clip_grad: float, loss: float) -> tuple[bool, float]:
    """megatron's optimizer step, except that a non-finite loss or gradient norm on any rank
    applies nothing (miles.train.guards); returns whether it was applied, and the norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from miles.train.guards import all_finite_on_every_rank

    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm() or 0.0)
    if found_inf or not all_finite_on_every_rank(loss, grad_norm):
        return False, grad_norm
    if clip_grad > 0:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=grad_norm)
    return bool(optimizer.step_with_ready_grads()), grad_norm


def _materialize_adam_state(optimizer) -> None:
    """Give every parameter the AdamW state torch creates lazily at the first step (zeros, step 0).

    Without Apex or Transformer Engine, megatron's distributed optimizer describes its state
    from torch's AdamW, which has none before a step; a fresh optimizer about to load a
    checkpoint needs the tensors to load into.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _set_adam_steps(optimizer, steps: int) -> None:
    """AdamW's per-parameter step count (its bias correction) after a load.

    megatron-core 0.16.1 restores it for torch's AdamW from its common state as one tensor
    shared by every parameter, which each parameter's update then increments again; every
    parameter gets a count of its own, the number of steps applied before the checkpoint.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(steps))


def _weights_source(args) -> str:
    """The torch_dist checkpoint the policy (and reference) start from."""
    if mm.is_torch_dist_dir(args.ref_load):
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


def _checkpoint_vocab(source: str, config: dict) -> int:
    """Rows of the checkpoint's embedding: the HF vocabulary, padded if the converter padded it."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(mm.torch_dist_release(source)))
    embedding = meta.get("embedding.word_embeddings.weight")
    return int(embedding.global_shape[0]) if embedding is not None else int(config["vocab_size"])
