"""sglang's Engine with its scheduler in this process and no GPU: the SGLang adapter's test bed.

What runs is sglang 0.5.23's own code wherever it needs no GPU:
- `sglang.Engine`'s methods (update_weights_from_tensor with its per-rank payload handling,
  begin/end_weight_update, flush_cache, release/resume_memory_occupation, generate,
  shutdown), on a real Engine object;
- the tokenizer manager's control plane (`TokenizerControlMixin`: pause-aware locking,
  FanOutCommunicator, merge_results) and, borrowed from `TokenizerManager`, its
  auto_create_handle_loop (which installs the SIGQUIT handler), pause/continue_generation,
  request validation (`_validate_one_request`) and logprob layout (`detokenize_logprob_tokens`);
  `SamplingParams` normalize/verify; the finish reasons' `to_json`;
- the scheduler's weight and memory logic, `SchedulerWeightUpdaterManager` (the session,
  tagged release/resume), one per tensor-parallel rank, over the model runner's
  `WeightUpdater` (flattened-bucket reconstruction, the SafeUnpickler of
  `MultiprocessingSerializer`) and `TpModelWorker.deserialize_own_rank`;
- `SubprocessWatchdog`, which sends this process SIGQUIT when an engine process dies.

What stands in, because it needs a GPU or is a process boundary:
- the model: every tensor of the checkpoint as a parameter of the file's dtype and shape,
  loaded by name with sglang's `default_weight_loader`; its next-token logits are
  E[last token] @ E.T (E: the embedding), so pushed weights change what it generates;
- sampling: greedy (top_k <= 1, sglang's `is_all_greedy` in sampling_batch_info.py) is
  argmax with log_softmax of the untempered logits (sglang/srt/layers/sampler.py,
  Sampler.forward's is_all_greedy branch); otherwise a draw at the temperature with
  log_softmax(logits / T);
- the memory saver (torch-memory-saver pauses GPU memory by tag): it records each pause and
  resume;
- the zmq hops: requests reach the scheduler's handlers (the table of
  Scheduler.init_request_dispatcher) in this process, and answers come back through the
  tokenizer manager's handle loop on the next loop iteration, as they would from a socket.
Tensor-parallel ranks run one after the other in this process; each has its own model and
its barrier is a one-process gloo group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace


class SaverRecord:
    """torch-memory-saver's pause/resume by tag, recorded (no GPU memory to release here)."""

    def __init__(self, log: list):
        self.log = log

    def pause(self, tag):
        self.log.append(("pause", tag))

    def resume(self, tag):
        self.log.append(("resume", tag))


def _torch_dtype(name: str):
    import torch

    return {
        "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
        "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64,
    }[name]  # fmt: skip


class LocalModel:
    """The checkpoint's tensors as parameters, loaded by name as sglang's models do."""

    def __init__(self, checkpoint: Path):
        import torch

        from miles.ckpt.shards import CheckpointReader

        self.module = torch.nn.Module()
        with CheckpointReader(checkpoint) as reader:
            for name in reader.files.weight_map:
                tensor = reader.read(name)
                self.module.register_parameter(
                    name.replace(".", "__"), torch.nn.Parameter(tensor.clone(), requires_grad=False)
                )
        self.loaded: list[str] = []

    def params(self) -> dict:
        return {n.replace("__", "."): p for n, p in self.module.named_parameters()}

    # what sglang's WeightUpdater calls; a name the model has no parameter for is skipped, as
    # sglang's Qwen3ForCausalLM.load_weights does (models/qwen3.py: "Parameter ... not found")
    def load_weights(self, named_tensors):
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        params = self.params()
        for name, tensor in named_tensors:
            if name in params:
                default_weight_loader(params[name], tensor)
                self.loaded.append(name)

    def named_buffers(self):
        return self.module.named_buffers()

    def modules(self):
        return self.module.modules()

    def named_modules(self):
        return self.module.named_modules()

    def logits(self, last: int):
        embed = self.params()["model.embed_tokens.weight"].float()
        return embed[last] @ embed.T


