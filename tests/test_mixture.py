"""Weighted data mixtures (data/mixture.py): the blend's arithmetic, the sampler's global
position under resumes and changed weights, check-config's lines, and one real run: a 3:1
mixture trained on 2 processes, resumed on 1, against the same run uninterrupted."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import yaml

from conftest import DEMO, assert_same_curve, cli, read_metrics, tiny_config, torchrun
from llmtrain.config import load_config
from llmtrain.data.mixture import BLEND_ROWS, Mixture, MixtureSampler, blend, open_mixture, open_sources

STORIES = (DEMO / "stories.txt").read_text().splitlines(keepends=True)


def mixture_config(**train) -> dict:
    """3 parts big (3,000 stories) to 1 part small (20 stories: its ~18 samples repeat within the
    run), the small one with a validation file of its own; a constant lr, so that a run cut
    short at max_steps 8 trains its steps as the 16-step run does."""
    cfg = tiny_config(train={"max_steps": 16, "lr_schedule": "constant", "checkpoint_every": 8, **train})
    del cfg["data"]["dataset"]
    cfg["data"]["mixture"] = [{"dataset": "big.txt", "weight": 3},
                              {"dataset": "small.txt", "weight": 1, "validation": "small-val.txt",
                               "validation_fraction": 0}]
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMTRAIN_HOME", str(root / "home"))
    (root / "big.txt").write_text("".join(STORIES[:3000]))
    (root / "small.txt").write_text("".join(STORIES[3000:3020]))
    (root / "small-val.txt").write_text("".join(STORIES[3020:3040]))
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(mixture_config()))
    try:
        cli("prepare", "--config", config, check=True)
        yield root, config
    finally:
        mp.undo()


# ---------------------------------------------------------------------------------------------
# The blend (no data)


@pytest.mark.parametrize("weights", [[3, 1], [5, 3, 2], [0.7, 0.2, 0.05, 0.05]])
def test_every_prefix_of_the_blend_holds_each_source_within_one_sample_of_its_share(weights):
    w = np.array(weights, dtype=float) / sum(weights)
    sources = blend(w, 2000, np.zeros(len(w)))
    counts = np.cumsum(np.eye(len(w), dtype=int)[sources], axis=0)  # after 1, 2, ... samples
    expected = np.outer(np.arange(1, 2001), w)
    assert np.abs(counts - expected).max() < 1
    if list(weights) == [3, 1]:  # exact every 4 samples
        assert (counts[3::4] == np.outer(np.arange(1, 501), [3, 1])).all()


def test_the_blend_continues_from_what_was_drawn():
    w = np.array([0.5, 0.3, 0.2])
    whole = blend(w, 300, np.zeros(3))
    drawn = np.bincount(whole[:137], minlength=3)
    assert (blend(w, 163, drawn) == whole[137:]).all()


def test_a_tie_goes_to_the_first_source():
    assert blend(np.full(3, 1 / 3), 7, np.zeros(3)).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert blend(np.array([0.5, 0.5]), 3, [1, 0]).tolist() == [1, 0, 1]


def reference_blend(weights, n: int, drawn) -> list[int]:
    """The rule as the module states it, sample by sample over every source: argmax_k
    w_k * (g + 1) - n_k, the first of equal errors."""
    w, drawn = [float(x) for x in weights], [int(d) for d in drawn]
    out = []
    for g in range(sum(drawn), sum(drawn) + n):
        k = max(range(len(w)), key=lambda k: w[k] * (g + 1) - drawn[k])
        out.append(k)
        drawn[k] += 1
    return out


def weights_to_test(rng) -> list[np.ndarray]:
    """Random weights, and weights made of exact ties: equal, powers of two, small integers."""
    cases = [rng.random(7), rng.random(40) ** 4, rng.dirichlet(np.full(300, 0.2)), np.ones(50),
             2.0 ** -rng.integers(0, 5, 12), rng.integers(1, 4, 30).astype(float), np.array([3.0, 1.0]),
             np.array([5.0, 3.0, 2.0]), np.array([0.7, 0.2, 0.05, 0.05]), np.ones(1)]
    return [w / w.sum() for w in cases]


def test_the_blend_is_the_largest_error_rule_step_after_step_with_ties_and_a_weight_change():
    rng = np.random.default_rng(7)
    for w in weights_to_test(rng):
        for batch in (1, 37, BLEND_ROWS, 3 * BLEND_ROWS + 5):  # within one block of samples, and across
            expected = reference_blend(w, 6 * batch, np.zeros(len(w)))
            drawn, got = np.zeros(len(w), dtype=np.int64), []
            for _ in range(6):  # the sampler's way: step after step, counting on from what was drawn
                step = blend(w, batch, drawn)
                drawn += np.bincount(step, minlength=len(w))
                got += step.tolist()
            assert got == expected, (len(w), batch)
        # New weights from here: the rule starts over from the position they took over at.
        other = rng.random(len(w))
        other /= other.sum()
        assert blend(other, 300, np.zeros(len(w))).tolist() == reference_blend(other, 300, np.zeros(len(w)))


def test_the_blend_of_a_thousand_sources_is_the_rule_mid_run():
    rng = np.random.default_rng(8)
    w = rng.random(1000)
    w /= w.sum()
    drawn = np.bincount(blend(w, 20_000, np.zeros(1000)), minlength=1000)  # 20 samples a source drawn
    assert blend(w, 600, drawn).tolist() == reference_blend(w, 600, drawn)


# ---------------------------------------------------------------------------------------------
# The sampler over real prepared sources


def sampler_for(config, world_size: int = 1, rank: int = 0, **sets) -> MixtureSampler:
    cfg = load_config(config, [f"{k}={v}" for k, v in sets.items()], world_size=1)
    return open_mixture(cfg, open_sources(cfg), cfg.train.global_batch_size, rank, world_size)[2]


def test_steps_are_the_same_on_any_world_size_and_each_source_runs_through_its_own_epochs(setup):
    _, config = setup
    one = sampler_for(config)
    steps = [one.next_global() for _ in range(40)]
    for rank in range(2):  # each rank of two reads its half of the same global batch
        two = sampler_for(config, world_size=2, rank=rank)
        assert all((two.next_step() == s[rank * 4:(rank + 1) * 4]).all() for s in steps)

    data = one.data
    drawn = np.concatenate(steps)
    source = data.source_of(drawn)
    assert np.bincount(source).tolist() == [240, 80]  # 3:1
    small = drawn[source == 1] - data.offsets[1]
    size = int(data.sizes[1])
    assert size < 80  # the small source repeats: every epoch is all of its samples, in a new order
    epochs = [small[i:i + size] for i in range(0, 80, size)]
    assert all(sorted(e) == list(range(len(e))) or len(e) < size for e in epochs)
    assert sorted(epochs[0]) == list(range(size)) and not (epochs[0] == epochs[1]).all()
    assert one.source_epochs()["small"] == round(80 / size, 4)


def test_a_resume_continues_the_same_samples_and_changed_weights_continue_each_source(setup):
    _, config = setup
    whole = sampler_for(config)
    steps = [whole.next_global() for _ in range(20)]
    cut = sampler_for(config)
    for _ in range(7):
        cut.next_global()
    resumed = sampler_for(config, world_size=2)
    resumed.state.load_state_dict(cut.state.state_dict())
    assert resumed.state.changed is None
    assert all((np.concatenate([resumed.share(s := resumed.next_global()), s[4:]]) == steps[i]).all()
               for i in range(7, 20))

    # Weights 1:1 from step 7: each source goes on with its next unread sample, and the new shares
    # hold from there.
    sets = {"data.mixture": '[{dataset: big.txt, weight: 1}, {dataset: small.txt, weight: 1, '
                            'validation: small-val.txt, validation_fraction: 0}]'}
    changed = sampler_for(config, **sets)
    changed.state.load_state_dict(cut.state.state_dict())
    assert changed.state.changed == {"big": 0.75, "small": 0.25}
    after = np.concatenate([changed.next_global() for _ in range(10)])
    source = changed.data.source_of(after)
    assert np.bincount(source).tolist() == [40, 40]
    before = np.concatenate(steps[:7])
    for k, name in enumerate(["big", "small"]):  # the first samples after the change are the ones
        ahead = sampler_for(config)                # the unchanged run would have read next from it
        ahead.state.load_state_dict(cut.state.state_dict())
        expected = np.concatenate([ahead.next_global() for _ in range(40)])
        expected = expected[ahead.data.source_of(expected) == k][:5]
        assert (after[source == k][:5] == expected).all(), name
        assert cut.state.counts[name] == (ahead.data.source_of(before) == k).sum()


def reference_steps(data: Mixture, weights, batch: int, seed: int, counts: list[int], since: list[int]):
    """Steps as the module describes them, literally: each sample's source by the rule, then that
    source's next sample through its epochs (epoch e a seeded permutation, read front to back)."""
    w, perms = [x / sum(weights) for x in weights], {}
    while True:
        step = []
        for k in reference_blend(w, batch, [c - s for c, s in zip(counts, since)]):
            epoch, at = divmod(counts[k], int(data.sizes[k]))
            if (k, epoch) not in perms:
                rng = np.random.default_rng([seed, zlib.crc32(data.names[k].encode()), epoch])
                perms[k, epoch] = rng.permutation(int(data.sizes[k]))
            step.append(int(data.offsets[k] + perms[k, epoch][at]))
            counts[k] += 1
        yield step, list(counts)


