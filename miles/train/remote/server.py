"""The built-in rollout engine as a process of its own, serving the part of SGLang's HTTP API
that miles uses, in sglang 0.5.23's request and answer shapes (srt/entrypoints/http_server.py,
srt/managers/io_struct.py), so the trainer's client (miles.train.remote.client) talks to it and
to `python -m sglang.launch_server` alike:

    POST /generate                 input_ids (one list or several), sampling_params
                                   -> output dicts with meta_info
    GET  /health, /health_generate
    POST /pause_generation {mode}, /continue_generation, /abort_request, /flush_cache
    POST /begin_weight_update, /end_weight_update
    POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
    POST /update_weights_from_disk {model_path, weight_version}
    POST /pull_weights             (miles) apply a disk-delta version to the host's local copy, reload
    POST /weights_checker {action: "checksum"}
    POST /open_session, /close_session; /generate with session_params continues a turn
    POST /v1/chat/completions      messages -> the engine's chat template -> a completion

Generation runs one request batch at a time (the model is one lock). A pause is seen between
decoding steps: `in_place` freezes the batch and hands the model to the weight update (its
cache kept, as SGLang's), `retract` stops it and, after /continue_generation, recomputes every
unfinished row from its prompt and the tokens so far with the new weights, `abort` ends it with
finish reason abort. Outputs carry the weight versions that produced their tokens
(`weight_versions` spans, as SGLang's). Sessions keep a conversation's KV cache between turns
(miles.train.remote.sessions). Tensors travel only by collective group or files, never by JSON.

`python -m miles.train.remote.server --hf-checkpoint DIR --ready-file F` writes its URL to F
once the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from miles.train.remote.serving import EngineServer, Refused

# --- HTTP ---


def _handler(server: EngineServer):
    routes = {
        "/generate": lambda b: server.generate(b),
        "/pause_generation": lambda b: server.pause(b.get("mode", "abort")),
        "/continue_generation": lambda b: server.resume(),
        "/abort_request": server.abort,
        "/flush_cache": lambda b: server.sessions.flush(),
        "/open_session": lambda b: server.open_session(b),
        "/close_session": lambda b: server.sessions.close(b["session_id"]),
        "/v1/chat/completions": server.chat,
        "/begin_weight_update": lambda b: server.begin_update(),
        "/end_weight_update": lambda b: server.end_update(),
        "/init_weights_update_group": server.init_group,
        "/destroy_weights_update_group": server.destroy_group,
        "/update_weights_from_distributed": server.update_from_distributed,
        "/update_weights_from_disk": server.update_from_disk,
        "/pull_weights": server.pull,
        "/weights_checker": lambda b: {"ranks": [server.checksums()]},
        "/health": lambda b: None,
        "/health_generate": lambda b: None,
        "/get_server_info": lambda b: server.info(),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self._serve({})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as exc:
                return self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": f"not JSON: {exc}"})
            self._serve(body)

        def _serve(self, body: dict) -> None:
            route = routes.get(self.path.split("?")[0])
            if route is None:
                return self._send(
                    HTTPStatus.NOT_FOUND, {"success": False, "message": f"no route {self.path}"}
                )
            try:
                result = route(body)
            except Refused as exc:
                return self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)})
            except Exception as exc:  # an engine error is the request's answer, not the server's end
                return self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    {"success": False, "message": f"{type(exc).__name__}: {exc}"},
                )
            if (
                result is None
                or isinstance(result, dict)
                and "success" not in result
                and self.path != "/generate"
            ):
                result = {"success": True, "message": "", **(result or {})}
            self._send(HTTPStatus.OK, result)

        def _send(self, status: HTTPStatus, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):
            pass

    return Handler


def serve(server: EngineServer, host: str, port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer((host, port), _handler(server))
    httpd.daemon_threads = True
    return httpd


def main(argv: list[str] | None = None) -> int:
    from miles import children

    parser = argparse.ArgumentParser(
        prog="python -m miles.train.remote.server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hf-checkpoint", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--name", default="engine")
    parser.add_argument("--ready-file", help="written with the server's URL once it serves")
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args(argv)
    children.arm()
    import torch

    from miles.train.model import load_causal_lm, load_tokenizer

    torch.set_num_threads(args.num_threads)
    model = load_causal_lm(args.hf_checkpoint, dtype=getattr(torch, args.dtype))
    server = EngineServer(model, load_tokenizer(args.hf_checkpoint), name=args.name)
    httpd = serve(server, args.host, args.port)
    url = f"http://{args.host}:{httpd.server_address[1]}"
    if args.ready_file:
        tmp = Path(args.ready_file).with_suffix(".tmp")
        tmp.write_text(url)
        os.replace(tmp, args.ready_file)
    print(f"miles.engine {args.name}: serving {args.hf_checkpoint} at {url} (pid {os.getpid()})", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
