"""What a random draw depends on (rule 15): the training stream (dropout) on (seed, step, rank), an
augmentation on (seed, epoch, sample index); never on where a batch was loaded, nor on the rank, the
micro-batch or the world size that loads a sample."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from helpers import ROOT, NoisyDigits, dropout_masks, run_in_process
from trainkit.dist import Dist
from trainkit.loading import InMemory, TrainLoader

CPU = Dist(0, 0, 1, torch.device("cpu"))

# An lm run with dropout, 6 steps of a global batch 16 (a short 2-layer GPT), a checkpoint at step 3.
DROPOUT_LM = [
    "+experiment=addition_gpt",
    "data.num_train=96",
    "data.num_val=8",
    "data.batch_size=16",
    "model.dropout=0.1",
    "trainer.max_steps=6",
    "trainer.eval_every=1000",
    "trainer.log_every=3",
    "checkpoint.every=3",
    "sched.warmup_steps=0",
]


def train_lm(run_dir: Path, *overrides: str) -> dict:
    return train_with(run_dir, *DROPOUT_LM, *overrides)


def train_with(run_dir: Path, *overrides: str) -> dict:
    from train import train

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    run_dir.mkdir(parents=True, exist_ok=True)
    train(cfg, CPU, "single", run_dir)
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def no_workers(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("workers0")
    train_lm(run_dir, "data.num_workers=0")
    return run_dir


def test_loader_workers_change_nothing_dropout_included(no_workers, tmp_path):
    expected = torch.load(no_workers / "model.pt", weights_only=True)
    got = train_lm(tmp_path, "data.num_workers=2", "data.prefetch_factor=3", "data.pin_memory=false")
    print(f"max |weights(2 workers) - weights(0 workers)| {max_diff(got, expected):.2e}")
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_dropout_beside_an_augmentation_draws_the_same_with_and_without_loader_workers(tmp_path):
    """Loading in this process re-seeds the generators per sample of a data set that draws (NoisyDigits); workers
    do that in their own processes. Dropout draws the same either way because every step re-seeds its stream
    (rng.seed_step): without it in train.bare_step, the default step, the weights differ (planted, seen)."""
    augmented = ["data.splits._target_=helpers.noisy_digits", "model.dropout=0.3", "data.batch_size=64"]
    short = ["trainer.max_steps=3", "trainer.eval_every=1000", "trainer.test=false", "checkpoint.every=0"]
    inline, workers = (train_with(tmp_path / str(n), *augmented, *short, f"data.num_workers={n}") for n in (0, 2))
    for key in inline:
        assert torch.equal(workers[key], inline[key]), key


def test_a_resume_that_switches_to_loader_workers_is_exact(no_workers, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    name = "step_00000003.pt"
    (tmp_path / "checkpoints" / name).write_bytes((no_workers / "checkpoints" / name).read_bytes())
    got = train_lm(tmp_path, "data.num_workers=2")
    expected = torch.load(no_workers / "model.pt", weights_only=True)
    print(f"max |weights(resumed 0 -> 2 workers) - weights(uninterrupted)| {max_diff(got, expected):.2e}")
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def blank_digits_loader(rank: int, num_workers: int) -> TrainLoader:
    """NoisyDigits over blank images: what a batch holds is its augmentation draws alone."""
    blank = NoisyDigits(InMemory(torch.zeros(40, 1, 8, 8), torch.zeros(40, dtype=torch.long)))
    return TrainLoader(blank, Dist(rank, rank, 2, torch.device("cpu")), 4, num_workers, seed=0, micro_batches=5)


def test_the_two_ranks_augment_differently_wherever_they_load():
    for num_workers in (0, 2):
        rank_0, rank_1 = (list(blank_digits_loader(rank, num_workers).epoch(1)) for rank in (0, 1))
        for (x0, _), (x1, _) in zip(rank_0, rank_1, strict=True):
            assert x0.abs().sum() > 0 and not torch.allclose(x0, x1), num_workers  # micro-batch j differs
    # ... and draw the same wherever the batches are loaded.
    for rank in (0, 1):
        main, workers = (list(blank_digits_loader(rank, n).epoch(1)) for n in (0, 2))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(main, workers, strict=True))


def augmented_samples(world_size: int, batch_size: int, num_workers: int, epoch: int = 1) -> dict[int, torch.Tensor]:
    """Sample index -> its augmented image, as the ranks of a world size load epoch `epoch` (each
    sample's label is its index: NoisyDigits over blank images, so an image is its draws alone)."""
    blank = NoisyDigits(InMemory(torch.zeros(37, 1, 8, 8), torch.arange(37)))
    samples: dict[int, torch.Tensor] = {}
    for rank in range(world_size):
        d = Dist(rank, rank, world_size, torch.device("cpu"))
        loader = TrainLoader(blank, d, batch_size, num_workers, seed=0, micro_batches=0)  # no empty batches
        for x, index in loader.epoch(epoch):
            samples.update(zip(index.tolist(), x, strict=True))
    return samples


def test_a_sample_is_augmented_the_same_by_any_rank_world_size_micro_batch_or_worker():
    # Rule 16: 2 ranks x K2 x b8 and 1 x K4 x b8 must train on the same augmented samples, and a
    # resume on another world size draw what the uninterrupted run drew.
    expected = augmented_samples(1, 8, 0)
    assert sorted(expected) == list(range(37)) and all(x.abs().sum() > 0 for x in expected.values())
    for world_size, batch_size, num_workers in ((2, 8, 0), (2, 3, 2), (3, 5, 0), (1, 4, 2)):
        got = augmented_samples(world_size, batch_size, num_workers)
        assert got.keys() == expected.keys(), (world_size, batch_size, num_workers)
        for i in expected:
            assert torch.equal(got[i], expected[i]), (world_size, batch_size, num_workers, i)
    # ... and another epoch draws anew for every sample.
    other = augmented_samples(1, 8, 0, epoch=2)
    assert not any(torch.equal(other[i], expected[i]) for i in expected)


def test_only_a_data_set_that_may_draw_is_seeded_per_sample():
    from trainkit.loading import draws_random

    class Declared(NoisyDigits):
        draws_random = False  # wrongly, to see it believed: the loader seeds nothing for it

    data = InMemory(torch.zeros(8, 1, 8, 8), torch.arange(8))
    assert not draws_random(data) and draws_random(NoisyDigits(data))  # a data set that does not say: it may

    def twice(dataset) -> list[torch.Tensor]:  # epoch 0 loaded twice, the global RNG going on between
        loader = TrainLoader(dataset, CPU, 4, 0, seed=0, micro_batches=0)
        return [torch.cat([x for x, _ in loader.epoch(0)]) for _ in range(2)]

    assert torch.equal(*twice(NoisyDigits(data)))  # seeded per sample
    assert not torch.equal(*twice(Declared(data)))  # not seeded: whatever the global RNG holds


# 2 ranks x K2 x b8 against 1 process x K4 x b8 on randomly augmented digits (an mlp without dropout):
# the same global batches of the same augmented samples, so the same weights (rule 16).
AUGMENTED = [
    "data.splits._target_=helpers.noisy_digits",
    "optim=sgd",  # an equivalence: SGD (tests/helpers.py)
    "data.batch_size=8",
    "model.width=32",
    "trainer.max_steps=6",
    "trainer.log_every=3",
    "trainer.eval_every=1000",
    "checkpoint.every=1000",
]


def test_augmented_training_is_world_size_invariant(tmp_path):
    run_in_process(tmp_path / "one", *AUGMENTED, "accumulation.steps=4")
    run_in_process(tmp_path / "two", *AUGMENTED, "accumulation.steps=2", nproc=2)
    one, two = (torch.load(tmp_path / run / "model.pt", weights_only=True) for run in ("one", "two"))
    print(f"max |weights(2 x K2 x b8) - weights(1 x K4 x b8)| {max_diff(one, two):.2e}")
    for key in one:  # SGD: reduction-order rounding alone, 7.5e-9 measured; 1e-5 is ~1000x that
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-5, msg=key)