def many_sources(config, n: int) -> Mixture:
    """n sources over the fixture's two prepared ones (each its own name, so its own orders): one
    of ~18 samples, read through several epochs a step."""
    cfg = load_config(config, [], world_size=1)
    train = open_mixture(cfg, open_sources(cfg), 8, 0, 1)[0]
    return Mixture([f"s{k}" for k in range(n)], [train.readers[k % 2] for k in range(n)], train.seq_len)


def test_the_sampler_reads_the_rule_literally_across_epochs_and_a_weight_change(setup):
    _, config = setup
    data = many_sources(config, 12)
    rng = np.random.default_rng(3)
    weights = rng.random(12).tolist()
    sampler = MixtureSampler(data, weights, 96, 11, 0, 1)
    reference = reference_steps(data, weights, 96, 11, [0] * 12, [0] * 12)
    for _ in range(15):
        step, counts = next(reference)
        assert sampler.next_global().tolist() == step
        assert list(sampler.state.counts.values()) == counts
    # The same position with other weights: each source continues where it stopped.
    other = rng.random(12).tolist()
    changed = MixtureSampler(data, other, 96, 11, 0, 1)
    changed.state.load_state_dict(sampler.state.state_dict())
    reference = reference_steps(data, other, 96, 11, counts, list(counts))
    for _ in range(15):
        assert changed.next_global().tolist() == next(reference)[0]