class LocalScheduler:
    """The scheduler's request handlers for the engine's tensor-parallel ranks, in this process."""

    def __init__(self, checkpoint: Path, tp_size: int, log: list):
        import torch.distributed as dist
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.runtime_context import get_parallel

        self.log = log
        self.paused = False
        self.models, self.managers = [], []
        # only this process is in it: every TP rank's barrier completes at once
        group = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        for rank in range(tp_size):
            model = LocalModel(checkpoint)
            updater = WeightUpdater(
                tp_rank=rank, device="cpu", gpu_id=rank, model_config=None, custom_weight_loaders={},
                get_model=lambda m=model: m, update_model_fields=None, recapture_cuda_graph=None,
                get_model_runner=None,
            )  # fmt: skip
            worker = object.__new__(TpModelWorker)
            worker._model_runner = SimpleNamespace(weight_updater=updater, model=model)
            with get_parallel().override(tp_rank=rank, tp_group=SimpleNamespace(cpu_group=group)):
                manager = SchedulerWeightUpdaterManager(
                    tp_worker=worker, draft_worker=None, memory_saver_adapter=SaverRecord(log),
                    flush_cache=self.flush_cache, is_fully_idle=lambda ignore_waiting=False: True,
                    scheduler=self.scheduler_state(),
                )  # fmt: skip
            self.models.append(model)
            self.managers.append((rank, manager, group))

    @staticmethod
    def scheduler_state():
        """The Scheduler fields the weight manager reads: a plain (not disaggregated) engine."""
        from sglang.srt.disaggregation.utils import DisaggregationMode

        return SimpleNamespace(
            _engine_paused=False, disaggregation_mode=DisaggregationMode.NULL,
            record_weight_version_change=lambda **_: None,
        )  # fmt: skip

    def flush_cache(self, empty_cache: bool = True) -> bool:
        self.log.append(("flush_cache",))
        return True  # requests finish before Engine.generate returns: the scheduler is idle

    def handle(self, req):
        """One request on every rank (Scheduler.init_request_dispatcher's table); rank 0 answers."""
        from sglang.srt.managers import io_struct as io
        from sglang.srt.runtime_context import get_parallel

        kind = type(req).__name__
        self.log.append((kind,))
        if isinstance(req, io.FlushCacheReqInput):
            return io.FlushCacheReqOutput(success=self.flush_cache())
        if isinstance(req, io.PauseGenerationReqInput):
            assert req.mode in ("in_place", "retract")  # Scheduler.pause_generation's rule
            self.paused = True
            return None
        if isinstance(req, io.ContinueGenerationReqInput):
            self.paused = False
            return None
        handler = {
            io.BeginWeightUpdateReqInput: "begin_weight_update",
            io.EndWeightUpdateReqInput: "end_weight_update",
            io.UpdateWeightsFromTensorReqInput: "update_weights_from_tensor",
            io.ReleaseMemoryOccupationReqInput: "release_memory_occupation",
            io.ResumeMemoryOccupationReqInput: "resume_memory_occupation",
        }[type(req)]
        answers = []
        with engine_process_patches():
            for rank, manager, group in self.managers:
                with get_parallel().override(tp_rank=rank, tp_group=SimpleNamespace(cpu_group=group)):
                    answers.append(getattr(manager, handler)(req))
        return answers[0]


@contextlib.contextmanager
def engine_process_patches():
    """The engine's processes patch torch's tensor reductions for CUDA IPC (sglang's
    monkey_patch_torch_reductions, patch_torch.py); here they share the trainer's process, so
    what the engine patched is undone when its request is done."""
    from torch.multiprocessing import reductions

    saved = reductions.reduce_tensor, reductions.rebuild_cuda_tensor
    try:
        yield
    finally:
        if hasattr(reductions, "_reduce_tensor_original"):
            reductions.reduce_tensor, reductions.rebuild_cuda_tensor = saved
            del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
            reductions.init_reductions()


def local_tokenizer_manager_class():
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    borrowed = {
        name: TokenizerManager.__dict__[name]
        for name in (
            "auto_create_handle_loop", "pause_generation", "continue_generation", "_validate_one_request",
            "_validate_joint_schema_request", "_validate_token_ids_logprob", "detokenize_logprob_tokens",
        )
    }  # fmt: skip
    return type("LocalTokenizerManager", (TokenizerControlMixin, _LocalTokenizer), borrowed)


