"""Where each logical layer of the stacked ``layers`` arrays is stored.

Interleaved pipeline chunks are round robin over the stages, but a ``PartitionSpec`` splits the
stacked axis in contiguous blocks, so with several chunks per stage the layers are *stored* in
stage order. ``LayerOrder`` converts; checkpoints and the tools read it without importing the
pipeline's executor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx


def with_layers(rest: nnx.State, layers: Any) -> nnx.State:
    """``rest`` (params with ``layers`` None) with ``layers`` put back."""
    params = jax.tree.map(lambda x: x, rest)  # a shallow copy of the tree
    params["layers"] = layers
    return params


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    """Where each logical layer is stored in the stacked arrays.

    Interleaving puts logical chunk c on stage c mod S, as stage-local chunk c // S; the arrays are
    split over ``stage`` in contiguous blocks, so storage chunk ``(c mod S) * V + c // S`` holds
    logical chunk c. With one chunk per stage the layers are stored in their logical order.
    """

    stages: int = 1
    virtual_stages: int = 1
    num_layers: int = 1

    @classmethod
    def of_run(cls, stages: int, chunks_per_stage: int, num_layers: int) -> LayerOrder:
        """The storage order a run with ``stages`` pipeline stages of ``chunks_per_stage`` chunks
        (``PipelineConfig.chunks_per_stage``) uses."""
        return cls(stages, chunks_per_stage if stages > 1 else 1, num_layers)

    @classmethod
    def of_config(cls, config: dict, stages: int) -> LayerOrder:
        """The storage order of a run on ``stages`` stages from its saved config (a plain
        ``{section: {field: value}}`` mapping, as checkpoints record it)."""
        virtual = int(config.get("pipeline", {}).get("virtual_stages", 1)) if stages > 1 else 1
        return cls(stages, virtual, int(config["model"]["num_layers"]))

    def same_permutation(self, other: LayerOrder) -> bool:
        """Whether both store every layer at the same index (e.g. GPipe and no pipeline)."""
        return np.array_equal(self.storage_of_logical, other.storage_of_logical)

    def convert(self, tree: Any, target: LayerOrder) -> Any:
        """``tree`` (params, or any tree holding parameter-like States such as Adam's moments)
        stored in this order -> stored in ``target``'s order."""
        if self.same_permutation(target):
            return tree
        has_layers = lambda node: isinstance(node, nnx.State) and "layers" in node
        return jax.tree.map(lambda node: target.to_storage(self.to_logical(node)) if has_layers(node) else node,
                            tree, is_leaf=has_layers)

    @property
    def storage_of_logical(self) -> np.ndarray:
        """[num_layers] storage index of each logical layer."""
        per_chunk = self.num_layers // (self.stages * self.virtual_stages)
        chunks = np.arange(self.stages * self.virtual_stages)
        storage_chunk = (chunks % self.stages) * self.virtual_stages + chunks // self.stages
        return (storage_chunk[:, None] * per_chunk + np.arange(per_chunk)[None, :]).reshape(-1)

    def to_storage(self, params: nnx.State) -> nnx.State:
        """Params with layers in logical order -> in storage order."""
        return self._permute(params, np.argsort(self.storage_of_logical))

    def to_logical(self, params: nnx.State) -> nnx.State:
        """Params with layers in storage order -> in logical (model) order."""
        return self._permute(params, self.storage_of_logical)

    def _permute(self, params: nnx.State, take: np.ndarray) -> nnx.State:
        if self.virtual_stages == 1:
            return params
        return with_layers(params, jax.tree.map(lambda x: x[take], params["layers"]))
