"""Run under `torch.distributed.run --nproc-per-node 2 weights_worker.py HF_DIR TORCH_DIST TP PP EP`:
the Megatron backend's weight export against the checkpoint it was loaded from, in both name
formats (the checkpoint's with the carried MTP layers, the transformers class's without).
Not a test module; tests/megatron/test_megatron_weights.py launches it."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    warnings.simplefilter("ignore")
    hf, torch_dist, tp, pp, ep = Path(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:6])
    dist.init_process_group("gloo")
    from transformers import AutoModelForCausalLM

    from miles.ckpt.shards import CheckpointReader
    from miles.families import megatron_family, read_config
    from miles.families.model import build_chunks
    from miles.families.transformer import transformer_config
    from miles.megatron import compat
    from miles.megatron.checkpoint import load_weights
    from miles.megatron.export import WeightExporter
    from miles.megatron.training import init_parallel_state
    from miles.parallel import ParallelLayout

    compat.install()
    config = read_config(hf)
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=1 if ep > 1 else None, sp=tp > 1)
    init_parallel_state(layout, seed=0)
    tc = transformer_config(config, layout, dtype=torch.float32, initialize=True, batch_p2p_comm=False)
    chunks = build_chunks(config, tc, config["vocab_size"])
    load_weights(chunks, torch_dist)

    worst = {}
    # the checkpoint's tensors outside the decoder (a release's towers and MTP layers) are not trained
    left = tuple(prefix for prefix, _ in megatron_family(config).not_decoder)
    with CheckpointReader(hf) as reader:
        files = {
            name: reader.read(name).float() for name in reader.files.weight_map if not name.startswith(left)
        }
    worst["left_out"] = sorted(
        {name.split(".")[1] for name in reader.files.weight_map if name.startswith(left)}
    )
    family = megatron_family(config)
    layout = list(family.weights(config))
    exported = {
        n: t.float() for n, t in WeightExporter(chunks, config, layout, fused_experts=False, extras=True)
    }
    worst["checkpoint_names"] = sorted(exported)
    worst["checkpoint_names_missing"] = sorted(set(files) - set(exported))[:5]
    worst["checkpoint_names_extra"] = sorted(set(exported) - set(files))[:5]
    worst["checkpoint_max_diff"] = max(
        float((exported[n] - files[n]).abs().max()) for n in files if n in exported
    )

    if config["model_type"] == "inkling_mm_model":  # AutoModelForCausalLM does not load a release
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(worst), flush=True)
        dist.destroy_process_group()
        return
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    rename = family.model_name if family.renames_on_load else None
    fused = {
        n: t.float() for n, t in WeightExporter(chunks, config, layout, rename=rename, fused_experts=True)
    }
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    worst["model_names_missing"] = sorted(set(model) - set(fused) - tied)[:5]
    worst["model_names_extra"] = sorted(set(fused) - set(model))[:5]
    worst["model_max_diff"] = max(float((fused[n] - model[n]).abs().max()) for n in model if n in fused)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(worst), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
