"""One rank of the FSDP load/export comparison (run by torchrun from test_train_fsdp_shards.py).

    python -m torch.distributed.run --nproc-per-node 2 fsdp_shards_worker.py '[[HF_DIR, OUT_DIR], ...]'

Builds the FSDP backend from a trainer command (its sharded load: empty model, rank 0 reads,
tensor by tensor broadcast) and, beside it, the model as the backend built it before: every
rank loading the whole checkpoint and sharding it. Writes, per rank, `state.pt`: the full state
of both (gathered) and both exports in bf16 and by checkpoint name: the new one tensor by
tensor, the old one as the whole gathered state dict cast afterwards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def main() -> None:
    from miles.train.distributed import init_distributed

    dist_info = init_distributed("gloo")
    for hf, out in json.loads(sys.argv[1]):
        compare(hf, Path(out), dist_info)
    dist.destroy_process_group()


def compare(hf: str, out: Path, dist_info) -> None:
    from miles.train.args import parse_config
    from miles.train.backends import make_backend
    from miles.train.backends.torch_dp import checkpoint_names
    from miles.train.model import load_causal_lm

    config = parse_config(["--hf-checkpoint", hf, "--train-backend", "fsdp", "--actor-num-gpus-per-node", "2",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"])  # fmt: skip
    backend = make_backend(config, dist_info)
    before = load_causal_lm(hf, dtype=torch.float32)  # the earlier load: whole on every rank, then sharded
    backend._shard(before)
    full = StateDictOptions(full_state_dict=True)
    result = {
        "state": get_model_state_dict(backend.model, options=full),
        "state_before": get_model_state_dict(before, options=full),
        "export": _streamed(backend.full_weights(names="checkpoint", dtype=torch.bfloat16)),
        "export_model_names": _streamed(backend.full_weights(names="model", dtype=torch.bfloat16)),
        "buffers": dict(backend.model.named_buffers()),
        "buffers_before": dict(before.named_buffers()),
        "tied": _tied(backend.model),
        "tied_before": _tied(before),
        "logits": _logits(backend.model),
        "logits_before": _logits(before),
    }
    old = get_model_state_dict(before, options=full)  # the earlier export: everything gathered, then named
    result["export_before_model_names"] = {k: _cast(v) for k, v in old.items()}
    result["export_before"] = {k: _cast(v) for k, v in checkpoint_names(before, old).items()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"state-{dist.get_rank()}.pt")
    dist.barrier()


def _streamed(stream) -> dict:
    """What an engine receives from `stream`: each name with its tensor, copied as it comes, and
    `held`: the most bytes of tensors handed out earlier that the exporter still kept alive at a
    yield (an exporter that gathers everything first keeps the whole model; the experts split
    from one fused tensor stay alive together until the last of them is handed out)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    names, tensors, earlier, held = [], [], [], 0
    for name, tensor in stream:
        # weak references to the memory itself: a view or a detached copy of a kept tensor keeps it
        alive = {ptr: size for ref, ptr, size in earlier if not ref.expired()}
        held = max(held, sum(alive.values()))
        storage = tensor.untyped_storage()
        earlier.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        names.append(name)
        tensors.append(tensor.clone())
        del tensor, storage
    return {"names": names, "tensors": dict(zip(names, tensors, strict=True)), "held": held}


def _cast(tensor: torch.Tensor) -> torch.Tensor:
    """What a bf16 engine makes of a tensor it is given: floats in bf16, integers as they are."""
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor


def _logits(model) -> torch.Tensor:
    """The model's logits on a fixed sequence (the forward every rank runs together)."""
    ids = torch.arange(3, 19).reshape(2, 8) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _tied(model) -> list[tuple[str, str]]:
    """Pairs of parameter names that are one parameter (tied embeddings)."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((first[id(param)], name))
        first.setdefault(id(param), name)
    return pairs


if __name__ == "__main__":
    main()
