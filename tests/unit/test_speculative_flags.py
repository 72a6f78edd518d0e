"""The seed's speculative-decoding flags: SGLang builds its real ServerArgs from them, the built-in
engine reads them as its drafter's settings or refuses what it cannot do, and the MTP training
flags a transformers backend cannot act on are refused with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.speculative import SpeculationRefused, SpeculativeConfig

register_cpu_ci(est_time=6, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("sglang_probe.py")
SEED_SPEC = (
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3",
)  # fmt: skip


def test_the_seeds_speculative_flags_build_the_pinned_sglangs_serverargs(tmp_path):
    argv = ["--hf-checkpoint", str(tmp_path), "--rollout-engine", "sglang", *SEED_SPEC]
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps([{"argv": argv}])],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (answer,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in answer, answer
    built = answer["built"]
    assert built["speculative_algorithm"] == "EAGLE" and built["speculative_num_steps"] == 2
    assert built["speculative_eagle_topk"] == 1 and built["speculative_num_draft_tokens"] == 3


def test_the_built_in_engine_reads_the_seeds_flags_as_a_chain_of_drafts():
    assert SpeculativeConfig.from_flags("EAGLE", 2, 1, 3) == SpeculativeConfig(steps=2)
    assert SpeculativeConfig.from_flags(None, None, None, None) is None


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("EAGLE", 2, 4, None), "--sglang-speculative-eagle-topk 4: the built-in engine drafts one chain"),
        (("EAGLE", 2, 1, 5), "--sglang-speculative-num-draft-tokens 5: a chain of 2 drafts verifies 3"),
        (
            ("STANDALONE", 2, 1, 3),
            "--sglang-speculative-algorithm STANDALONE: the built-in rollout engine drafts",
        ),
        ((None, 3, None, None), "--sglang-speculative-num-steps 3 without --sglang-speculative-algorithm"),
    ],
)
def test_the_built_in_engine_refuses_what_it_cannot_draft(flags, says):
    with pytest.raises(SpeculationRefused, match=says.replace("(", r"\(")):
        SpeculativeConfig.from_flags(*flags)


def test_mtp_training_flags_are_refused_on_a_transformers_backend(tmp_path):
    from miles.train.args import parse_config
    from miles.train.consumption import refusal

    config = parse_config(
        ["--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", "--enable-mtp-training"]
    )
    said = refusal(config, "torch")
    assert said is not None and "--enable-mtp-training" in said and "have no MTP forward" in said, said
