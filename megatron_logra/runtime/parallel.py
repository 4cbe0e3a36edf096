"""Tensor/pipeline/data-parallel layout: validated dims and megatron-core bring-up.

``ParallelConfig`` imports nothing of megatron (the run config is built before it) and
checks itself when built; how it splits a world size is checked by ``validate``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.flags import check_fields


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron-style layout. Data parallel is what is left: world / (TP * PP)."""

    tensor_model_parallel_size: int = 1
    """TP degree: each linear's weight split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP degree: the layers split into this many stages."""

    def __post_init__(self) -> None:
        check_fields(self)
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if tp < 1 or pp < 1:
            raise ValueError(f"--tensor-model-parallel-size {tp} and --pipeline-model-parallel-size "
                             f"{pp} must both be >= 1")

    def data_parallel_size(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def validate(self, world_size: int) -> None:
        """Refuse (ValueError) a world size TP x PP does not divide."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}; "
                f"launch a multiple of {tp * pp} processes (torchrun --nproc-per-node) or change "
                f"--tensor-model-parallel-size / --pipeline-model-parallel-size")


def initialize(cfg: ParallelConfig, world_size: int, seed: int) -> None:
    """Build megatron-core's process groups for ``cfg`` (kept when that layout is already up:
    megatron never frees old groups, and each rebuild makes later group creation slower) and
    seed its RNG tracker."""
    from megatron.core import parallel_state

    cfg.validate(world_size)
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size()
                != cfg.tensor_model_parallel_size
                or parallel_state.get_pipeline_model_parallel_world_size()
                != cfg.pipeline_model_parallel_size):
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        )
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
