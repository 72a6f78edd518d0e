"""What the built-in engine server does with each request (miles.train.remote.server serves it
over HTTP): generation one request batch at a time under the model lock, pauses between
decoding steps (in_place, retract, abort), aborts, weight loads and their versions, sessions
and chat completions. See miles.train.remote.server for the routes.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.train.config import SamplingConfig
from miles.train.remote.sessions import SessionRefused, Sessions


@dataclass
class Versions:
    """Which weight version produced which output tokens of one row: SGLang's weight_versions
    spans (utils/weight_versions.py), from the (version, tokens so far) of every change."""

    current: str
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens it produced)

    def changed(self, new: str, tokens: int) -> None:
        if new != self.current:
            self.events.append((self.current, tokens))
            self.current = new

    def spans(self, tokens: int) -> list[dict]:
        spans: list[dict] = []
        for version, end in [*self.events, (self.current, tokens)]:
            end = min(end, tokens)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and version == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return spans or [{"version": self.current, "start": 0, "end": 0}]


class Refused(Exception):
    """A request the engine answers with success false (SGLang's HTTP 400 with a message)."""


class EngineServer:
    """The engine's state: the model, its weight version, pause, abort and update sessions."""

    def __init__(self, model, tokenizer, *, name: str = "engine", weight_version: str = "0"):
        from miles.train.rollout import TorchRolloutEngine

        self.name = name
        self.engine = TorchRolloutEngine(model, pad_token_id=tokenizer.pad_token_id or 0)
        self.tokenizer = tokenizer
        self.version = weight_version
        self.model_lock = threading.Lock()  # generation and weight loads take turns
        self.state = threading.Condition()  # pause, abort epoch and version changes
        self.paused = False
        self.pause_mode = "abort"
        self.abort_epoch = 0
        self.update_open = False
        self.groups: dict = {}
        self.seed_counter = 0
        # what /get_server_info reports: rows sampling now, rows a pause holds, steps decoded
        self.running = self.held = self.decode_steps = self.prefilled = 0
        self.sessions = Sessions()
        self.weight_loads = 0  # a session's kept cache is good only for the weights it was made with

    # --- generation ---

    def generate(self, body: dict) -> Any:
        ids = body.get("input_ids")
        if ids is None:
            raise Refused("this engine takes token ids: pass input_ids")
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [list(ids)] if single else [list(p) for p in ids]
        params = body.get("sampling_params") or {}
        if isinstance(params, list):
            raise Refused("one sampling_params for the whole request")
        sampling, seed = self._sampling(params)
        session = body.get("session_params")
        if session:
            rids = body.get("rid") or [uuid.uuid4().hex for _ in prompts]
            rids = [rids] if isinstance(rids, str) else rids
            outputs = [
                self.session_turn(session, r, p, sampling, seed) for r, p in zip(rids, prompts, strict=True)
            ]
        else:
            outputs = self.run_batch(prompts, sampling, seed)
        return outputs[0] if single else outputs

    def _sampling(self, params: dict) -> tuple[SamplingConfig, int]:
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        if temperature == 0:  # SGLang samples greedily at temperature 0 (logprobs untempered)
            temperature, top_k = 1.0, 1
        sampling = SamplingConfig(
            temperature=temperature,
            top_p=float(params.get("top_p", 1.0)),
            top_k=top_k,
            max_response_len=int(params.get("max_new_tokens", 128)),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
        )
        seed = params.get("sampling_seed")
        if seed is None:
            with self.state:
                self.seed_counter += 1
                seed = self.seed_counter
        return sampling, int(seed)

    def run_batch(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, cached: int = 0
    ) -> list[dict]:
        """Sample the prompts; rows a `retract` pause stopped continue after the pause, from their
        prompt and tokens so far, with the weights then loaded."""
        from miles.train.rollout import Generation

        rows = [Generation(tuple(p), (), (), "retract") for p in prompts]
        versions = [Versions(self.version) for _ in prompts]
        attempt = 0
        while todo := [i for i, g in enumerate(rows) if g.finish_reason == "retract"]:
            epoch = self._wait_unpaused(len(todo))
            left = [sampling.max_response_len - len(rows[i].response_ids) for i in todo]
            asked = SamplingConfig(
                sampling.temperature, sampling.top_p, sampling.top_k, max(left), sampling.stop_token_ids
            )
            done = self._locked_generate(
                [list(rows[i].prompt_ids) + list(rows[i].response_ids) for i in todo],
                asked,
                seed + attempt,
                epoch,
                [(versions[i], len(rows[i].response_ids)) for i in todo],
            )
            for i, g, limit in zip(todo, done, left, strict=True):
                response = rows[i].response_ids + g.response_ids[:limit]
                finish = "length" if len(g.response_ids) > limit else g.finish_reason
                if finish == "retract" and len(response) >= sampling.max_response_len:
                    finish = "length"
                rows[i] = Generation(
                    rows[i].prompt_ids, response, rows[i].logprobs + g.logprobs[:limit], finish
                )
            attempt += 1
        return [self._output(g, v, cached) for g, v in zip(rows, versions, strict=True)]

    def session_turn(
        self, params: dict, rid: str, input_ids: list[int], sampling: SamplingConfig, seed: int
    ) -> dict:
        """One turn of a session (miles.train.remote.sessions): its context continues the turn
        `params["rid"]`, reusing that turn's KV cache; a `retract` pause recomputes it."""
        from miles.train.remote.sessions import Turn, extend

        try:
            context, cache, cached = self.sessions.start(params, input_ids, self.tokenizer.bos_token_id)
        except SessionRefused as exc:
            raise Refused(str(exc)) from None
        loads = self.weight_loads
        versions = Versions(self.version)
        reused, response, logprobs, finish = cached, [], [], "retract"
        while finish == "retract":
            epoch = self._wait_unpaused(1)
            left = sampling.max_response_len - len(response)
            asked = SamplingConfig(
                sampling.temperature, sampling.top_p, sampling.top_k, left, sampling.stop_token_ids
            )
            with self.model_lock:
                if self.weight_loads != loads:  # computed with older weights: prefill again
                    cache, cached = None, 0
                    reused = reused if response else 0
                loads = self.weight_loads
                versions.changed(self.version, len(response))
                control = self._row_control(epoch, versions, len(response))
                g, cache, cached, prefilled = extend(
                    self.engine, context + response, cache, cached, asked, seed, control
                )
            with self.state:
                self.prefilled += prefilled
            response += g.response_ids
            logprobs += g.logprobs
            finish = g.finish_reason
            if finish == "retract":
                cache, cached = None, 0
        self.sessions.finish(params, rid, Turn(rid, context + response, cache, cached))
        from miles.train.rollout import Generation

        done = Generation(tuple(context), tuple(response), tuple(logprobs), finish)
        out = self._output(done, versions, reused)
        out["meta_info"]["id"] = rid
        return out

    def _row_control(self, epoch: int, versions: Versions, before: int):
        """The between-steps check of one row that has `before` tokens already."""
        steps = 0

        def control():
            nonlocal steps
            steps += 1
            answer = self._control(epoch, 1)
            versions.changed(self.version, before + steps)
            return answer

        return control

    def _wait_unpaused(self, rows: int) -> int:
        with self.state:
            if self.paused:
                self.held += rows
                self.state.wait_for(lambda: not self.paused)
                self.held -= rows
            return self.abort_epoch

    def _locked_generate(self, prompts, sampling, seed, epoch, rows: list[tuple[Versions, int]]):
        """One sub-batch under the model lock; each row's versions follow in-place weight loads."""
        with self.model_lock:
            for versions, before in rows:
                versions.changed(self.version, before)  # weights loaded since its last tokens
            if self._aborted(epoch):
                return [_aborted(p) for p in prompts]
            steps = 0

            def control():
                nonlocal steps
                steps += 1
                with self.state:
                    self.decode_steps += 1
                answer = self._control(epoch, len(prompts))
                for versions, before in rows:  # an in-place pause may have loaded new weights
                    versions.changed(self.version, before + steps)
                return answer

            self._count("running", len(prompts))
            try:
                return self.engine.generate(prompts, sampling, seed, control=control)
            finally:
                self._count("running", -len(prompts))

    def _count(self, what: str, delta: int) -> None:
        with self.state:
            setattr(self, what, getattr(self, what) + delta)

    def _aborted(self, epoch: int) -> bool:
        with self.state:
            return epoch != self.abort_epoch

    def _control(self, epoch: int, rows: int) -> str | None:
        with self.state:
            if epoch != self.abort_epoch:
                return "abort"
            if not self.paused:
                return None
            if self.pause_mode in ("abort", "retract"):
                return self.pause_mode
            self.held += rows
        # in_place: the batch waits here, its cache kept, and the model goes to the update
        self.model_lock.release()
        try:
            with self.state:
                self.state.wait_for(lambda: not self.paused or epoch != self.abort_epoch)
                self.held -= rows
        finally:
            self.model_lock.acquire()
        return "abort" if self._aborted(epoch) else None

    def _output(self, g, versions: Versions, cached: int) -> dict:
        finish = {"type": g.finish_reason}
        if g.finish_reason == "abort":
            finish["message"] = "aborted"
        return {
            "text": self.tokenizer.decode(list(g.response_ids), skip_special_tokens=True),
            "output_ids": list(g.response_ids),
            "meta_info": {
                "id": "",
                "finish_reason": finish,
                "prompt_tokens": len(g.prompt_ids),
                "completion_tokens": len(g.response_ids),
                "cached_tokens": cached,
                "output_token_logprobs": [
                    [lp, tok, None] for lp, tok in zip(g.logprobs, g.response_ids, strict=True)
                ],
                "weight_version": versions.current,
                "weight_versions": versions.spans(len(g.response_ids)),
            },
        }

    def chat(self, body: dict) -> dict:
        """/v1/chat/completions: the messages through the engine's own chat template, then a
        completion, in the OpenAI shape SGLang answers with (logprobs per token, and the prompt's
        token ids with return_prompt_token_ids)."""
        ids = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = {
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", -1),
            "max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or 128,
            "stop_token_ids": body.get("stop_token_ids") or [],
            "sampling_seed": body.get("seed"),
        }
        sampling, seed = self._sampling({k: v for k, v in params.items() if v is not None})
        out = self.run_batch([ids], sampling, seed)[0]
        meta = out["meta_info"]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out["text"]},
            "finish_reason": meta["finish_reason"]["type"],
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": self.tokenizer.decode([tok]), "logprob": lp}
                    for lp, tok, _ in meta["output_token_logprobs"]
                ]
            }
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = ids
        usage = {"prompt_tokens": len(ids), "completion_tokens": meta["completion_tokens"]}
        return {"object": "chat.completion", "model": self.name, "choices": [choice], "usage": usage}

    def open_session(self, body: dict) -> str:
        try:
            return self.sessions.open(body.get("session_id"))
        except SessionRefused as exc:
            raise Refused(str(exc)) from None

    def info(self) -> dict:
        with self.state:
            return {
                "name": self.name,
                "pid": os.getpid(),
                "weight_version": self.version,
                "paused": self.paused,
                "running_requests": self.running,
                "held_requests": self.held,
                "decode_steps": self.decode_steps,
                "prefilled_tokens": self.prefilled,
            }

    # --- control ---

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise Refused(f"pause mode {mode!r}; known: abort, retract, in_place")
        with self.state:
            self.paused, self.pause_mode = True, mode
            if mode == "abort":
                self.abort_epoch += 1
            self.state.notify_all()

    def resume(self) -> None:
        with self.state:
            self.paused = False
            self.state.notify_all()

    def abort(self, body: dict) -> None:
        if not body.get("abort_all"):
            raise Refused("this engine aborts every request at once: pass abort_all true")
        with self.state:
            self.abort_epoch += 1
            self.state.notify_all()

    # --- weights ---

    def begin_update(self) -> None:
        self.update_open = True

    def end_update(self) -> None:
        self.update_open = False

    def load(self, named_tensors, version: str | None) -> int:
        """Copy tensors into the model by name; returns how many were loaded."""
        import torch

        with self.model_lock:
            params = self.engine.model.state_dict(keep_vars=True)
            count = 0
            with torch.no_grad():
                for name, tensor in named_tensors:
                    target = params.get(name)
                    if target is None:
                        raise Refused(f"the model has no parameter {name}")
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise Refused(f"{name}: shape {list(tensor.shape)}, the model's {list(target.shape)}")
                    target.copy_(tensor.to(dtype=target.dtype))
                    count += 1
            self.weight_loads += 1
            self.sessions.flush()  # caches computed with the old weights
            if version is not None:
                with self.state:
                    self.version = str(version)
        return count

    def init_group(self, body: dict) -> None:
        from miles.train.remote.group import open_group

        name = body.get("group_name", "weight_update_group")
        self.groups[name] = open_group(
            backend=body.get("backend", "gloo"),
            address=body["master_address"],
            port=int(body["master_port"]),
            rank=int(body["rank_offset"]),  # one rank per engine process here (tp 1)
            world_size=int(body["world_size"]),
            group_name=name,
        )

    def destroy_group(self, body: dict) -> None:
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            raise Refused("The group to be destroyed does not exist.")
        group.close()

    def update_from_distributed(self, body: dict) -> None:
        import torch

        if not self.update_open:  # sglang's scheduler refuses these outside a session
            raise Refused(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        name = body.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise Refused(
                f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
            )
        received = []
        for tensor_name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
            group.broadcast(tensor)
            received.append((tensor_name, tensor))
        self.load(received, body.get("weight_version"))

    def update_from_disk(self, body: dict) -> None:
        from miles.train.remote.disk import MANIFEST, read_weights

        path = Path(body["model_path"])
        if (path / MANIFEST).is_file():
            self.load(read_weights(path), body.get("weight_version"))
        else:  # a plain Hugging Face directory, as SGLang reads one
            from safetensors.torch import load_file

            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise Refused(f"{path}: no *.safetensors files")
            self.load(((n, t) for f in files for n, t in load_file(f).items()), body.get("weight_version"))

    def pull(self, body: dict) -> None:
        from miles.train.remote.disk import apply_version, read_weights

        local = body["local_checkpoint_dir"]
        apply_version(body["version_dir"], local)
        self.load(read_weights(local), body.get("weight_version"))

    def checksums(self) -> dict:
        from miles.train.remote.checksums import tensor_checksum

        with self.model_lock:
            sums = {n: tensor_checksum(t) for n, t in self.engine.model.state_dict().items()}
        return {
            "checksums": sums,
            "parallelism_info": {"role": "target", "tp_rank": 0, "tp_size": 1, "rank": 0},
        }


def _aborted(prompt):
    from miles.train.rollout import Generation

    return Generation(tuple(prompt), (), (), "abort")