def test_the_training_stream_is_seeded_by_seed_step_and_rank_alone():
    from trainkit.rng import seed_step, step_seed

    seeds = {step_seed(seed, step, rank) for seed in (0, 1) for step in range(1000) for rank in range(8)}
    assert len(seeds) == 2 * 1000 * 8 and max(seeds) < 2**63  # ranks and steps draw differently
    draws = []
    for _ in range(2):
        torch.rand(5)  # whatever was drawn before: the step's draws are the same
        seed_step(0, 7, 1, torch.device("cpu"))
        draws.append(torch.rand(3))
    assert torch.equal(*draws)


def test_the_step_seeds_table_holds_mix_of_seed_step_and_rank():
    """step_seed reads a table computed in numpy's uint64 (STEPS at a time): the seeds of _mix, the reference,
    across the table's blocks, for any valid seed and rank."""
    from trainkit.config import MAX_SEED
    from trainkit.rng import STEPS, _mix, step_seed

    for seed in (0, 1, 12345, MAX_SEED, MAX_SEED + 7):
        for rank in (0, 1, 63):
            for step in (0, 1, 2, STEPS - 1, STEPS, STEPS + 1, 3 * STEPS + 17, 10**7 + 3):
                assert step_seed(seed, step, rank) == _mix(seed, step, rank), (seed, step, rank)


