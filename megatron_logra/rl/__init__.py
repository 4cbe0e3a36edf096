"""The RL stage (``--stage rl``): ``stage.RLStage`` runs one update as rollouts -> rewards
-> advantages -> update -> weight sync.

- the samples: ``sample_source`` (prompts, generation, scoring, advantages, evaluation),
  ``prompts_and_scores`` (its pure data side), ``verifiers``, ``advantages``,
  ``samples_ahead`` (``--async-rollouts``) and ``staleness`` (its bounds);
- the engines kept on the trainer's weights: ``synced_engines`` (``rollout.engines`` and
  ``weight_sync.sync`` wired: an engine that failed is restarted there and pushed to
  here);
- the update: ``objective`` (the loss: pure math), ``policy_loss`` (megatron's loss
  function over it), ``policy_update`` (batching, PPO minibatch steps, KL control);
- ``config`` (``RLConfig`` and the slices the stage's parts take).
"""
