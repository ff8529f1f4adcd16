"""A vLLM worker extension that swaps the live model's weights in place.

vLLM imports this class by name (``worker_extension_cls``) and mixes it into its worker.
The CPU backend repacks linear weights at load, so the model's plain ``load_weights`` fails
there; the worker's ``reload_weights`` runs the full loading path and works on CPU and GPU.
"""

from __future__ import annotations

from safetensors.torch import load as load_safetensors


class WeightSyncExtension:
    """Methods vLLM adds to each worker; call through ``LLM.collective_rpc``."""

    # Not named `update_weights`: the CPU worker already has a method of that name.
    def sluice_load_weights(self, blob: bytes) -> int:
        tensors = load_safetensors(bytes(blob))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
