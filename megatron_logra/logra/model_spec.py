"""LoGRA's change to the network, handed to the model builder (``ModelBuildConfig``).

``SketchedLinears(targets)`` swaps the chosen linears of megatron-core's local layer
spec for their sketched versions and, after the build, the embedding / output layer
classes (``sketched_linear``). The builder (``model.provider``) applies it without
knowing LoGRA.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.logra.sketched_linear import (TARGETS, sketch_embedding_and_output,
                                                  sketched_layer_spec)


@dataclass(frozen=True)
class SketchedLinears:
    targets: tuple[str, ...] = TARGETS  # qkv, proj, fc1, fc2, embedding, output

    def layer_spec(self, local_spec):
        return sketched_layer_spec(local_spec, self.targets)

    def after_build(self, model) -> None:
        sketch_embedding_and_output(model, self.targets)

    def init_params(self, model, arch, seed: int) -> None:
        pass  # the sketched layers add no parameters
