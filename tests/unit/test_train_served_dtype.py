"""The dtype the trainer casts its export to is the one SGLang serves the checkpoint in.

sglang 0.5.23 decides it in srt/configs/model_config.py, _get_and_verify_dtype (that module
imports triton, so it cannot be imported here): with dtype "auto", config.json's `dtype`
(else `torch_dtype`; float32 when neither), except that float32 is served as float16, or
bfloat16 for a Gemma; any other dtype names its own, and an unknown one is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.sglang_engine import SGLangUnavailable, served_dtype

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _model(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("config", "kwargs", "expected"),
    [
        ({"model_type": "qwen3", "dtype": "bfloat16"}, {}, torch.bfloat16),
        ({"model_type": "qwen3", "torch_dtype": "float16"}, {"dtype": "auto"}, torch.float16),
        ({"model_type": "qwen3", "dtype": "float32"}, {}, torch.float16),
        ({"model_type": "qwen3"}, {}, torch.float16),
        ({"model_type": "gemma3_text", "dtype": "float32"}, {}, torch.bfloat16),
        ({"model_type": "qwen3", "dtype": "bfloat16"}, {"dtype": "float32"}, torch.float32),
        ({"model_type": "qwen3", "dtype": "float32"}, {"dtype": "half"}, torch.float16),
    ],
    ids=["config-bf16", "torch_dtype-fp16", "fp32-served-fp16", "absent-is-fp32", "gemma-fp32-bf16",
         "flag-upcasts", "flag-half"],
)  # fmt: skip
def test_served_dtype_follows_sglang(tmp_path, config, kwargs, expected):
    assert served_dtype(_model(tmp_path, **config), kwargs) == expected


def test_unknown_dtype_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(SGLangUnavailable, match="--sglang-dtype fp8"):
        served_dtype(_model(tmp_path, model_type="qwen3"), {"dtype": "fp8"})
