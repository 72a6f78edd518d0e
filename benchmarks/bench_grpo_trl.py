"""One GRPO step: `miles.train` against TRL's GRPOTrainer on the same model, batch and task.

Both train the same tiny random Qwen3 (float32, CPU, one process) on the synthetic
fixed-answer task with the same reward function, 4 prompts x 8 samples = 32 completions
per optimizer step, at most 32 new tokens, temperature 1, clip 0.2/0.28, no KL term, lr
1e-3, one optimizer step per generation. A step is everything between two optimizer steps:
generation, reward, advantages, logprobs, loss, backward, step (and for miles the weight
sync to its rollout engine). With one optimizer step per generation neither side runs a
separate old-logprob forward: TRL at num_iterations=1, miles because the first minibatch of a
rollout takes its old logprobs from its own training forward (miles.train.trainer.learn).
One thread each, in the same process, in rounds (TRL first, then miles first, ...); after
each round's warm-up steps, the median and best step times of each over all rounds are
printed with the ratios, by the wall clock and by the process's CPU time (on a shared
machine the wall clock also counts other processes' turns; a single-threaded step's CPU time
is its own work). Target: miles >= 1.1x TRL at its fastest (steps/s).

TRL runs twice: as shipped (GRPOConfig's gradient_checkpointing=True, which recomputes the
forward in the backward), and at its fastest for this work: gradient checkpointing off.
Its paged generation (use_transformers_paged) was tried and is ~10x slower on CPU, so it
stays off; neither side uses torch.compile. Needs `pip install trl datasets -c
requirements/cpu.txt` (not part of the lane's pins; this benchmark only).

    python benchmarks/bench_grpo_trl.py [--steps 6] [--warmup 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

PROMPTS, GROUP, NEW_TOKENS, LR = 4, 8, 32, 1e-3
TRL_CONFIGS = {
    "TRL as shipped (gradient_checkpointing=True)": {},
    "TRL fastest (gradient_checkpointing=False)": {"gradient_checkpointing": False},
}


class MilesSteps:
    """miles.train on the benchmark's work, built once; each call times its next rollouts."""

    def __init__(self, model_dir: Path, rollouts: int):
        from miles.train.args import parse_config
        from miles.train.runtime import build_run

        argv = [
            "--hf-checkpoint", str(model_dir), "--prompt-data", "synthetic:fixed", "--rm-type", "synthetic",
            "--rollout-engine", "torch", "--num-rollout", str(rollouts), "--rollout-batch-size", str(PROMPTS),
            "--n-samples-per-prompt", str(GROUP), "--global-batch-size", str(PROMPTS * GROUP),
            "--micro-batch-size", str(PROMPTS * GROUP), "--rollout-max-response-len", str(NEW_TOKENS),
            "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--lr", str(LR), "--seed", "0",
        ]  # fmt: skip
        self.run = build_run(parse_config(argv))
        self.done = 0

    def __call__(self, steps: int, warmup: int) -> list[tuple[float, float]]:
        from miles.train import trainer

        run, times = self.run, []
        for rollout_id in range(self.done, self.done + steps + warmup):
            run.start_rollout = rollout_id
            run.config = replace(run.config, rollout=replace(run.config.rollout, num_rollout=rollout_id + 1))
            start, cpu = time.perf_counter(), time.process_time()
            trainer.train(run)
            times.append((time.perf_counter() - start, time.process_time() - cpu))
        self.done += steps + warmup
        return times[warmup:]


def trl_step_times(
    model_dir: Path, steps: int, warmup: int, out_dir: Path, settings: dict
) -> list[tuple[float, float]]:
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
            self.times, self._start = [], (0.0, 0.0)

        def on_step_begin(self, *a, **k):
            self._start = (time.perf_counter(), time.process_time())

        def on_step_end(self, *a, **k):
            self.times.append((time.perf_counter() - self._start[0], time.process_time() - self._start[1]))

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
        **settings,
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
    parser.add_argument("--rounds", type=int, default=2, help="alternating TRL-first and miles-first")
    args = parser.parse_args()

    import torch

    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.train.distributed import shutdown

    torch.set_num_threads(1)  # steadier on a shared machine; both sides get the same
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            "qwen3", args.layers, Path(tmp) / "qwen3", seed=0, hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
        )  # fmt: skip
        miles_steps = MilesSteps(model_dir, args.rounds * (args.steps + args.warmup))
        trl: dict[str, list] = {name: [] for name in TRL_CONFIGS}
        miles: list[tuple[float, float]] = []
        try:
            # rounds in alternating order, so that a machine that gets busier or quieter during
            # the run weighs on both sides alike
            for r in range(args.rounds):
                if r % 2:
                    miles += miles_steps(args.steps, args.warmup)
                for i, (name, settings) in enumerate(TRL_CONFIGS.items()):
                    out = Path(tmp) / f"trl{r}-{i}"
                    trl[name] += trl_step_times(model_dir, args.steps, args.warmup, out, settings)
                if not r % 2:
                    miles += miles_steps(args.steps, args.warmup)
        finally:
            shutdown()
    print(
        f"tiny qwen3 hidden={args.hidden} layers={args.layers}, {PROMPTS} prompts x {GROUP} samples, "
        f"<= {NEW_TOKENS} new tokens, fp32, threads={torch.get_num_threads()}, {args.rounds} rounds of "
        f"{args.steps} timed steps"
    )
    for clock, k in (("wall clock", 0), ("CPU time", 1)):
        ours = [t[k] for t in miles]
        m = statistics.median(ours)
        print(f" {clock}:")
        print(
            f"  {'miles.train GRPO step (fsdp, torch engine)':46s} {m:.3f} s (median; best {min(ours):.3f})"
        )
        for name, times in trl.items():
            theirs = [t[k] for t in times]
            t = statistics.median(theirs)
            print(
                f"  {name:46s} {t:.3f} s (median; best {min(theirs):.3f})   miles / TRL (steps/s): "
                f"{t / m:.2f}x median, {min(theirs) / min(ours):.2f}x best"
            )


if __name__ == "__main__":
    main()
