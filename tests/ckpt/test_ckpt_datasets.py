"""prepare-ckpt's fetch step fetches the recipe's prompt dataset: checksummed, resumable, skipped when done.

The Hugging Face Hub is the one thing that cannot be reached from a test, so each test serves
the dataset from a small hub on 127.0.0.1 that answers the two requests huggingface_hub makes
for a file (HEAD and GET on /datasets/<repo>/resolve/<revision>/<file>, with Range for a
resumed download) and points HF_ENDPOINT at it. Everything else is the command an operator
types: `python -m miles.recipes prepare qwen3_4b ... --steps fetch`, with the model's own
fetch reading a local source directory.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.datasets import DATASETS, UnknownDataset, dataset_of

register_cpu_ci(est_time=6, suite="stage-b-cpu")

ROOT = Path(__file__).resolve().parents[2]
DAPO = DATASETS["dapo-math-17k"]
COMMIT = "c0ffee" + "0" * 34
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes a download in chunks of this size


class FakeHub:
    """Serves one dataset file; `break_at` drops the first plain GET after that many bytes,
    `corrupt` serves other bytes under the real checksum."""

    def __init__(self, data: bytes, *, break_at: int | None = None, corrupt: bool = False):
        self.data, self.break_at, self.corrupt = data, break_at, corrupt
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _head(self, length: int, status: int) -> None:
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(hub.data).hexdigest()}"')
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def _known(self) -> bool:
                if self.path.startswith(f"/datasets/{DAPO.repo}/resolve/"):
                    return True
                self.send_error(404)
                return False

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path, None))
                if self._known():
                    self._head(len(hub.data), 200)

            def do_GET(self):
                span = self.headers.get("Range")
                hub.requests.append(("GET", self.path, span))
                if not self._known():
                    return
                start = int(span.split("=")[1].split("-")[0]) if span else 0
                body = hub.data[start:]
                if hub.corrupt:
                    body = bytes(b ^ 0xFF for b in body)
                self._head(len(body), 206 if span else 200)
                if span is None and hub.break_at is not None:
                    hub.break_at, cut = None, hub.break_at
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _prepare(tmp_path: Path, hub_url: str, *extra_env: tuple[str, str]) -> subprocess.CompletedProcess:
    source = tmp_path / "source"  # the model's own fetch reads a local directory
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    env = {
        **os.environ,
        "HF_ENDPOINT": hub_url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)
    env.update(dict(extra_env))
    argv = [
        sys.executable, "-m", "miles.recipes", "prepare", "qwen3_4b", "--platform", "cuda",
        "--model", "Qwen3-4B", "--source", str(source), "--model-dir", str(tmp_path / "models"),
        "--data-dir", str(tmp_path / "data"), "--steps", "fetch", "--quiet",
    ]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _lines(n: int) -> bytes:
    return b"".join(b'{"prompt": "What is %d + %d?", "label": "%d"}\n' % (i, i, 2 * i) for i in range(n))


def test_the_fetch_step_fetches_the_recipes_dataset_with_its_checksum(tmp_path):
    data = _lines(200)
    with FakeHub(data) as hub:
        done = _prepare(tmp_path, hub.url)
        assert done.returncode == 0, done.stderr
        fetched = tmp_path / "data/dapo-math-17k/dapo-math-17k.jsonl"
        assert fetched.read_bytes() == data
        manifest = json.loads((fetched.parent / ".miles-ckpt.json").read_text())
        assert manifest["files"] == {
            "dapo-math-17k.jsonl": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        }
        assert f"data: dapo-math-17k ran ({tmp_path}/data/dapo-math-17k)" in done.stdout
        assert {path for _, path, _ in hub.requests} == {
            f"/datasets/{DAPO.repo}/resolve/main/dapo-math-17k.jsonl"
        }

        asked = len(hub.requests)
        again = _prepare(tmp_path, hub.url)
        assert again.returncode == 0, again.stderr
        assert "data: dapo-math-17k skipped" in again.stdout
        assert len(hub.requests) == asked, "a finished dataset is not fetched again"


def test_an_offline_rerun_takes_the_dataset_from_the_cache(tmp_path):
    data = _lines(50)
    with FakeHub(data) as hub:
        assert _prepare(tmp_path, hub.url).returncode == 0
    (tmp_path / "data/dapo-math-17k/.miles-ckpt.json").unlink()
    for path in (tmp_path / "data/dapo-math-17k").iterdir():
        path.unlink()
    (tmp_path / "data/dapo-math-17k").rmdir()
    done = _prepare(tmp_path, "http://127.0.0.1:9", ("HF_HUB_OFFLINE", "1"))  # nothing listens there
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "data/dapo-math-17k/dapo-math-17k.jsonl").read_bytes() == data


def test_an_interrupted_download_resumes_where_it_stopped(tmp_path):
    data = _lines(300_000)[: CHUNK + 2 * 1024 * 1024]  # past one write chunk, so the first part is on disk
    with FakeHub(data, break_at=CHUNK + 1024 * 1024) as hub:
        done = _prepare(tmp_path, hub.url)
        assert done.returncode == 0, done.stderr
        ranges = [span for method, _, span in hub.requests if method == "GET"]
    assert ranges == [None, f"bytes={CHUNK}-"]
    assert (tmp_path / "data/dapo-math-17k/dapo-math-17k.jsonl").read_bytes() == data


def test_bytes_that_do_not_match_the_hubs_checksum_are_refused(tmp_path):
    with FakeHub(_lines(20), corrupt=True) as hub:
        done = _prepare(tmp_path, hub.url)
    assert done.returncode == 1
    assert "does not match its checksum" in done.stderr and "delete that blob and fetch again" in done.stderr
    assert not (tmp_path / "data/dapo-math-17k").exists()


def test_data_the_recipes_name_is_data_something_fetches():
    assert dataset_of("{data_dir}/dapo-math-17k/dapo-math-17k.jsonl") is DAPO
    assert dataset_of("synthetic:fixed") is None
    assert dataset_of("{data_dir}/gsm8k/test.parquet") is DATASETS["gsm8k"]
    with pytest.raises(UnknownDataset, match=r"no fetch provides gsm8k/dev.parquet"):
        dataset_of("{data_dir}/gsm8k/dev.parquet")


def test_eval_and_prompt_sets_a_command_reads_from_the_data_dir_are_fetched_with_the_model():
    from miles.ckpt.datasets import datasets_in

    argv = (
        "--prompt-data", "/data/gsm8k/train.parquet", "--eval-prompt-data", "aime24",
        "/data/aime-2024/aime-2024.jsonl", "gsm8k", "/data/gsm8k/test.parquet", "mine", "/home/me/x.jsonl",
        "--lr", "/data/not-a-dataset",
    )  # fmt: skip
    assert datasets_in(argv, "/data") == ("gsm8k", "aime-2024")
    with pytest.raises(
        UnknownDataset, match=r"--eval-prompt-data \{data_dir\}/math/x.jsonl: no fetch provides"
    ):
        datasets_in(("--eval-prompt-data", "m", "/data/math/x.jsonl"), "/data/")


def test_a_recipe_plan_fetches_the_eval_sets_its_extra_args_name():
    from miles.recipes import load
    from miles.recipes.launch import RunOptions, build_plan

    options = RunOptions(
        model="Qwen3-4B",
        data_dir="/d",
        extra_args=("--eval-prompt-data", "aime24", "/d/aime-2024/aime-2024.jsonl", "--eval-interval", "2"),
    )
    plan = build_plan(load("qwen3_4b", platform="cuda"), options, "cuda", base_env={})
    assert plan.checkpoint.datasets == ("dapo-math-17k", "aime-2024")
