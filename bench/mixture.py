"""The mixture blend's cost a step: the largest-error rule as it ran before (a Python loop over
every source, for every sample) against data/mixture.py's, on the same weights and position.

    source workspace/llmtrain/env.sh
    python bench/mixture.py [--steps 30] [--before-steps 3]

For 1,000 sources x 2,048 samples a step and for 4 sources x 1,024, random weights, mid-run
(20 samples a source already drawn). Prints ms a step, the median over the steps: CPU time of
this thread (what the step costs; on a loaded machine the wall time adds the waits for a core,
shown in brackets). Lines: the blend alone; the whole step (the blend, then each source's next
samples through its epochs); the first step of the prefetch thread's fork of the sampler (it
made every source's order again before; it shares them now); and the trainer's step once that
fork worked it out (before: worked out again; now: taken over). Checks that before and after
give the same samples.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np

from llmtrain.data.mixture import Mixture, MixtureSampler, blend


def blend_before(weights, n: int, drawn) -> np.ndarray:
    """data/mixture.py's blend up to 2026-11-26: every source's error in Python, every sample."""
    w, drawn = [float(x) for x in weights], [int(d) for d in drawn]
    total, sources, out = sum(drawn), range(len(w)), []
    for g in range(total, total + n):
        k = max(sources, key=lambda k: w[k] * (g + 1) - drawn[k])
        out.append(k)
        drawn[k] += 1
    return np.array(out, dtype=np.int64)


class SamplerBefore(MixtureSampler):
    """next_global and fork up to 2026-11-26: that blend, then a pass over every source for its
    draws; a fork starts without the sources' orders."""

    def fork(self) -> "SamplerBefore":
        other = copy.copy(self)
        other.state, other._perms = copy.deepcopy(self.state), {}
        return other

    def next_global(self) -> np.ndarray:
        st, names = self.state, self.data.names
        counts = [st.counts[n] for n in names]
        sources = blend_before(self.weights, self.global_batch, [c - st.since_counts[n] for c, n in zip(counts, names)])
        out = np.empty(self.global_batch, dtype=np.int64)
        for k in range(len(names)):
            where = np.flatnonzero(sources == k)
            out[where] = self.data.offsets[k] + self.read(k, counts[k], len(where))
            counts[k] += len(where)
        st.samples += self.global_batch
        st.counts = dict(zip(names, counts))
        return out


class Sized:
    """A source's train split as the sampler sees it: its number of samples."""

    def __init__(self, n: int):
        self.n = n

    def num_samples(self, seq_len: int) -> int:
        return self.n


def timed(fn, steps: int) -> tuple[float, float, list]:
    """Median ms a call (thread CPU time, wall time) and the calls' results."""
    cpu, wall, out = [], [], []
    for _ in range(steps):
        c, t = time.thread_time(), time.perf_counter()
        out.append(fn())
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3, out


def row(label: str, before: tuple, after: tuple) -> None:
    print(f"  {label:<44} {before[0]:9.2f} ({before[1]:8.2f})   {after[0]:7.2f} ({after[1]:7.2f})"
          f"   {before[0] / after[0]:6.0f}x")


def case(sources: int, batch: int, steps: int, before_steps: int) -> None:
    rng = np.random.default_rng(0)
    weights = rng.random(sources).tolist()
    sizes = rng.integers(1_000, 100_000, sources)
    data = Mixture([f"source{k}" for k in range(sources)], [Sized(int(n)) for n in sizes], 2048)
    after, before = MixtureSampler(data, weights, batch, 0, 0, 1), SamplerBefore(data, weights, batch, 0, 0, 1)
    drawn = np.bincount(blend(after.weights, 20 * sources, np.zeros(sources)), minlength=sources)
    for s in (after, before):  # mid-run: 20 samples a source drawn, every source's order made
        s.state.counts, s.state.samples = dict(zip(data.names, drawn.tolist())), 20 * sources
        for k in range(sources):
            s.permutation(k, 0)
    print(f"{sources:,} sources x {batch:,} samples a step")

    b_cpu, b_wall, b_out = timed(lambda: blend_before(after.weights, batch, drawn), before_steps)
    a_cpu, a_wall, a_out = timed(lambda: blend(after.weights, batch, drawn), steps)
    assert all((a == b_out[0]).all() for a in a_out), "the blends differ"
    row("blend", (b_cpu, b_wall), (a_cpu, a_wall))

    b_fork, a_fork = before.fork(), after.fork()  # what the prefetch thread reads with
    b_first, a_first = timed(b_fork.next_global, 1), timed(a_fork.next_global, 1)
    assert (a_first[2][0] == b_first[2][0]).all(), "the forks' steps differ"
    after._ahead.clear()  # this measures the trainer's sampler working its steps out itself
    whole_before = timed(before.next_global, before_steps)
    whole_after = timed(after.next_global, before_steps)  # the same steps as before's
    assert all((a == b).all() for a, b in zip(whole_after[2], whole_before[2])), "the steps differ"
    whole_after = timed(after.next_global, steps)
    row("whole step: blend, each source's next samples", whole_before[:2], whole_after[:2])
    row("the prefetch thread's first step", b_first[:2], a_first[:2])
    ahead = after.fork()
    for _ in range(steps):  # the prefetch thread reads ahead of the trainer's sampler
        ahead.next_global()
    row("trainer's step once the prefetch thread did it", whole_before[:2], timed(after.next_global, steps)[:2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="steps timed after (median)")
    ap.add_argument("--before-steps", type=int, default=3, help="steps timed before (median; ~1 s each)")
    args = ap.parse_args()
    print("ms a step, median: CPU time of the thread (wall time)")
    print(f"  {'':<44} {'before':>20}   {'after':>17}   speed-up")
    case(1000, 2048, args.steps, args.before_steps)
    case(4, 1024, args.steps, max(args.before_steps, args.steps))


if __name__ == "__main__":
    main()
