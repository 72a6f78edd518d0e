"""SGLang as the rollout engine, behind the same interface as the built-in torch engine.

GPU machines only; written against sglang 0.5.23 (the lanes' pin), whose own code the CPU
tests run wherever it can run without a GPU. Engines are colocated with training: an engine
of `--rollout-num-gpus-per-engine` N GPUs serves the N training ranks on those GPUs (its
group), engines never overlap, and the first rank of a group starts the engine and talks to
it; the others hand it their prompts and weights over the group's gloo group
(miles.train.sglang_weights), so they wait without an NCCL watchdog.

Memory: with --colocate (or --offload-rollout), while the trainer steps, the engine releases
its weights, KV cache and CUDA graphs (SGLang's memory saver, torch-memory-saver); without, it
keeps them. A weight push empties the trainer's allocator
cache, resumes the engine's weights only, pushes (see sglang_weights), empties the cache of
what the push left behind, and only then resumes the KV cache and CUDA graphs, as the seed
framework does (radixark/miles train.py at 31f1ca961a94cb860cec3b2dea34ec332bfa8f76:
onload_weights, update_weights, onload_kv). An engine started from an FP8 checkpoint gets
FP8 weights (miles.train.fp8_export).

Failures end in one line: a request SGLang refuses (a prompt over the context length), an
unfinished request, a refused weight update, and a scheduler or detokenizer process that
died. SGLang's own reaction to a dead child is to SIGKILL this whole process tree; the
engine here replaces it (the launch-phase `custom_sigquit_handler` and the tokenizer
manager's `signal_handler_class`) so the engine call in progress fails instead.

Seeds: SGLang honours a request's `sampling_seed` only under
`--sglang-enable-deterministic-inference`; without it sampling is not reproducible and the
seed is not sent (the run says so at start). `random_seed` seeds the server's own RNG.
`--sglang-<name> VALUE` flags become the engine's server arguments, converted to the types
SGLang declares. sglang is imported only when this engine is built.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from miles.train.config import CheckpointConfig, JobConfig, RolloutConfig, SamplingConfig, SGLangConfig
from miles.train.rollout import Generation, RolloutEngine, RolloutEngineError
from miles.train.sglang_server import (
    CHILD_FAILED,
    SGLangUnavailable,
    engine_slot,
    require_memory_saver,
    seeds_honoured,
    server_fields,
    server_kwargs,
)
from miles.train.sglang_weights import FLATTENED, buckets, checked, engine_groups, serialize_bucket

# sglang.srt.constants GPU_MEMORY_TYPE_*: what release/resume_memory_occupation take as tags
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)


# A finish reason other than these means SGLang did not complete the request (an abort:
# prompt over the context length, out of memory, a request cancelled by a weight update).
NORMAL_FINISH = {"stop": "stop", "length": "length"}


def sampling_params(sampling: SamplingConfig, seed: int | None) -> dict:
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_response_len,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the trainer learns to emit it
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def routed_experts(meta: Mapping[str, Any], rows: int, layers: int):
    """meta_info["routed_experts"] as int32 [rows, layers, top-k]: base64 of the int32 buffer sglang
    0.5.23 returns with return_routed_experts (tokenizer_manager: pybase64 of the scheduler's
    [seqlen - 1, num_hidden_layers, top-k] tensor, state_capturer/routed_experts.py)."""
    import base64

    import numpy as np
    import torch

    encoded = meta.get("routed_experts")
    if encoded is None:
        raise RolloutEngineError(
            "SGLang returned no routed experts although they were asked for (--use-rollout-routing-replay); "
            "its server needs --enable-return-routed-experts, which the engine sets"
        )
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if rows <= 0 or flat.size % (rows * layers):
        raise RolloutEngineError(
            f"SGLang returned {flat.size} routed-expert ids for {rows} tokens x {layers} layers: not a whole top-k"
        )
    return torch.from_numpy(flat.copy()).view(rows, layers, flat.size // (rows * layers))


def to_generation(prompt: Sequence[int], out: Mapping[str, Any], routed_layers: int = 0) -> Generation:
    """One SGLang output dict as a Generation; an aborted request is an error, not a stop. With
    `routed_layers` (the model's decoder layers) it carries the routed experts."""
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind not in NORMAL_FINISH:
        raise RolloutEngineError(
            f"SGLang did not finish a request ({kind}: {finish.get('message', '') if isinstance(finish, Mapping) else ''}) "
            f"for a prompt of {len(prompt)} tokens; an unfinished sample cannot be trained on (check the prompt "
            "length against the model's context and --sglang-mem-fraction-static)"
        )
    entries = meta["output_token_logprobs"]  # (logprob, token id, text or None) per generated token
    tops = meta.get("output_top_logprobs")  # with top_logprobs_num: per token, its top (logprob, id, text)
    response = tuple(int(e[1]) for e in entries)
    rows = len(prompt) + len(response) - 1
    return Generation(
        prompt_ids=tuple(prompt),
        response_ids=response,
        logprobs=tuple(float(e[0]) for e in entries),
        finish_reason=NORMAL_FINISH[kind],
        top_logprobs=None
        if tops is None
        else tuple(tuple((float(e[0]), int(e[1])) for e in t or ()) for t in tops),
        routed_experts=routed_experts(meta, rows, routed_layers) if routed_layers else None,
    )


class SGLangRolloutEngine(RolloutEngine):
    name = "sglang"
    exact_weights = False  # SGLang's Qwen3 has no get_weights_by_name: the weight check uses logprobs
    weight_names = "checkpoint"  # its models' load_weights read checkpoint names
    # It acts on the model it serves, its server's seed, every SGLang option, and whether it
    # gives its memory back while the trainer steps (see __init__): by=sglang in miles.train.config.

    def __init__(
        self,
        *,
        sglang: SGLangConfig,
        checkpoint: CheckpointConfig,
        rollout: RolloutConfig,
        job: JobConfig,
        dist_info,
        engine_cls=None,
        server_args_cls=None,
    ):
        """`engine_cls` and `server_args_cls` default to sglang's Engine and ServerArgs."""
        from miles.train.fp8_export import Fp8ExportError, fp8_export_for

        if dist_info.device == "cpu":
            raise SGLangUnavailable("--rollout-engine sglang needs a GPU; on CPU use --rollout-engine torch")
        if engine_cls is None or server_args_cls is None:
            engine_cls, server_args_cls = _import_sglang(engine_cls, server_args_cls)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist_info.world_size))
        self.kwargs = server_kwargs(
            sglang,
            dist_info,
            server_args_cls,
            model_path=checkpoint.hf_checkpoint,
            seed=rollout.rollout_seed,
            local_world_size=local_world,
        )
        # --use-rollout-routing-replay: the server captures each token's experts (a ServerArgs field of
        # the pinned sglang, checked like every server argument) and each request asks for them
        self.routed_layers = 0
        if rollout.use_rollout_routing_replay:
            from miles.families import read_config

            if "enable_return_routed_experts" not in server_fields(server_args_cls):
                raise SGLangUnavailable(
                    "--use-rollout-routing-replay: this SGLang has no server argument enable_return_routed_experts; "
                    "install the lane's pinned sglang"
                )
            self.kwargs["enable_return_routed_experts"] = True
            self.routed_layers = int(read_config(checkpoint.hf_checkpoint)["num_hidden_layers"])
        gpus = sglang.rollout_num_gpus_per_engine
        self.slot = engine_slot(dist_info.rank, dist_info.local_rank, local_world, gpus)
        self.rank = dist_info.rank
        self.seeded = seeds_honoured(self.kwargs)
        self.bucket_bytes = sglang.update_weight_buffer_size or 512 << 20
        try:
            self.fp8 = fp8_export_for(checkpoint.hf_checkpoint)
        except Fp8ExportError as exc:
            raise SGLangUnavailable(f"--hf-checkpoint: {exc}") from None
        # FP8 checkpoints: miles quantizes the trainer's tensors as they are (miles.train.fp8_export)
        self._weight_dtype = (
            None if self.fp8 is not None else served_dtype(checkpoint.hf_checkpoint, self.kwargs)
        )
        self.released: set[str] = set()
        # It always runs on the training GPUs (miles has no separate rollout placement). With
        # --colocate, which turns --offload-rollout on as upstream's does, or --offload-rollout,
        # it frees its weights and KV cache while the trainer steps; without, it keeps them.
        # --offload is --offload-train (the training backend's) and --offload-rollout.
        self.colocated = job.colocate or job.offload_rollout or job.offload
        self.group = engine_groups(dist_info.world_size, gpus, self.rank)
        self.engine = self._start(engine_cls) if self.slot.leader else None

    def _start(self, engine_cls):
        try:
            engine = engine_cls(**self.kwargs)
        except Exception as exc:  # sglang raises RuntimeError/ValueError/ImportError from its launch
            raise SGLangUnavailable(
                f"the SGLang engine for {self.kwargs['model_path']} did not start: {type(exc).__name__}: "
                f"{_first_line(exc)} (its log above has the details)"
            ) from None
        _watch_children(engine)
        return engine

    @property
    def weight_dtype(self):
        return self._weight_dtype

    # --- generation ---

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """The group's prompts go to its leader's engine; every rank gets its own answers back."""

        def serve(asked: list) -> list:
            flat = self._generate_here([p for part in asked for p in part], sampling, seed)
            out, start = [], 0
            for part in asked:
                out.append(flat[start : start + len(part)])
                start += len(part)
            return out

        answers = self.group.exchange([list(p) for p in prompts], serve)
        return answers[self.group.ranks.index(self.rank)]

    def _generate_here(self, prompts, sampling: SamplingConfig, seed: int) -> list[Generation]:
        if not prompts:
            return []
        self.resume_memory()
        params = sampling_params(sampling, seed if self.seeded else None)
        try:
            outputs = self._call(
                "generate",
                self.engine.generate,
                input_ids=[list(p) for p in prompts],
                sampling_params=params,
                return_logprob=True,
                **({"top_logprobs_num": sampling.top_logprobs} if sampling.top_logprobs else {}),
                **({"return_routed_experts": True} if self.routed_layers else {}),
            )
        except ValueError as exc:  # sglang's TokenizerManager._validate_one_request and SamplingParams.verify
            lengths = sorted(len(p) for p in prompts)
            raise RolloutEngineError(
                f"SGLang refused the rollout requests: {_first_line(exc)} (prompts of {lengths[0]}-{lengths[-1]} "
                f"tokens, --rollout-max-response-len {sampling.max_response_len}); shorten the prompts "
                "(--rollout-max-prompt-len) or the responses, or raise --sglang-context-length"
            ) from None
        return [to_generation(p, out, self.routed_layers) for p, out in zip(prompts, outputs, strict=True)]

    # --- weights ---

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Push the weights in buckets of --update-weight-buffer-size bytes (default 512 MiB), inside
        one weight-update session. Every rank drains the iterator, engine or not: producing it may
        run collectives, and every rank of the group sends the engine its own copy."""
        stream = self.fp8(named_tensors) if self.fp8 is not None else named_tensors
        clear_memory()  # the trainer's cached blocks go back before the engine's weights return
        self._resume({WEIGHTS})
        self.group.exchange(None, lambda _: self._open_session())
        for bucket in buckets(stream, self.bucket_bytes):
            payload, keep = serialize_bucket(bucket)
            self.group.exchange(payload, self._load)
            del keep  # the engine has loaded it on every rank
        self.group.exchange(None, lambda _: self._close_session())
        clear_memory()  # what the push left behind (gathered tensors, buckets) before the KV cache returns
        self._resume({KV_CACHE, CUDA_GRAPH})

    def _open_session(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        tm = self.engine.tokenizer_manager
        pause = tm.pause_generation(PauseGenerationReqInput(mode="retract"))
        self._call("pause_generation", self.engine.loop.run_until_complete, pause)
        checked(
            "to flush its cache before the weight update", self._call("flush_cache", self.engine.flush_cache)
        )
        checked(
            "to open a weight-update session",
            self._call("begin_weight_update", self.engine.begin_weight_update),
        )

    def _load(self, payloads: list[bytes]) -> None:
        result = self._call(
            "update_weights_from_tensor",
            self.engine.update_weights_from_tensor,
            named_tensors=payloads,
            load_format=FLATTENED,
            flush_cache=False,  # flushed before the session; nothing runs while it is open
        )
        checked("the weight update", result)

    def _close_session(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        checked(
            "to close the weight-update session",
            self._call("end_weight_update", self.engine.end_weight_update),
        )
        tm = self.engine.tokenizer_manager
        resume = tm.continue_generation(ContinueGenerationReqInput())
        self._call("continue_generation", self.engine.loop.run_until_complete, resume)

    # --- memory ---

    def release_memory(self) -> None:
        """Free the engine's GPU memory (weights, KV cache, CUDA graphs) while the trainer steps."""
        held = [t for t in MEMORY_TAGS if t not in self.released]
        if self.engine is not None and held:
            self._call("release_memory_occupation", self.engine.release_memory_occupation, tags=held)
            self.released.update(held)

    def resume_memory(self) -> None:
        """Take back everything released (before sampling)."""
        self._resume(set(MEMORY_TAGS))

    def _resume(self, tags: set[str]) -> None:
        wanted = [t for t in MEMORY_TAGS if t in tags and t in self.released]
        if self.engine is not None and wanted:
            self._call("resume_memory_occupation", self.engine.resume_memory_occupation, tags=wanted)
            self.released.difference_update(wanted)

    # --- the engine's processes ---

    def _call(self, what: str, fn, *args, **kwargs):
        """One engine call; a dead engine process turns into one line naming it."""
        if CHILD_FAILED.is_set():
            raise self._died(what)
        try:
            return fn(*args, **kwargs)
        except RuntimeError:
            if CHILD_FAILED.is_set():
                raise self._died(what) from None
            raise

    def _died(self, what: str) -> RolloutEngineError:
        dead = _dead_children(self.engine)
        self.close()
        return RolloutEngineError(
            f"the SGLang engine lost {dead or 'a scheduler or detokenizer process'} during {what}; that "
            "process's error is in the log above; the engine's other processes were stopped"
        )

    def named_weights(self) -> Iterator[tuple[str, object]]:
        raise NotImplementedError(
            "SGLang's model classes (Qwen3 among them) have no get_weights_by_name; "
            "the weight check compares logprobs of fixed sequences instead"
        )

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()


