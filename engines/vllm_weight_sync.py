"""A vLLM worker extension that swaps the live model's weights in place.

vLLM imports this class by name (``worker_extension_cls``) and mixes it into its worker.
The CPU backend repacks linear weights at load, so the model's plain ``load_weights`` fails
there; the worker's ``reload_weights`` runs the full loading path and works on CPU and GPU:
it gathers each layer's tensors, processes the layer, and copies the result into the
layer's original storage (which CUDA graphs keep pointing at).

The tensors come as an iterator that the method consumes while it loads, so one bucket of
a pulled version (``storage.params.Weights``) is read at a time. That needs vLLM in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker): vLLM's in-process executor
then calls the method with the caller's own objects; a multiprocess executor would have to
pickle them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class WeightSyncExtension:
    """Methods vLLM adds to each worker; call through ``LLM.collective_rpc``."""

    # Not named `update_weights`: the CPU worker already has a method of that name.
    def sluice_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load every ``(name, tensor)`` of ``weights`` (one version), reading it once, in
        its order (by name keeps a layer's tensors together); returns how many."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for pair in weights:
                count += 1
                yield pair

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return count
