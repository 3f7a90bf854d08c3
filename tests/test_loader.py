"""The pair-shard loader: memory-mapped reads, padded collation, the token-budget sampler."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from align.constants import PAIR_LAYOUTS
from align.data.loader import (
    collate_preference,
    collate_shared_prompt,
    make_preference_sampler,
    preference_dataset,
)
from align.data.sampler import TokenBudgetSampler, pack_by_tokens, split_to_multiple
from align.data.shards import (
    PAIR_FORMAT,
    RowWidths,
    layout_rows,
    pack_pairs,
    pair_arrays,
    read_shard,
    write_shard,
)
from align.data.tokenize import TokenizedPair
from align.exit_codes import ConfigError

PAD = 0


def make_pairs(lengths: list[tuple[int, int, int]]) -> list[TokenizedPair]:
    """Pairs with (prompt, chosen, rejected) token counts; token values encode position."""
    return [
        TokenizedPair(
            prompt=[10 + i] * p,
            chosen=[100 + t for t in range(c)],
            rejected=[200 + t for t in range(r)],
            truncated=False,
        )
        for i, (p, c, r) in enumerate(lengths)
    ]


@pytest.fixture
def shard_path(tmp_path):
    pairs = make_pairs([(2, 3, 1), (1, 1, 4), (3, 2, 2), (1, 5, 1), (2, 1, 1)])
    path = tmp_path / "train.safetensors"
    write_shard(path, pair_arrays([50, 51, 52, 53, 54], pairs, PAD), PAIR_FORMAT, split="train")
    return path


def backed_by_mmap(array: np.ndarray) -> bool:
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


def test_shard_tensors_are_memory_mapped_views_of_the_file(shard_path):
    arrays = read_shard(shard_path)
    assert all(backed_by_mmap(a) for a in arrays.values())
    assert not arrays["chosen_ids"].flags.writeable
    expected = load_file(str(shard_path))
    assert arrays.keys() == expected.keys()
    for name, array in expected.items():
        assert arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(arrays[name], array)


def test_read_shard_refuses_a_tensor_dtype_that_is_not_a_token_array(tmp_path):
    path = tmp_path / "floats.safetensors"
    write_shard(path, {"x": np.zeros(3, dtype=np.float32)}, PAIR_FORMAT)
    with pytest.raises(ValueError, match=r"floats.safetensors.*F32"):
        read_shard(path)


def test_collate_preference_pads_chosen_then_rejected_to_the_batch_width(shard_path):
    shard = preference_dataset(shard_path)
    batch = collate_preference(shard.arrays, np.array([1, 3]))
    # pair 1: prompt 1, chosen 1, rejected 4 -> widths 2 and 5; pair 3: 1 + 5 and 1 + 1.
    assert batch.input_ids.shape == (4, 6)
    assert batch.attention_mask.sum(1).tolist() == [2, 6, 5, 2]
    assert batch.loss_mask.sum(1).tolist() == [1, 5, 4, 1]
    assert batch.input_ids[0, :2].tolist() == [11, 100]
    assert batch.input_ids[2, :5].tolist() == [11, 200, 201, 202, 203]
    assert batch.input_ids[0, 2:].eq(PAD).all()
    assert batch.rows.tolist() == [1, 3]
    # Response positions only: the prompt is never scored.
    assert not batch.loss_mask[:, 0].any()


def test_row_widths_are_the_widest_batch_either_layout_collates(shard_path, tmp_path):
    """The memory projection scores rows as wide as these: each layout's collation of the
    whole shard is exactly that wide, over every shard named."""
    arrays = read_shard(shard_path)
    every = np.arange(len(arrays["pair_id"]))
    widths = RowWidths.of([shard_path])
    assert widths.padded == collate_preference(arrays, every).input_ids.shape[1] == 6
    assert widths.shared == collate_shared_prompt(arrays, every).input_ids.shape[1] == 7
    wider = tmp_path / "held.safetensors"
    write_shard(wider, pair_arrays([60], make_pairs([(4, 6, 5)]), PAD), PAIR_FORMAT)
    assert RowWidths.of([shard_path, wider]) == RowWidths(padded=10, shared=15)
    assert RowWidths.of([]) is None


@pytest.mark.parametrize("layout", PAIR_LAYOUTS)
def test_computed_tokens_are_the_positions_a_collated_batch_holds(layout, tmp_path):
    pairs = make_pairs([(2, 3, 1), (2, 1, 4), (3, 2, 2), (1, 5, 1), (2, 1, 1)])
    path = tmp_path / "shared.safetensors"
    write_shard(path, pair_arrays([50, 51, 52, 53, 54], pairs, PAD), PAIR_FORMAT, split="train")
    shard = preference_dataset(path, layout)
    for rows in (np.array([0, 1]), np.array([3]), np.array([4, 2, 0]), np.arange(5)):
        assert shard.computed_tokens(rows) == shard.collate(rows).input_ids.numel(), rows
    assert shard.computed_tokens(np.array([], dtype=np.int64)) == 0


def test_pack_pairs_fills_rows_as_wide_as_the_widest_pair_widest_first():
    widths = np.array([3, 9, 5, 4, 2, 9, 1])
    rows = pack_pairs(widths)
    assert rows == [[1], [5], [2, 3], [0, 4, 6]]
    assert sorted(i for row in rows for i in row) == list(range(len(widths)))
    assert all(widths[row].sum() <= widths.max() for row in rows)
    assert layout_rows(widths, "packed") == 4
    assert layout_rows(widths, "shared") == 7
    assert layout_rows(widths, "padded") == 14


def test_a_packed_batch_keeps_each_pairs_segments_and_positions_its_own(tmp_path):
    pairs = make_pairs([(3, 2, 2), (1, 1, 2), (1, 1, 1)])  # shared widths 7, 4, 3
    arrays = pair_arrays([50, 51, 52], pairs, PAD)
    batch = collate_shared_prompt(arrays, np.arange(3), pack=True)
    # The widest alone; the other two share the second row, in slots 0 and 1.
    assert batch.segment_ids.tolist() == [[1, 1, 1, 2, 2, 3, 3], [1, 2, 3, 3, 4, 5, 6]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4], [0, 1, 1, 2, 0, 1, 1]]
    assert batch.pair_slots.tolist() == [0, 2, 3]  # (row, slot) as row * 2 + slot
    assert batch.num_loss_tokens == collate_preference(arrays, np.arange(3)).num_loss_tokens


def test_a_steps_tokens_are_its_fullest_rank_in_each_micro_step(shard_path):
    """Every rank waits on the one with the widest batch in each micro-step."""
    from align.config import BatchConfig
    from align.data.loader import BatchSource
    from align.data.sampler import StepSampler

    shard = preference_dataset(shard_path)
    batch = BatchConfig(world_size=2, micro_batch=1, grad_accum=2, global_batch=4, epochs=1)
    sources = [BatchSource(shard, StepSampler(len(shard), batch, r, 2)) for r in range(2)]
    for step in range(len(sources[0])):
        per_rank = [[b.input_ids.numel() for b in s.micro_batches(step)] for s in sources]
        expected = sum(max(micro) for micro in zip(*per_rank, strict=True))
        assert sources[0].step_tokens(step) == sources[1].step_tokens(step) == expected


def test_pair_shard_collate_is_collate_preference(shard_path):
    shard = preference_dataset(shard_path)
    rows = np.array([4, 0, 2])
    a, b = shard.collate(rows), collate_preference(shard.arrays, rows)
    assert a.input_ids.equal(b.input_ids) and a.loss_mask.equal(b.loss_mask)


def test_preference_sampler_batches_fit_the_budget_and_cover_the_shard(shard_path):
    shard = preference_dataset(shard_path)
    sampler = make_preference_sampler(shard, max_tokens=14, seed=3)
    widths = shard.pair_widths
    rows = np.concatenate(list(sampler))
    assert sorted(rows.tolist()) == list(range(len(shard)))
    for batch in sampler:
        assert 2 * len(batch) * int(widths[batch].max()) <= 14


def test_preference_sampler_names_the_pair_over_the_budget(shard_path):
    shard = preference_dataset(shard_path)
    # pair 53 is 1 + 5 = 6 tokens wide: 12 padded tokens for chosen and rejected.
    with pytest.raises(ConfigError, match=r"max_tokens=11 cannot hold pair_id 53.*cost 12"):
        make_preference_sampler(shard, max_tokens=11)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "must be positive"),
        ({"max_tokens": 100, "max_rows": 0}, "must be positive"),
        ({"max_tokens": 100, "rank": 2, "world_size": 2}, "rank 2 is outside"),
        ({"max_tokens": 100, "world_size": 4}, "3 pairs cannot feed 4 ranks"),
    ],
)
def test_token_budget_sampler_refuses_impossible_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TokenBudgetSampler(np.array([3, 4, 5]), **kwargs)


def test_pack_by_tokens_starts_a_batch_when_the_widest_row_would_overflow():
    widths = np.array([2, 2, 2, 6, 1])
    batches = pack_by_tokens(np.arange(5), widths, max_tokens=12, max_rows=None)
    # [2, 2, 2] costs 2 x 3 x 2 = 12; adding width 6 would cost 48.
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3], [4]]


def test_pack_by_tokens_honours_max_rows():
    batches = pack_by_tokens(np.arange(5), np.ones(5, int), max_tokens=1000, max_rows=2)
    assert [len(b) for b in batches] == [2, 2, 1]


def test_split_to_multiple_splits_the_largest_batches():
    batches = [np.arange(0, 4), np.arange(4, 5), np.arange(5, 7)]
    split = split_to_multiple(batches, 4)
    assert len(split) == 4
    assert sorted(np.concatenate(split).tolist()) == list(range(7))
    assert [len(b) for b in split] == [2, 2, 1, 2]


def test_split_to_multiple_refuses_when_no_batch_can_be_split():
    with pytest.raises(ConfigError, match="2 pairs packed into 2 token-budget batches"):
        split_to_multiple([np.array([0]), np.array([1])], 3)


@settings(max_examples=60, deadline=None)
@given(
    widths=st.lists(st.integers(1, 40), min_size=4, max_size=120),
    budget_extra=st.integers(0, 400),
    max_rows=st.one_of(st.none(), st.integers(1, 9)),
    world_size=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_every_pair_exactly_once_per_epoch_across_ranks(
    widths, budget_extra, max_rows, world_size, seed
):
    widths = np.array(widths)
    max_tokens = 2 * int(widths.max()) + budget_extra
    samplers = [
        TokenBudgetSampler(
            widths,
            max_tokens=max_tokens,
            max_rows=max_rows,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        for rank in range(world_size)
    ]
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        try:
            per_rank = [list(sampler) for sampler in samplers]
        except ConfigError:
            # Refused only when splitting batches cannot reach a multiple of the ranks.
            packed = len(samplers[0].packed_batches(epoch))
            assert len(widths) < -(-packed // world_size) * world_size
            continue
        assert len({len(batches) for batches in per_rank}) == 1
        seen = [int(r) for batches in per_rank for batch in batches for r in batch]
        assert sorted(seen) == list(range(len(widths)))
        for batches in per_rank:
            for batch in batches:
                assert len(batch) >= 1
                assert 2 * len(batch) * int(widths[batch].max()) <= max_tokens
                assert max_rows is None or len(batch) <= max_rows


def test_token_budget_order_is_fixed_by_seed_and_reshuffled_per_epoch():
    widths = np.random.default_rng(0).integers(1, 64, size=200)

    def batches(seed: int, epoch: int) -> list[list[int]]:
        return [
            b.tolist()
            for b in TokenBudgetSampler(widths, max_tokens=512, seed=seed).epoch_batches(epoch)
        ]

    assert batches(1, 0) == batches(1, 0)
    assert batches(1, 0) != batches(1, 1)
    assert batches(1, 0) != batches(2, 0)


def test_sorting_within_windows_pads_less_than_the_shuffled_order():
    widths = np.random.default_rng(1).integers(1, 256, size=2000)
    sampler = TokenBudgetSampler(widths, max_tokens=4096, max_rows=16, seed=0)

    def padding(batches: list[np.ndarray]) -> int:
        return sum(int(len(b) * widths[b].max() - widths[b].sum()) for b in batches)

    shuffled = pack_by_tokens(np.random.default_rng(0).permutation(2000), widths, 4096, 16)
    assert padding(sampler.epoch_batches(0)) < padding(shuffled) / 4
