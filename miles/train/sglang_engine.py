"""SGLang as the rollout engine, behind the same interface as the built-in torch engine.

GPU machines only: each training rank starts one offline `sglang.Engine` on its own GPU
(sharing it with training, so `--sglang-mem-fraction-static` should leave room for the
trainer), generates from token ids with logprobs, and receives the trainer's weights in
place through `update_weights_from_tensor` after every step. `--sglang-<name> VALUE` flags
become the engine's server arguments, converted to the types SGLang declares for them.
sglang is imported only when this engine is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from miles.train.args import SamplingConfig
from miles.train.rollout import Generation, RolloutEngine


class SGLangUnavailable(RuntimeError):
    """sglang is not installed or cannot run here; the message says what to use instead."""


def server_kwargs(args, dist_info, server_args_cls) -> dict:
    """Engine keyword arguments: the model, this rank's GPU, and the --sglang-* pass-through."""
    kwargs = {
        "model_path": args.hf_checkpoint,
        "tp_size": args.rollout_num_gpus_per_engine,
        "random_seed": args.rollout_seed + dist_info.rank,
        "log_level": "error",
    }
    if args.sglang_mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = args.sglang_mem_fraction_static
    if dist_info.device.startswith("cuda:"):
        kwargs["base_gpu_id"] = int(dist_info.device.split(":")[1])
    known = {f.name: f for f in dataclasses.fields(server_args_cls)}
    for name, value in args.sglang_args.items():
        field = known.get(name)
        if field is None:
            raise SGLangUnavailable(
                f"--sglang-{name.replace('_', '-')}: this SGLang has no server argument '{name}'"
            )
        kwargs[name] = _convert(value, field.default)
    return kwargs


def _convert(value, default):
    """A CLI string to the type of the field's default; switches stay True, lists convert each item."""
    if isinstance(value, list):
        inner = default[0] if isinstance(default, list) and default else None
        return [_convert(v, inner) for v in value]
    if not isinstance(value, str):
        return value
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, (int, float, str)):
        return type(default)(value)
    for kind in (int, float):  # no default to go by: numbers where they read as numbers
        try:
            return kind(value)
        except ValueError:
            pass
    return value


class SGLangRolloutEngine(RolloutEngine):
    def __init__(self, args, dist_info):
        if dist_info.device == "cpu":
            raise SGLangUnavailable("--rollout-engine sglang needs a GPU; on CPU use --rollout-engine torch")
        try:
            import sglang
            from sglang.srt.server_args import ServerArgs
        except ImportError as exc:
            raise SGLangUnavailable(
                f"--rollout-engine sglang: cannot import sglang ({exc}); install the lane's pinned stack "
                "(requirements/<lane>.txt) or use --rollout-engine torch"
            ) from exc
        self.engine = sglang.Engine(**server_kwargs(args, dist_info, ServerArgs))

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        params = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "max_new_tokens": sampling.max_response_len,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,  # keep the stop token: the trainer learns to emit it
            "sampling_seed": seed,
        }
        outputs = self.engine.generate(
            input_ids=[list(p) for p in prompts], sampling_params=params, return_logprob=True
        )
        return [_generation(p, out) for p, out in zip(prompts, outputs, strict=True)]

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        self.engine.update_weights_from_tensor(named_tensors=list(named_tensors), flush_cache=True)

    def named_weights(self) -> Iterator[tuple[str, object]]:
        import torch

        # SGLang returns weights by name (truncated views on request); ask for each in full.
        names = self.engine.get_weights_by_name  # bound early so a missing API fails here
        for name in self._weight_names():
            yield name, torch.as_tensor(names(name, truncate_size=1 << 62))

    def _weight_names(self) -> list[str]:
        import json
        from pathlib import Path

        index = Path(self.engine.server_args.model_path) / "model.safetensors.index.json"
        if index.is_file():
            return sorted(json.loads(index.read_text())["weight_map"])
        from safetensors import safe_open

        with safe_open(str(Path(self.engine.server_args.model_path) / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    def close(self) -> None:
        self.engine.shutdown()


def _generation(prompt: Sequence[int], out: dict) -> Generation:
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]  # (logprob, token id, text) per generated token
    finish = meta.get("finish_reason") or {}
    return Generation(
        prompt_ids=tuple(prompt),
        response_ids=tuple(int(e[1]) for e in entries),
        logprobs=tuple(float(e[0]) for e in entries),
        finish_reason="length" if finish.get("type") == "length" else "stop",
    )