def test_a_fork_reading_ahead_works_each_step_out_once_and_hands_it_over(setup):
    _, config = setup
    data = many_sources(config, 12)
    weights = np.random.default_rng(4).random(12).tolist()
    reference = reference_steps(data, weights, 64, 5, [0] * 12, [0] * 12)
    expected = [next(reference)[0] for _ in range(8)]
    owner = MixtureSampler(data, weights, 64, 5, 0, 1)
    ahead = owner.fork()
    assert [ahead.next_global().tolist() for _ in range(3)] == expected[:3]
    assert len(owner._ahead) == 3  # left for the owner, which takes them instead of working them out
    assert [owner.next_global().tolist() for _ in range(2)] == expected[:2] and len(owner._ahead) == 1
    assert [owner.next_global().tolist() for _ in range(6)] == expected[2:]  # and past what the fork read

    # An owner moved elsewhere after forking (a checkpoint loaded) takes none of the fork's steps,
    # not even the one the fork worked out at the same sample count (from other counts).
    moved = MixtureSampler(data, weights, 64, 5, 0, 1)
    stale = moved.fork()
    for _ in range(4):  # from samples 0, 64, 128 and 192, left for `moved`
        stale.next_global()
    elsewhere = MixtureSampler(data, np.random.default_rng(5).random(12).tolist(), 64, 5, 0, 1)
    for _ in range(2):  # samples 128, drawn by other weights
        elsewhere.next_global()
    moved.state.load_state_dict(elsewhere.state.state_dict())
    counts = list(moved.state.counts.values())
    reference = reference_steps(data, weights, 64, 5, counts, list(counts))
    assert [moved.next_global().tolist() for _ in range(3)] == [next(reference)[0] for _ in range(3)]


# ---------------------------------------------------------------------------------------------
# check-config


