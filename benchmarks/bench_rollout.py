"""Rollout throughput: miles' built-in torch engine against transformers' generate().

Same tiny Qwen3 (random weights, float32, CPU), same prompts, same sampling (temperature 1,
no truncation), both returning what an RL rollout needs: sampled tokens and their logprobs
(generate() through output_scores and compute_transition_scores). Tokens/s counts real
response tokens (up to and including the stop token), never padding. Two workloads:

- grpo: 16 prompts x 8 samples each, responses ending at a stop token (16 of the 512 ids
  stop, so lengths vary as in RL rollouts), at most 96 new tokens. This is the workload
  the engine is built for; the target (built-in >= 1.5x generate()) is on this one.
- fixed: 32 distinct prompts, no stop token, exactly 64 new tokens: per-step overhead only.

Runs alternate A/B in one process on one thread; the ratio is printed for the medians and
for the best run of each (the run least disturbed by other work on a shared machine).

    python benchmarks/bench_rollout.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def build_model(workdir: Path, hidden: int, layers: int):
    import torch
    from transformers import AutoModelForCausalLM

    from miles.ckpt.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        "qwen3", layers, workdir / "qwen3", seed=0, hidden_size=hidden, intermediate_size=hidden * 3
    )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def prompts_for(count: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(20, 250) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def run_engine(model, prompts, new_tokens: int, stop: tuple[int, ...]) -> int:
    from miles.train.config import SamplingConfig
    from miles.train.rollout import TorchRolloutEngine

    sampling = SamplingConfig(
        temperature=1.0, top_p=1.0, top_k=-1, max_response_len=new_tokens, stop_token_ids=stop
    )
    gens = TorchRolloutEngine(model).generate(prompts, sampling, seed=0)
    return sum(len(g.response_ids) for g in gens)


def run_generate(model, prompts, new_tokens: int, stop: tuple[int, ...]) -> int:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            eos_token_id=list(stop) or None,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    return sum(_response_len(row[width:].tolist(), stop) for row in out.sequences)


def _response_len(tokens: list[int], stop: tuple[int, ...]) -> int:
    for i, token in enumerate(tokens):
        if token in stop:
            return i + 1
    return len(tokens)


WORKLOADS = {
    # name: (distinct prompts, samples per prompt, prompt lengths, new tokens, stop ids)
    "grpo": (16, 8, (32, 96), 96, tuple(range(3, 19))),
    "fixed": (32, 1, (8, 24), 64, ()),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier on a shared machine; both sides get the same
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.hidden, args.layers)
    model.generation_config.eos_token_id = None  # each workload names its own stop ids
    print(
        f"tiny qwen3 hidden={args.hidden} layers={args.layers} threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    for workload, (count, group, lengths, new_tokens, stop) in WORKLOADS.items():
        prompts = [p for p in prompts_for(count, lengths) for _ in range(group)]
        run_engine(model, prompts[:2], 4, stop), run_generate(model, prompts[:2], 4, stop)  # warm-up
        rates: dict[str, list[float]] = {"built-in": [], "generate()": []}
        for _ in range(args.repeats):
            for name, fn in (("built-in", run_engine), ("generate()", run_generate)):
                start = time.perf_counter()
                tokens = fn(model, prompts, new_tokens, stop)
                rates[name].append(tokens / (time.perf_counter() - start))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        best = {name: max(values) for name, values in rates.items()}
        print(
            f"{workload:5s} ({count} prompts x {group}, <= {new_tokens} new tokens): "
            + ", ".join(f"{name} {medians[name]:.0f} tok/s (best {best[name]:.0f})" for name in rates)
            + f" -> ratio {medians['built-in'] / medians['generate()']:.2f}x median, "
            + f"{best['built-in'] / best['generate()']:.2f}x best"
            + (" (target >= 1.5x)" if workload == "grpo" else "")
        )


if __name__ == "__main__":
    main()
