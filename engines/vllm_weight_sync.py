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
    def sluice_load_weights(self, blobs: list[bytes]) -> int:
        """Load every tensor of ``blobs`` (safetensors buckets of one version) in one pass."""
        tensors = {k: v for blob in blobs for k, v in load_safetensors(bytes(blob)).items()}
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
