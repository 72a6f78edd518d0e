"""The FSDP/DDP backend can hand SGLang its weights under the checkpoint files' names.

transformers 5 fuses a layer's experts in memory; SGLang's loaders read the files' one tensor
per expert. `checkpoint_names` undoes the conversion transformers applied when loading.
"""

from __future__ import annotations

import pytest
import torch

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_checkpoint_names_are_the_files_names_with_the_files_values(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.ckpt.shards import CheckpointReader
    from miles.train.backends.torch_dp import checkpoint_names
    from tests.support.ckpt import tiny_hf

    path = tiny_hf(family, 2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = checkpoint_names(model, model.state_dict())
    with CheckpointReader(path) as reader:
        files = {name: reader.read(name) for name in reader.files.weight_map}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(state) - tied == set(files)
    for name, tensor in files.items():
        assert torch.equal(state[name], tensor.float()), name
