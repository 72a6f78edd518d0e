"""On-policy distillation's reward and its post-processing, at the seed framework's module path.

The seed's OPD command names these two functions (radixark/miles 31f1ca961,
tests/e2e/short/test_qwen2.5_0.5B_opd_sglang.py): `--custom-rm-path
miles.rollout.on_policy_distillation.reward_func --custom-reward-post-process-path
miles.rollout.on_policy_distillation.post_process_rewards`, so the same command runs here. The
reward asks the teacher at `--rm-url` about each sample; the post-processing turns the answers into
each sample's scalar reward (0: the teacher's signal is per token) and per-token reverse KL
(miles.train.distillation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles.train.distillation import ScoringRequest, post_json, reverse_kl, score_payload


def reward_func(config, request: ScoringRequest) -> dict[str, Any]:
    """The teacher's answer about one sample (called for every sample of a rollout, concurrently)."""
    algorithm = config.algorithm
    tokens = [*request.prompt_ids, *request.response_ids]
    top_k = algorithm.opd_log_prob_top_k
    if top_k == 0:
        return post_json(config.reward.rm_url, score_payload(tokens))
    asked = {int(i) for position in request.top_logprobs for _, i in position}
    return post_json(
        config.reward.rm_url, score_payload(tokens, top_k=top_k, token_ids_logprob=sorted(asked))
    )


# the trainer calls a reward function with this mark as reward_func(config, request)
reward_func.scores_samples = True


def post_process_rewards(
    config, requests: Sequence[ScoringRequest], answers: Sequence[Mapping[str, Any]]
) -> tuple[list[float], list[list[float]]]:
    """Each sample's scalar reward (0) and its per-token reverse KL to the teacher."""
    algorithm = config.algorithm
    kls = [
        reverse_kl(
            request,
            answer,
            algorithm.opd_log_prob_top_k,
            algorithm.opd_top_k_strategy,
            algorithm.opd_reward_weight_mode,
        )
        for request, answer in zip(requests, answers, strict=True)
    ]
    return [0.0] * len(requests), kls
