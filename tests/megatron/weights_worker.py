"""Run under `torch.distributed.run --nproc-per-node 2 weights_worker.py CASES_JSON`: for each case
{id, hf, torch_dist, tp, pp, ep}, the Megatron backend's weight export against the checkpoint it was
loaded from, in both name formats (the checkpoint's with the carried MTP layers, the transformers
class's without); one `RESULT` line per case from rank 0, all cases in one launch of the ranks
(megatron-core's parallel state rebuilt for each case's layout). tests/megatron/test_megatron_weights.py
launches it."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.results import emit


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    from miles.megatron import compat

    compat.install()
    for case in json.loads(sys.argv[1]):
        result = export_case(
            Path(case["hf"]), case["torch_dist"], case["tp"], case["pp"], case["ep"], case.get("fp8")
        )
        if dist.get_rank() == 0:
            emit({"case": case["id"], **result})
    dist.destroy_process_group()


def export_case(hf: Path, torch_dist: str, tp: int, pp: int, ep: int, fp8: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    from miles.ckpt.shards import CheckpointReader
    from miles.families import megatron_family, read_config
    from miles.families.model import build_chunks
    from miles.families.transformer import transformer_config
    from miles.megatron.checkpoint import load_weights
    from miles.megatron.export import WeightExporter
    from miles.megatron.training import init_parallel_state
    from miles.parallel import ParallelLayout

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
    if fp8 is not None:
        worst.update(fp8_case(fp8, chunks, config, layout))
    if config["model_type"] == "inkling_mm_model":  # AutoModelForCausalLM does not load a release
        return worst
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    rename = family.model_name if family.renames_on_load else None
    fused = {
        n: t.float() for n, t in WeightExporter(chunks, config, layout, rename=rename, fused_experts=True)
    }
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    worst["model_names_missing"] = sorted(set(model) - set(fused) - tied)[:5]
    worst["model_names_extra"] = sorted(set(fused) - set(model))[:5]
    worst["model_max_diff"] = max(float((fused[n] - model[n]).abs().max()) for n in model if n in fused)
    return worst


def fp8_case(fp8: str, chunks, config: dict, layout: list) -> dict:
    """What an FP8 engine started from `fp8` is pushed (the export, gathered over TP and EP, through
    miles.train.fp8_export as the SGLang engine streams it) against that checkpoint's files, bit for bit."""
    from miles.ckpt.shards import CheckpointReader
    from miles.megatron.export import WeightExporter
    from miles.train.fp8_export import fp8_export_for

    export = fp8_export_for(fp8)
    pushed = dict(export(WeightExporter(chunks, config, layout, fused_experts=False, extras=True)))
    with CheckpointReader(fp8) as reader:
        written = {name: reader.read(name) for name in reader.files.weight_map}

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    # the unquantized tensors (norms, the router, embeddings) go out in the trainer's float32, which
    # the engine casts to its own dtype: they are compared at the file's dtype
    fp8 = torch.float8_e4m3fn
    return {
        "fp8_missing": sorted(set(written) - set(pushed))[:5],
        "fp8_extra": sorted(set(pushed) - set(written))[:5],
        "fp8_not_quantized": sorted(
            n for n in written if n in pushed and (written[n].dtype == fp8) != (pushed[n].dtype == fp8)
        ),
        "fp8_differing": sorted(
            n
            for n in written
            if n in pushed and not torch.equal(bits(pushed[n].to(written[n].dtype)), bits(written[n]))
        )[:5],
        "fp8_quantized": sum(t.dtype == fp8 for t in written.values()),
        "fp8_quantized_experts": sum(".experts." in n and t.dtype == fp8 for n, t in written.items()),
    }


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
