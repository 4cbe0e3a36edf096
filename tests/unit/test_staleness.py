"""Staleness of asynchronous rollouts (``rl.staleness``) and the fixed split of requests
over engine replicas (``rollout.engines.split_evenly``)."""

from __future__ import annotations

import pytest

from megatron_logra.rl.policy_loss import RolloutSample, collate_rollouts
from megatron_logra.rl.config import StalenessConfig
from megatron_logra.rl.staleness import UpdateKL, apply_bound
from megatron_logra.rollout.engines import split_evenly


def _sample(version: int) -> RolloutSample:
    return RolloutSample([1, 2], [3, 4], [-0.5, -0.5], advantage=1.0, version=version)


def test_kl_since_sums_realized_else_predicted_and_knows_what_it_lacks():
    kl = UpdateKL()
    kl.record(3, {"kl_pred": 0.01})
    kl.record(4, {"kl_pred": 0.5, "kl_realized": 0.02})  # measured wins
    kl.record(5, {})  # no KL control: no figure
    assert kl.since(3, 5) == pytest.approx(0.03)
    assert kl.since(5, 5) == 0
    assert kl.since(2, 5) is None and kl.since(4, 6) is None


def test_samples_beyond_the_version_bound_never_reach_the_loss():
    kl = UpdateKL({5: 0.01, 6: 0.01, 7: 0.01})
    samples = [_sample(8), _sample(7), _sample(6), _sample(5)]
    out, stats = apply_bound(samples, 8, kl, StalenessConfig(True, max_staleness=2))
    assert [s.weight for s in out] == [1.0, 1.0, 1.0, 0.0]
    assert stats["stale_dropped_versions"] == 1 and stats["staleness_max"] == 3
    assert stats["staleness_mean"] == pytest.approx(1.5)
    batch = collate_rollouts(out, 8, pad_id=0)
    assert batch["loss_mask"][3].sum() == 0 and batch["loss_mask"][0].sum() == 2


def test_kl_bound_drops_or_downweights_and_counts():
    kl = UpdateKL({5: 0.004, 6: 0.004, 7: 0.004})
    samples = [_sample(8), _sample(7), _sample(6), _sample(5)]  # KL 0, .004, .008, .012
    dropped, stats = apply_bound(samples, 8, kl, StalenessConfig(True, 3, max_staleness_kl=0.006))
    assert [s.weight for s in dropped] == [1.0, 1.0, 0.0, 0.0]
    assert stats["stale_dropped_kl"] == 2 and stats["staleness_kl_max"] == pytest.approx(0.012)
    down, stats = apply_bound(samples, 8, kl,
                              StalenessConfig(True, 3, 0.006, stale_samples="downweight"))
    assert [s.weight for s in down] == pytest.approx([1.0, 1.0, 0.75, 0.5])
    assert stats["stale_downweighted"] == 2 and stats["stale_dropped_kl"] == 0
    unknown, stats = apply_bound([_sample(2)], 8, kl,
                                 StalenessConfig(True, 9, max_staleness_kl=1.0))
    assert unknown[0].weight == 0 and stats["stale_dropped_kl"] == 1  # never silently kept


def test_requests_split_in_fixed_contiguous_parts():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1, 2], 1) == [[1, 2]]
    parts = split_evenly(list(range(10)), 4)
    assert [x for p in parts for x in p] == list(range(10))
