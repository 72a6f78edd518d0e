"""How a step's samples are dealt to data-parallel ranks and cut into micro-batches (miles.train.micro_batches)."""

from __future__ import annotations

import random

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.micro_batches import Batching, Geometry, cut, deal, padded_tokens, split_minibatch

register_cpu_ci(est_time=1, suite="stage-a-cpu")

LENGTHS = [random.Random(7).randint(5, 120) for _ in range(64)]


def _padded(lengths, micro):
    return [padded_tokens(lengths, rows, Geometry()) for rows in micro]


def test_a_token_budget_counts_each_micro_batch_padded_to_its_widest_row():
    dynamic = Batching(micro_batch_size=1, dynamic=True, max_tokens=400)
    # 300 + 200 + 100 real tokens, but [200, 100] pads to 2 x 200 = 400
    assert cut([100, 200, 300], dynamic, Geometry()) == [[2], [0, 1]]
    assert cut([100, 200, 300], Batching(1, dynamic=True, max_tokens=399), Geometry()) == [[2], [1], [0]]


def test_dynamic_micro_batches_hold_every_row_once_within_the_budget():
    batching = Batching(micro_batch_size=1, dynamic=True, max_tokens=256)
    micro = cut(LENGTHS, batching, Geometry())
    assert sorted(i for rows in micro for i in rows) == list(range(len(LENGTHS)))
    assert max(_padded(LENGTHS, micro)) <= 256
    # longest first, each as full as the budget allows: no two neighbours would fit in one
    assert len(micro) < len(LENGTHS) / 2


def test_a_row_longer_than_the_budget_runs_alone():
    micro = cut([10, 500, 20], Batching(1, dynamic=True, max_tokens=100), Geometry())
    assert micro == [[1], [0, 2]]


def test_the_budget_is_per_context_parallel_rank_and_counts_the_sequence_multiple():
    lengths = [31, 31, 31, 31]
    batching = Batching(1, dynamic=True, max_tokens=62)
    assert cut(lengths, batching, Geometry()) == [[0, 1], [2, 3]]  # 2 x 31 <= 62
    assert cut(lengths, batching, Geometry(seq_multiple=4)) == [[0], [1], [2], [3]]  # 2 x 32 > 62
    assert cut(lengths, batching, Geometry(seq_multiple=4, context_parallel=2)) == [
        [0, 1, 2],
        [3],
    ]  # 3 x 32 <= 124


def test_fixed_size_micro_batches_keep_their_order_and_the_budget_is_a_ceiling():
    assert cut(list(range(1, 8)), Batching(micro_batch_size=3), Geometry()) == [[0, 1, 2], [3, 4, 5], [6]]
    capped = cut([50, 10, 10, 50], Batching(micro_batch_size=4, max_tokens=100), Geometry())
    assert max(_padded([50, 10, 10, 50], capped)) <= 100
    assert sorted(i for rows in capped for i in rows) == [0, 1, 2, 3]


def test_one_shared_shape_makes_the_budget_a_number_of_rows():
    geometry = Geometry(shared_shape=True)
    micro = cut([10, 40, 20, 30, 5], Batching(1, dynamic=True, max_tokens=100), geometry)
    assert micro == [[0, 1], [2, 3], [4]]  # every micro-batch is 40 wide: 2 rows fit
    assert cut([10, 40, 20], Batching(micro_batch_size=3, max_tokens=80), geometry) == [[0, 1], [2]]


@pytest.mark.parametrize("balance", [False, True])
def test_every_rank_derives_the_same_count_and_together_they_hold_the_minibatch(balance):
    batching = Batching(micro_batch_size=1, dynamic=True, max_tokens=200, balance=balance)
    splits = [split_minibatch(LENGTHS, rank, 4, batching, Geometry()) for rank in range(4)]
    assert len({len(micro) for _, micro in splits}) == 1
    assert sorted(i for rows, _ in splits for i in rows) == list(range(len(LENGTHS)))
    for rows, micro in splits:
        assert len(rows) == len(LENGTHS) // 4
        assert sorted(i for part in micro for i in part) == list(range(len(rows)))
        assert max(_padded([LENGTHS[i] for i in rows], micro)) <= 200


def test_balance_data_evens_the_ranks_token_totals_at_equal_sample_counts():
    lengths = [100] * 8 + [10] * 8  # in turn, rank 0 would take every long one
    strided = deal(lengths, 2, balance=False)
    balanced = deal(lengths, 2, balance=True)
    assert strided == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert [len(rows) for rows in balanced] == [8, 8]
    totals = [sum(lengths[i] for i in rows) for rows in balanced]
    assert totals == [440, 440]
    spread = [sum(LENGTHS[i] for i in rows) for rows in deal(LENGTHS, 4, balance=True)]
    assert max(spread) - min(spread) <= max(LENGTHS)


def test_without_a_budget_the_split_is_the_fixed_one_of_every_rank_in_turn():
    rows, micro = split_minibatch(LENGTHS[:16], 1, 2, Batching(micro_batch_size=3), Geometry())
    assert rows == list(range(1, 16, 2))
    assert micro == [[0, 1, 2], [3, 4, 5], [6, 7]]


# --- the flags --------------------------------------------------------------------------


def test_dynamic_batch_size_needs_a_budget_and_no_micro_batch_size(capsys):
    from miles.train.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", "m", "--use-dynamic-batch-size"])
    assert "no --max-tokens-per-gpu was given; e.g. --max-tokens-per-gpu 8192" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", "m", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--micro-batch-size", "2"])  # fmt: skip
    assert "--micro-batch-size 2 has no effect with --use-dynamic-batch-size" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["fsdp", "ddp", "megatron"])
def test_the_batching_flags_act_on_every_backend(backend, tmp_path):
    from miles.train.args import parse_config
    from miles.train.consumption import flags_without_effect

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2}')
    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--balance-data"]
    config = parse_config(["--hf-checkpoint", str(tmp_path), "--train-backend", backend, *flags])
    assert flags_without_effect(config, "torch") == []


# --- megatron's micro-batches -----------------------------------------------------------


def test_megatron_pads_each_micro_batch_to_its_own_widest_row():
    import torch

    from miles.megatron.loss import micro_batches
    from miles.train.batch import TokenBatch

    lengths = [9, 3, 4, 14]
    ids = torch.zeros(4, 14, dtype=torch.long)
    attention = torch.tensor([[1] * n + [0] * (14 - n) for n in lengths])
    batch = TokenBatch(ids, attention, torch.zeros(4, 13), torch.zeros(4), torch.zeros(4, 13))
    parts = [batch.rows([1, 2]), batch.rows([0, 3]), batch.rows(slice(0, 0))]
    shapes = [tuple(mb.tokens.shape) for mb in micro_batches(parts, 4, "cpu")]
    assert shapes == [(2, 4), (2, 16), (1, 4)]  # widths 4 and 14 rounded up to 4; an empty one is one row
    shared = [tuple(mb.tokens.shape) for mb in micro_batches(parts, 4, "cpu", shape=(2, 16))]
    assert shared == [(2, 16)] * 3
