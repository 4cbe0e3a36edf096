"""Predicted-KL step control (``--kl-control predicted``; docs/method.md, section 3).

Each RL update's optimizer step is held back, its direction pushed through one
forward-mode pass on a probe batch, and the step applied scaled by
alpha = min(alpha_max, sqrt(budget / K)). The modules, from the bottom up:

- ``config``: ``KLControlConfig`` (no torch, no megatron).
- ``budget``: the math in plain torch: the Fisher quadratic form K, the token KL, the
  step scale, the cosine budget and the mismatch average (``KLController``).
- ``weight_tangent``: ``LowRankTangent``, a sketched weight's update tangent -c D A
  (never formed) and how a sketched layer adds it to its dual output; ``active`` puts
  each on its ``SketchSlot.tangent`` for the duration of the pass.
- ``held_back_step``: ``HeldBackStep``, which snapshots a megatron-core optimizer's params,
  turns its step into the dense tangent and applies the step scaled by alpha (reads
  megatron-core optimizer internals; version-checked).
- ``tangent_forward``: ``UpdateTangents`` and ``logits_with_tangent``, the logits and
  their tangent through TP and PP.
- ``scaled_step``: ``scaled_optimizer_step``, the held-back step of megatron's optimizer
  or of LoGRA, scaled by the alpha a callback chooses.
- ``controller``: ``PredictedKLStep``, one update's control on the trainer (probe, K,
  alpha, realized KL), and ``cap_probe``.

Importing this package imports none of them.
"""