def served_dtype(model_path: str, kwargs: Mapping[str, Any]):
    """The dtype SGLang serves `model_path` in with these server arguments, as sglang 0.5.23
    decides it (srt/configs/model_config.py, _get_and_verify_dtype): `dtype` "auto" takes
    config.json's (`dtype`, else `torch_dtype`; float32 when absent), except that a float32
    model is served in float16 (bfloat16 for Gemma); any other value names the dtype."""
    import json
    from pathlib import Path

    import torch

    names = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float": torch.float32, "float32": torch.float32}  # fmt: skip
    dtype = str(kwargs.get("dtype", "auto")).lower()
    if dtype != "auto":
        if dtype not in names:
            raise SGLangUnavailable(
                f"--sglang-dtype {dtype}: SGLang knows auto, {', '.join(names)}; pass one of them"
            )
        return names[dtype]
    config = json.loads((Path(model_path) / "config.json").read_text())
    config_dtype = names.get(
        str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32
    )
    if config_dtype == torch.float32:
        return torch.bfloat16 if str(config.get("model_type", "")).startswith("gemma") else torch.float16
    return config_dtype


def _import_sglang(engine_cls, server_args_cls):
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise SGLangUnavailable(
            f"--rollout-engine sglang: cannot import sglang ({exc}); install the lane's pinned stack "
            "(requirements/<lane>.txt) or use --rollout-engine torch"
        ) from exc
    require_memory_saver()
    return engine_cls or sglang.Engine, server_args_cls or ServerArgs


def _watch_children(engine) -> None:
    """Replace the tokenizer manager's SIGQUIT reaction (sglang's SignalHandler kills this process
    tree) with one that ends the engine call in progress; auto_create_handle_loop instantiates it."""
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    class ChildWatch(SignalHandler):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            import asyncio

            CHILD_FAILED.set()
            asyncio.get_running_loop().stop()  # run_until_complete raises in the call in progress

    engine.tokenizer_manager.signal_handler_class = ChildWatch


def _dead_children(engine) -> str:
    """'<name> (pid P, exit code C)' of the engine processes that are gone, from sglang's watchdog."""
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    procs = getattr(watchdog, "_processes", None) or []
    names = getattr(watchdog, "_names", None) or [f"process {i}" for i in range(len(procs))]
    dead = [
        f"{n} (pid {p.pid}, exit code {p.exitcode})"
        for p, n in zip(procs, names, strict=False)
        if not p.is_alive()
    ]
    return ", ".join(dead)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def clear_memory() -> None:
    """Give the allocator's cached blocks back to the GPU (the engine shares it with this process)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
