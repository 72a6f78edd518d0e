"""On-policy distillation on the CPU lane's tiny Qwen3: the policy's KL to a served teacher falls.

A teacher (a second tiny Qwen3 that never emits an odd token id) is served beside the policy by
`python -m miles.rollout.teacher_server` (SGLang's /generate scoring answer, on the CPU); the
policy trains with the seed's OPD flags (radixark/miles 31f1ca961,
tests/e2e/short/test_qwen2.5_0.5B_opd_sglang.py: `--use-opd --opd-type sglang --custom-rm-path
miles.rollout.on_policy_distillation.reward_func --custom-reward-post-process-path
miles.rollout.on_policy_distillation.post_process_rewards --rm-url .../generate`), so each response
token's advantage is minus its reverse KL to the teacher. `rollout/opd_reverse_kl`, the mean over
a rollout's response tokens of log pi(y) - log pi_teacher(y) on the policy's own samples, must fall.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=15, suite="stage-b-cpu")


NUM_ROLLOUT = 12
MODULE = "miles.rollout.on_policy_distillation"
TRAIN = (
    "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "6", "--global-batch-size", "16", "--micro-batch-size", "8",
    "--lr", "1e-2", "--weight-decay", "0",
    "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0",
    "--custom-rm-path", f"{MODULE}.reward_func", "--custom-reward-post-process-path", f"{MODULE}.post_process_rewards",
)  # fmt: skip
BAN_PENALTY = 2.0  # times the constant hidden unit (~11 after the final norm): odd ids' logits fall ~22


def _teacher_checkpoint(workdir: Path) -> Path:
    """A tiny Qwen3 that never emits an odd token id: hidden unit 0 is held constant (every
    embedding sets it; no layer writes it) and only odd ids' lm_head rows read it, negatively.
    The policy starts near uniform, so about half its tokens are ones the teacher rules out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.ckpt.tiny import make_tiny_checkpoint

    raw = make_tiny_checkpoint("qwen3", 1, workdir / "teacher-raw", seed=1, progress=False)
    model = AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[1::2, 0] = -BAN_PENALTY
    out = workdir / "teacher"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(raw).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def teacher_url(tmp_path_factory):
    """The teacher served on a free port for the module's runs (the command a user runs)."""
    workdir = tmp_path_factory.mktemp("opd-teacher")
    argv = [
        sys.executable,
        "-m",
        "miles.rollout.teacher_server",
        "--model-path",
        str(_teacher_checkpoint(workdir)),
    ]
    proc = subprocess.Popen([*argv, "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("miles.rollout.teacher_server:"), f"the teacher did not start: {line!r}"
        url = line.rsplit(" on ", 1)[1].strip()
        with urllib.request.urlopen(url.replace("/generate", "/health_generate"), timeout=30) as answer:
            assert answer.status == 200
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_teacher_answers_sglangs_scoring_request(teacher_url):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": [9]}  # fmt: skip
    request = urllib.request.Request(teacher_url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=60) as answer:
        meta = json.loads(answer.read())["meta_info"]
    logprobs = meta["input_token_logprobs"]
    assert logprobs[0] == [None, 5, None] and [e[1] for e in logprobs[1:]] == [6, 7]
    assert all(e[0] < 0 for e in logprobs[1:])
    assert meta["input_top_logprobs"][0] is None and [len(p) for p in meta["input_top_logprobs"][1:]] == [
        2,
        2,
    ]
    assert [[e[1] for e in p] for p in meta["input_token_ids_logprobs"][1:]] == [[9], [9]]


def test_distillation_lowers_the_policys_kl_to_the_teacher(teacher_url, tmp_path):
    plan = runs.tiny_plan("qwen3_4b", tmp_path, *TRAIN, "--rm-url", teacher_url, train_backend="fsdp")
    record = tmp_path / "record"
    assert runs.launch(plan, record) == 0
    kl = runs.series(record, "rollout/opd_reverse_kl")
    assert sorted(kl) == list(range(NUM_ROLLOUT)), kl
    first, last = (kl[0] + kl[1]) / 2, (kl[NUM_ROLLOUT - 2] + kl[NUM_ROLLOUT - 1]) / 2
    print(f"rollout/opd_reverse_kl first two {first:.4f} -> last two {last:.4f}: {kl}")
    assert first > 2.0, kl  # about half the policy's tokens are ones the teacher rules out
    assert last < 0.5 * first, kl