# 2 ranks of train.py, an mlp with dropout in each of its 2 hidden layers, K=2, 4 optimizer steps. The
# call is what is tested, not step_seed's values: train.py's seed_step with the rank replaced by 0 fails
# the first loop below (planted, seen), with the step replaced by 0 the second.
DROPOUT_RANKS = [
    "model.width=16",
    "model.dropout=0.5",
    "data.batch_size=8",
    "accumulation.steps=2",
    "trainer.max_steps=4",
    "trainer.eval_every=1000",
    "checkpoint.every=0",
    "parallel=ddp",
]


def test_the_ranks_draw_different_dropout_masks_at_every_step_and_each_rank_anew_at_each_step(tmp_path):
    ranks = dropout_masks(tmp_path, *DROPOUT_RANKS, nproc=2)
    steps, per_step = 4, 2 * 2  # K=2 micro-steps x 2 dropout layers a step
    assert [len(masks) for masks in ranks] == [steps * per_step] * 2
    # What one rank draws in step s: its K micro-steps' masks of both layers, as one vector of 512 bits.
    draws = [
        [torch.cat([m.flatten() for m in masks[s * per_step : (s + 1) * per_step]]) for s in range(steps)]
        for masks in ranks
    ]
    assert all(0.3 < d.float().mean() < 0.7 for rank in draws for d in rank)  # p=0.5: real draws
    for s in range(steps):  # the ranks differ at every step (seeded with the rank) ...
        assert not torch.equal(draws[0][s], draws[1][s]), f"ranks 0 and 1 drew the same dropout masks at step {s}"
    for r, rank in enumerate(draws):  # ... and each rank draws anew at every step (seeded with the step)
        for s in range(steps):
            for t in range(s):
                assert not torch.equal(rank[s], rank[t]), f"rank {r} drew the same dropout masks at steps {t} and {s}"


def test_a_resume_that_cannot_be_exact_is_refused_naming_the_setting(no_workers, tmp_path):
    from trainkit.config import ConfigError

    (tmp_path / "checkpoints").mkdir()
    name = "step_00000003.pt"
    (tmp_path / "checkpoints" / name).write_bytes((no_workers / "checkpoints" / name).read_bytes())
    with pytest.raises(ConfigError, match="written with data.drop_last=False, this run has data.drop_last=True"):
        train_lm(tmp_path, "data.drop_last=true")


def test_every_valid_seed_seeds_every_rank():
    # seed + rank passes numpy's 2**32 - 1 for the largest seed on rank 1: it must still seed (the
    # crash was rank 1's alone), and differently from rank 0.
    from trainkit.config import MAX_SEED
    from trainkit.rng import seed_all

    draws = []
    for rank in (0, 1):
        seed_all(MAX_SEED + rank)
        draws.append((torch.rand(2), np.random.rand(2)))
    assert not torch.equal(draws[0][0], draws[1][0]) and not np.array_equal(draws[0][1], draws[1][1])
