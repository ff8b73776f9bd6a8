"""The snapshot channel copies, at each pass end, only the rows of the pass phases that changed.

A pass adds into one pass phase's rows ``[L, C]`` of the device totals ``[Q, L, C]``, so each of the
channel's two host buffers needs only the phases changed since its own last copy. Checked against
the device totals after every pass of a random phase schedule, with the copies counted by a
``TorchDispatchMode``; the negative control shows that the comparison sees a phase the channel was
not told of.
"""

from __future__ import annotations

import numpy as np
import torch

from moetrace.snapshot import SnapshotChannel
from tests.recorder.test_hook_ops import OpCounter

Q, L, C = 5, 3, 4


def device_pass(totals: torch.Tensor, tokens: torch.Tensor, phase: int, gen: torch.Generator) -> None:
    """A pass end's fold: random counts into phase ``phase``'s rows and tokens."""
    totals[phase].add_(torch.randint(0, 9, (L, C), generator=gen))
    tokens[phase] += int(torch.randint(1, 5, (1,), generator=gen))


def test_each_pass_copies_its_phase_only_and_the_snapshot_equals_the_device():
    channel = SnapshotChannel((Q, L, C), torch.device("cpu"))
    totals, tokens = torch.zeros((Q, L, C), dtype=torch.int64), torch.zeros(Q, dtype=torch.int64)
    gen = torch.Generator().manual_seed(5)
    phases = torch.randint(0, Q, (60,), generator=gen).tolist()
    copies = []
    for passes, phase in enumerate(phases, start=1):
        device_pass(totals, tokens, phase, gen)
        with OpCounter() as counter:
            channel.publish(totals, tokens, phase, passes, float(passes))
        copies.append(counter.ops.count("copy_.default"))
        rows, (seen, seen_tokens, _), _ = channel.latest_phases()
        np.testing.assert_array_equal(rows, totals.numpy())
        assert (seen, seen_tokens.tolist()) == (passes, tokens.tolist())
    # The first copy into each buffer takes every phase (and the tokens); after that a buffer
    # takes the phases changed since its last copy: the two last passes' at most.
    assert copies[:2] == [Q + 1, Q + 1]
    assert all(c == 1 + len({a, b}) for c, a, b in zip(copies[2:], phases[1:], phases[2:], strict=False))
    channel.clear()  # a new recording: the device rows start over, so both buffers take every phase again
    totals.zero_()
    with OpCounter() as counter:
        channel.publish(totals, tokens, 0, 1, 0.0)
    assert counter.ops.count("copy_.default") == Q + 1
    np.testing.assert_array_equal(channel.latest_phases()[0], 0)


def test_negative_control_a_phase_changed_unannounced_shows_in_the_comparison():
    channel = SnapshotChannel((Q, L, C), torch.device("cpu"))
    totals, tokens = torch.zeros((Q, L, C), dtype=torch.int64), torch.zeros(Q, dtype=torch.int64)
    gen = torch.Generator().manual_seed(6)
    for passes in (1, 2):  # both buffers have taken every phase
        device_pass(totals, tokens, 0, gen)
        channel.publish(totals, tokens, 0, passes, 0.0)
    device_pass(totals, tokens, 0, gen)
    device_pass(totals, tokens, 3, gen)  # phase 3 changed too, but the channel is told of phase 0 only
    channel.publish(totals, tokens, 0, 3, 0.0)
    rows = channel.latest_phases()[0]
    np.testing.assert_array_equal(rows[0], totals[0].numpy())
    assert not np.array_equal(rows[3], totals[3].numpy())
