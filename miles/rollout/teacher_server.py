"""A teacher that scores token sequences over HTTP the way SGLang's `/generate` does, without SGLang.

    python -m miles.rollout.teacher_server --model-path DIR [--host 127.0.0.1] [--port 30000]

On-policy distillation asks its teacher (`--rm-url`) for the log-probabilities of each sample's
tokens; on GPUs that is `python -m sglang.launch_server`. This server answers the same request
on any machine with a transformers model (float32 on the CPU): a POST /generate whose
`sampling_params.max_new_tokens` is 0, with `return_logprob` and `logprob_start_len` 0, gets
`meta_info.input_token_logprobs` (one (logprob, token id, None) per input token, the first a
placeholder (None, id, None): sglang 0.5.23, srt/managers/scheduler_components/
logprob_result_processor.py), and, when asked, `input_top_logprobs` (`top_logprobs_num`) and
`input_token_ids_logprobs` (`token_ids_logprob`), each with the same placeholder first. The
log-probabilities are of the model's untempered logits, as SGLang's are at temperature 0. A
request to generate tokens, or from another start, is answered 400 with the reason. GET
/health_generate answers 200 once the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Refused(ValueError):
    """A request this server cannot answer; the message says why."""


def score(model, request: Mapping[str, Any]) -> dict[str, Any]:
    """The /generate answer for a scoring request (see the module docstring)."""
    import torch

    ids = request.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise Refused("input_ids must be a non-empty list of token ids (text prompts are not tokenized here)")
    if (request.get("sampling_params") or {}).get("max_new_tokens", 1) != 0:
        raise Refused("this teacher only scores: sampling_params.max_new_tokens must be 0")
    if not request.get("return_logprob") or request.get("logprob_start_len", 0) != 0:
        raise Refused("a scoring request needs return_logprob true and logprob_start_len 0")
    top_k = int(request.get("top_logprobs_num") or 0)
    asked = [int(i) for i in request.get("token_ids_logprob") or ()]
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)  # row t: the distribution of token t + 1
    picked = logps.gather(-1, torch.tensor(ids[1:], device=device).unsqueeze(-1)).squeeze(-1).tolist()
    meta: dict[str, Any] = {
        "input_token_logprobs": [[None, ids[0], None]]
        + [[lp, i, None] for lp, i in zip(picked, ids[1:], strict=True)],
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "finish_reason": {"type": "length", "length": 0},
    }
    if top_k > 0:
        top = logps.topk(min(top_k, logps.shape[-1]), dim=-1)
        meta["input_top_logprobs"] = [None] + [
            [[v, i, None] for v, i in zip(values, indices, strict=True)]
            for values, indices in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        ]
    if asked:
        chosen = logps[:, asked].tolist()
        meta["input_token_ids_logprobs"] = [None] + [
            [[v, i, None] for v, i in zip(row, asked, strict=True)] for row in chosen
        ]
    return {"text": "", "output_ids": [], "meta_info": meta}


def serve(model, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server answering scoring requests with `model` (call serve_forever on it)."""
    lock = threading.Lock()  # one forward at a time: the model is shared by the handler threads

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: Mapping[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"no {self.path}; this teacher serves POST /generate"})

        def do_POST(self):
            if self.path != "/generate":
                self._send(404, {"error": f"no {self.path}; this teacher serves POST /generate"})
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with lock:
                    answer = score(model, request)
            except (Refused, json.JSONDecodeError, TypeError) as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, answer)

        def log_message(self, format, *args):
            """Quiet: one line per request would drown the trainer's."""

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # every rank's scoring threads connect at once; a short backlog resets them

    return Server((host, port), Handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles.rollout.teacher_server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model-path", required=True, help="a Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    args = parser.parse_args(argv)
    import torch

    from miles.train.model import load_causal_lm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_causal_lm(args.model_path, dtype=torch.float32, device=device).eval()
    server = serve(model, args.host, args.port)
    print(
        f"miles.rollout.teacher_server: {args.model_path} on http://{args.host}:{server.server_port}/generate",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