def test_check_config_names_every_mixture_problem_on_its_own_line(setup, write_config):
    root, _ = setup
    cfg = mixture_config()
    cfg["data"]["mixture"] = [{"dataset": str(root / "big.txt"), "weight": 3},
                              {"dataset": str(root / "small.txt"), "weight": 0},
                              {"dataset": str(root / "big.txt"), "weight": 1, "text_feild": "body"},
                              {"dataset": str(root / "missing.txt"), "weight": 1, "name": "gone"}]
    proc = cli("check-config", "--config", write_config(cfg))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "data.mixture[2].text_feild: unknown key (did you mean 'text_field'?); a source takes name, weight, "
        "dataset, split, text_field, messages_field, prompt_field, completion_field, text_unit, encoding_errors, "
        "validation, validation_fraction, prepared (the other data keys are the data section's)",
        "data.mixture[1].weight: must be > 0 (got 0)",
        "data.mixture[2].name: 'big' is data.mixture[0]'s name too; names must be unique (a source "
        "without name: is named after its dataset; set one)",
        f"data.mixture[3].dataset: no such file or folder (got '{root / 'missing.txt'}')"]

    cfg["data"]["dataset"] = str(root / "big.txt")
    cfg["data"]["mixture"] = cfg["data"]["mixture"][:1]
    proc = cli("check-config", "--config", write_config(cfg))
    assert (proc.returncode, proc.stderr) == (2, "data.dataset: set exactly one of data.dataset and "
                                                 "data.mixture (got both)\n")


def test_a_path_the_sources_take_from_the_data_section_is_named_as_written(setup, write_config):
    """data.validation set once for every source, and missing: one line, the path as the file
    wrote it and as resolved, word for word what data.dataset's one source gets."""
    root, _ = setup
    cfg = mixture_config()
    cfg["data"]["mixture"] = [{"dataset": str(root / "big.txt"), "weight": 3},
                              {"dataset": str(root / "small.txt"), "weight": 1}]
    cfg["data"].update(validation="./held-out.txt", validation_fraction=None)
    path = write_config(cfg)
    proc = cli("check-config", "--config", path)
    line = f"data.validation: no such file or folder (got './held-out.txt', resolved to {path.parent / 'held-out.txt'})"
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [line])

    del cfg["data"]["mixture"]
    cfg["data"]["dataset"] = str(root / "big.txt")
    assert cli("check-config", "--config", write_config(cfg)).stderr.splitlines() == [line]


# ---------------------------------------------------------------------------------------------
# A real run


@pytest.mark.slow
def test_a_3_to_1_mixture_trains_3_to_1_and_resumes_on_another_world_size_on_the_same_curve(setup):
    root, config = setup
    runs = root / "home" / "runs"
    # Read ahead on a thread (its fork of the sampler works the steps out for the trainer's).
    cli("train", "--config", config, "--set", "run.name=whole", "--set", "data.prefetch_steps=2", check=True)
    torchrun(2, "train", "--config", config, "--set", "run.name=cut", "--set", "train.max_steps=8")
    resumed = cli("train", "--config", config, "--set", "run.name=cut", check=True)
    assert "resumed" in resumed.stdout and "saved by 2 ranks" in resumed.stdout

    assert_same_curve(runs / "whole", runs / "cut", tol=1e-4)
    records = read_metrics(runs / "cut")
    last = [r for r in records if r["kind"] == "train"][-1]
    tokens = last["source_tokens"]
    assert sum(tokens.values()) == last["tokens"] == 16 * 8 * 64
    assert abs(tokens["big"] / tokens["small"] - 3) / 3 < 0.015
    assert last["source_epochs"]["small"] > 1  # it repeated, as its own epochs
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12, 16]
    for r in evals:
        by_source = r["eval_loss_by_source"]
        assert set(by_source) == {"big", "small"}
        assert r["eval_loss"] == pytest.approx(0.75 * by_source["big"] + 0.25 * by_source["small"])


def test_a_source_prepared_with_another_tokenizer_is_named_with_its_own_fix(setup, write_config, tmp_path):
    """A source's given prepared folder made by another tokenizer than the model's: one line that
    names the source's key, in the problem and in its fix."""
    from transformers import AutoTokenizer
    root, _ = setup
    [small] = [f for f in (root / "home" / "prepared").iterdir() if f.name.startswith("small")]
    other = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "other-tokenizer")
    cfg = mixture_config()
    cfg["model"]["tokenizer"] = str(tmp_path / "other-tokenizer")
    cfg["data"]["mixture"][0]["dataset"] = str(root / "big.txt")
    cfg["data"]["mixture"][1].update(dataset=str(root / "small.txt"), validation=str(root / "small-val.txt"),
                                     prepared=str(small))
    proc = cli("check-config", "--config", write_config(cfg))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"data.mixture[1].prepared: {small} was tokenized by {DEMO / 'tokenizer'}, another tokenizer than "
        f"this model's ({tmp_path / 'other-tokenizer'}); set data.mixture[1].prepared: null to prepare the "
        f"data with this one"]