class _LocalTokenizer:
    """The tokenizer manager's state the borrowed methods read, and its two socket ends."""

    def setup(self, scheduler: LocalScheduler, context_len: int, vocab_size: int, seed: int):
        from sglang.srt.managers.tokenizer_manager import SignalHandler
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.utils.aio_rwlock import RWLock
        from sglang.utils import TypeBasedDispatcher

        self.scheduler = scheduler
        self.context_len, self.num_reserved_tokens, self.vocab_size = context_len, 0, vocab_size
        self.allow_auto_truncate, self.validate_total_tokens = False, True
        self.model_config = SimpleNamespace(joint_head_config=None, pointer_head=None, vocab_size=vocab_size)
        self.sampling_params_class = SamplingParams
        self.is_pause, self.is_pause_cond = False, asyncio.Condition()
        self.model_update_lock = RWLock()
        self.mm_processor, self.event_loop, self.asyncio_tasks = None, None, set()
        self.signal_handler_class, self._subprocess_watchdog = SignalHandler, None
        self.gracefully_exit = False
        self.scheduler_alive = lambda: True
        self._answers: asyncio.Queue = asyncio.Queue()  # the detokenizer's socket
        self._result_dispatcher = TypeBasedDispatcher([])
        self.init_communicators()
        self.seed = seed

    def _dispatch_to_scheduler(self, obj) -> None:
        answer = self.scheduler.handle(obj)
        if answer is not None:
            self._answers.put_nowait(answer)

    async def _async_dispatch_to_scheduler(self, obj) -> None:
        self._dispatch_to_scheduler(obj)

    async def handle_loop(self):
        while True:
            self._result_dispatcher(await self._answers.get())

    async def sigterm_watchdog(self):
        return None

    def dump_requests_before_crash(self):
        """sglang's SignalHandler writes the in-flight requests to a file first; none are kept here."""

    async def generate_request(self, obj, request=None):
        import torch
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN

        self.auto_create_handle_loop()
        obj.normalize_batch_and_arguments()
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock:
            requests = []
            for i in range(obj.batch_size):
                one = obj[i]
                ids = list(one.input_ids)
                self._validate_one_request(one, ids)
                params = self.sampling_params_class(**dict(one.sampling_params))
                params.normalize(None)
                params.verify(self.model_config.vocab_size)
                requests.append((ids, params))
            while not self.scheduler_alive():  # a dead scheduler never answers
                await asyncio.sleep(0.05)
            model = self.scheduler.models[0]
            out = []
            for i, (ids, params) in enumerate(requests):
                generator = torch.Generator().manual_seed(
                    params.sampling_seed if params.sampling_seed is not None else self.seed + i
                )
                tokens, logprobs, finish, last = [], [], None, ids[-1]
                for _ in range(params.max_new_tokens):
                    logits = model.logits(last)
                    if params.top_k <= 1:
                        token = int(logits.argmax())
                        logp = torch.log_softmax(logits, -1)
                    else:
                        logp = torch.log_softmax(logits / params.temperature, -1)
                        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                    tokens.append(token)
                    logprobs.append(float(logp[token]))
                    last = token
                    if token in (params.stop_token_ids or ()):
                        finish = FINISH_MATCHED_TOKEN(matched=token)
                        break
                finish = finish or FINISH_LENGTH(length=len(tokens))
                meta = {
                    "id": f"req-{i}", "finish_reason": finish.to_json(), "prompt_tokens": len(ids),
                    "completion_tokens": len(tokens),
                    "output_token_logprobs": self.detokenize_logprob_tokens(logprobs, tokens, False),
                }  # fmt: skip
                out.append({"text": "", "output_ids": tokens, "meta_info": meta})
        yield out


class LocalEngine:
    """Builds a real `sglang.Engine` object over LocalScheduler, with the adapter's keyword arguments."""

    log: list = []
    last = None

    def __new__(cls, **kwargs):
        import msgspec
        from sglang.srt.entrypoints.engine import Engine, SchedulerInitResult
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs(**kwargs)  # what the adapter asks for must be a valid ServerArgs
        checkpoint = Path(server_args.model_path)
        config = json.loads((checkpoint / "config.json").read_text())
        publish_for(ServerArgs, str(checkpoint), server_args.tp_size)
        engine = object.__new__(Engine)
        engine.server_args = msgspec.structs.replace(server_args)
        engine.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(engine.loop)
        tm = local_tokenizer_manager_class()()
        tm.setup(
            LocalScheduler(checkpoint, server_args.tp_size, cls.log),
            context_len=config.get("max_position_embeddings", 4096),
            vocab_size=config["vocab_size"],
            seed=server_args.random_seed,
        )
        engine.tokenizer_manager = tm
        engine._scheduler_init_result = SchedulerInitResult(scheduler_infos=[])
        engine._weight_cache_daemon_procs = []
        cls.last = engine
        return engine


def publish_for(server_args_cls, model_path: str, tp_size: int) -> None:
    """sglang's process-wide configuration, as the engine's processes publish it (device cpu)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import publish

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    publish(server_args_cls(model_path=model_path, device="cpu", tp_size=tp_size), role="scheduler")
