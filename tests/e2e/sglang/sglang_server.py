"""An SGLang server for the GPU twins of the seed's tests/e2e/sglang tests. Not a test module.

`started(repo, tp)` downloads the model into $MILES_MODEL_DIR (default .miles/models) through
huggingface_hub, as the seed's tests do (snapshot_download), and starts `python -m
sglang.launch_server` on it with miles' engine launcher (miles.train.remote.fleet: its own
process group, killed with the test), waiting for /health_generate.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def started(repo: str, *, tp: int = 1, extra: tuple[str, ...] = ()) -> Iterator[tuple[str, object]]:
    """(model directory, EngineClient) of a running server; stopped on exit."""
    from huggingface_hub import snapshot_download

    from miles.train.remote.client import EngineClient
    from miles.train.remote.fleet import log_dir, spawn, stop_process, wait_for_health
    from miles.train.remote.group import free_port

    model = Path(os.environ.get("MILES_MODEL_DIR", ".miles/models")) / repo.split("/")[-1]
    snapshot_download(repo, local_dir=model)
    port = free_port()
    args = [
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        *extra,
    ]
    log = log_dir() / f"sglang-{port}.log"
    process = spawn("sglang.launch_server", args, log)
    client = EngineClient(f"http://127.0.0.1:{port}", repo)
    try:
        wait_for_health(client, process, log)
        yield str(model), client
    finally:
        stop_process(process)
