"""Throughput as the field reports it (NeMo-RL's performance tables: tokens per second of
the update's wall time, per GPU), and the time split of an update. Pure Python.

An RL update's record (``rl.stage.RLStage.step``) carries its token counts and the
seconds of each part of its wall time (``SPLIT``):

- ``generated_tokens``: response tokens the engines returned for the update (every
  dynamic-sampling round, the groups set aside included);
- ``trained_tokens``: prompt + response tokens of the sequences the update trained on
  (unpadded; each counted once, however many PPO epochs pass over it);
- ``time_<part>_s`` for each part of ``SPLIT``; they add up to ``step_time_s`` (what is
  left, a few milliseconds of bookkeeping, is not named).

``rates(record, world_size)`` turns the counts into ``<kind>_tokens_per_s`` (over
``step_time_s``, the update's wall time) and ``<kind>_tokens_per_s_per_gpu``: divided by
the trainer's processes, one per GPU on CUDA and one per process on CPU; an engine on
GPUs of its own (``--rollout-placement dedicated``, ``--rollout-engine-url``) is not in
that count.
"""

from __future__ import annotations

SPLIT = ("generation", "scoring", "training", "push", "waiting")
"""The parts of an RL update's wall time (``time_<part>_s``):

- generation: the engines generating the update's samples (with --async-rollouts only a
  batch generated again after a failure: the others are generated beside training);
  colocated engines handing the devices back are counted here too;
- scoring: the verifier's rewards, the advantages and the samples' broadcast to every
  rank (rank 0 scores; the other ranks wait for it here);
- training: the policy update (forward, backward, optimizer step(s), KL control);
- push: the weight push into the engines (restarts and retries included);
- waiting: --async-rollouts only: waiting for the batch generated beside the last
  update's training, and for the engines to finish generating before the push."""

TOKEN_KINDS = ("generated", "trained")
SHORT = {"generation": "gen", "scoring": "score", "training": "train", "push": "push",
         "waiting": "wait", "generated": "gen", "trained": "train"}
"""The progress line's words for ``SPLIT`` and ``TOKEN_KINDS``."""


def split_keys() -> list[str]:
    """The record keys of ``SPLIT``, in order."""
    return [f"time_{part}_s" for part in SPLIT]


def rates(record: dict, world_size: int) -> dict[str, float]:
    """Tokens per second of ``record``'s wall time (``step_time_s``) for each count it has
    (``generated_tokens``, ``trained_tokens``), in total and per trainer process
    (``world_size``: one per GPU on CUDA)."""
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: at least 1")
    seconds = record.get("step_time_s")
    out: dict[str, float] = {}
    if not seconds:
        return out
    for kind in TOKEN_KINDS:
        count = record.get(f"{kind}_tokens")
        if count is None:
            continue
        out[f"{kind}_tokens_per_s"] = count / seconds
        out[f"{kind}_tokens_per_s_per_gpu"] = count / seconds / world_size
    return out


def progress_parts(record: dict) -> list[str]:
    """The progress line's throughput parts: tokens/s per GPU and the time split, for the
    figures the record has."""
    parts = []
    per_gpu = [f"{SHORT[kind]} {record[f'{kind}_tokens_per_s_per_gpu']:.1f}"
               for kind in TOKEN_KINDS if f"{kind}_tokens_per_s_per_gpu" in record]
    if per_gpu:
        parts.append("tok/s/gpu " + " ".join(per_gpu))
    split = [f"{SHORT[part]} {record[key]:.2f}" for part, key in zip(SPLIT, split_keys())
             if record.get(key)]
    if split:
        parts.append("s: " + " ".join(split))
    return parts
