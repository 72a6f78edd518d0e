"""One GRPO step: `miles.train` against TRL's GRPOTrainer on the same model, batch and task.

Both train the same tiny random Qwen3 (float32, CPU, one process) on the synthetic
fixed-answer task with the same reward function, 4 prompts x 8 samples = 32 completions
per optimizer step, at most 32 new tokens, temperature 1, clip 0.2/0.28, no KL term, lr
1e-3, one optimizer step per generation. A step is everything between two optimizer steps:
generation, reward, advantages, logprobs, loss, backward, step (and for miles the weight
sync to its rollout engine). One thread each, TRL first then miles in the same process;
after warm-up steps the median and best step times of each are printed with the ratios. Target: miles >= 1x TRL (steps/s). Needs `pip install trl` (not part of
the lane's pins; this benchmark only).

    python benchmarks/bench_grpo_trl.py [--steps 6] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS, GROUP, NEW_TOKENS, LR = 4, 8, 32, 1e-3


def miles_step_times(model_dir: Path, steps: int, warmup: int) -> list[float]:
    from miles.train import trainer
    from miles.train.args import parse_args
    from miles.train.distributed import shutdown
    from miles.train.runtime import build_run

    argv = [
        "--hf-checkpoint", str(model_dir), "--prompt-data", "synthetic:fixed", "--rm-type", "synthetic",
        "--rollout-engine", "torch", "--num-rollout", str(steps + warmup), "--rollout-batch-size", str(PROMPTS),
        "--n-samples-per-prompt", str(GROUP), "--global-batch-size", str(PROMPTS * GROUP),
        "--micro-batch-size", str(PROMPTS * GROUP), "--rollout-max-response-len", str(NEW_TOKENS),
        "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--lr", str(LR), "--seed", "0",
    ]  # fmt: skip
    run = build_run(parse_args(argv))
    times = []
    try:
        for rollout_id in range(steps + warmup):
            run.start_rollout, run.args.num_rollout = rollout_id, rollout_id + 1
            start = time.perf_counter()
            trainer.train(run)
            times.append(time.perf_counter() - start)
    finally:
        shutdown()
    return times[warmup:]


def trl_step_times(model_dir: Path, steps: int, warmup: int, out_dir: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.train.data import FIXED_ANSWER, synthetic_prompts
    from miles.train.rewards import synthetic_reward

    def reward(completions, **_):
        return [synthetic_reward(c, FIXED_ANSWER) for c in completions]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._start)

    clock = StepClock()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    dataset = Dataset.from_list([{"prompt": p.content} for p in synthetic_prompts("fixed")])
    config = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        gradient_accumulation_steps=1,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        loss_type="grpo",
        max_steps=steps + warmup,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.add_callback(clock)
    trainer.train()
    return clock.times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    import torch

    from miles.ckpt.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)  # steadier on a shared machine; both sides get the same
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            "qwen3", args.layers, Path(tmp) / "qwen3", seed=0, hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
        )  # fmt: skip
        trl = trl_step_times(model_dir, args.steps, args.warmup, Path(tmp) / "trl")
        miles = miles_step_times(model_dir, args.steps, args.warmup)
    m, t = statistics.median(miles), statistics.median(trl)
    print(
        f"tiny qwen3 hidden={args.hidden} layers={args.layers}, {PROMPTS} prompts x {GROUP} samples, "
        f"<= {NEW_TOKENS} new tokens, threads={torch.get_num_threads()}, {args.steps} timed steps"
    )
    print(f"  miles.train GRPO step      {m:.3f} s (median; best {min(miles):.3f})")
    print(f"  TRL GRPOTrainer step       {t:.3f} s (median; best {min(trl):.3f})")
    print(
        f"  ratio miles / TRL (steps/s): {t / m:.2f}x median, {min(trl) / min(miles):.2f}x best (target >= 1x)"
    )


if __name__ == "__main__":
    main()
