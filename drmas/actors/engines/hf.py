"""The `hf` engine: in-process transformers/torch generation for one model pool.

Who calls it: the actor's workflows (`generate`, from many episode coroutines at once) and
the actor's weight sync (`pause` / `load_weights` / `resume`). A scheduler task batches
every pending request into a wave: left-padded prefill with a KV cache, then token-by-token
sampling (temperature, top-p), yielding to the event loop between decode steps so sockets,
other episodes and weight syncs keep running. Finished rows are dropped from the batch and
its KV cache; requests that arrive mid-wave join the next wave (wave-level, not yet
iteration-level, continuous batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drmas.actors.config import EngineConfig
from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.transports.digest import digest_of

log = logging.getLogger("drmas.engine.hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Pending:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    version: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: str = ""


class HFEngine:
    def __init__(self, model_name: str, model_path: str | Path, cfg: EngineConfig) -> None:
        self.model_name = model_name
        self.path = Path(model_path)
        self.cfg = cfg
        self.version = 0
        self.tokenizer: Any = None
        self.model: Any = None
        self.eos_token_ids: set[int] = set()
        self._queue: list[_Pending] = []
        self._wake = asyncio.Event()
        self._paused = asyncio.Event()
        self._paused.set()  # set = running
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._generator: torch.Generator | None = None

    async def start(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = self.cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=DTYPES[self.cfg.dtype])
        self.model.to(self.device).eval().requires_grad_(False)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos_token_ids), 0)
        self._generator = torch.Generator(self.device).manual_seed(self.cfg.seed)
        self._task = asyncio.create_task(self._loop())

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._task is None or self._task.done():
            raise RuntimeError("engine not running")
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        future: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, future))
        self._wake.set()
        return await future

    async def pause(self) -> None:
        self._paused.clear()
        await asyncio.sleep(0)  # the scheduler checks between decode steps

    async def resume(self) -> None:
        self._paused.set()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None:
                    raise KeyError(f"{self.model_name}: no parameter named {name!r} in the engine")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"{self.model_name}: {name} has shape {tuple(target.shape)}, "
                        f"received {tuple(tensor.shape)}"
                    )
                target.copy_(tensor)
        self.version = version

    def weights_digest(self) -> str:
        return digest_of(self.model.named_parameters())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(RuntimeError("engine closed"))
        self._queue.clear()

    # ------------------------------------------------------------- scheduler
    async def _loop(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._paused.wait()
            wave, self._queue = self._queue[: self.cfg.max_batch], self._queue[self.cfg.max_batch :]
            try:
                await self._run_wave(wave)
            except Exception as exc:  # fail the requests, keep the engine alive
                log.exception("generation failed")
                for p in wave:
                    if not p.future.done():
                        p.future.set_exception(exc)

    async def _run_wave(self, wave: list[_Pending]) -> None:
        for p in wave:
            p.version = self.version
        n = len(wave)
        lengths = [len(p.request.prompt_ids) for p in wave]
        width = max(lengths)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(wave):
            ids[i, width - lengths[i] :] = torch.tensor(p.request.prompt_ids)
            mask[i, width - lengths[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([p.request.temperature for p in wave], device=self.device)
        top_ps = torch.tensor([p.request.top_p for p in wave], device=self.device)
        rows = list(range(n))  # wave index of each row still in the batch
        cache = None
        step_ids, step_pos = ids, positions
        max_new = max(p.request.max_new_tokens for p in wave)
        # no grad-mode context may span an `await`: other coroutines run in between
        for _ in range(max_new):
            with torch.no_grad():
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=step_pos,
                    use_cache=True,
                    **{self._cache_kw: cache},
                )
                cache = out.past_key_values
                tokens, logprobs = self._sample(out.logits[:, -1, :].float(), temps, top_ps)
            keep = [
                r for r, i in enumerate(rows) if not self._append(wave[i], tokens[r], logprobs[r])
            ]
            if not keep:
                return
            if len(keep) < len(rows):  # drop finished rows: compute goes to live sequences
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                rows = [rows[r] for r in keep]
                tokens, mask, step_pos = tokens[index], mask[index], step_pos[index]
                temps, top_ps = temps[index], top_ps[index]
            step_ids = tokens.view(-1, 1)
            ones = torch.ones((len(rows), 1), dtype=mask.dtype, device=self.device)
            mask = torch.cat([mask, ones], 1)
            step_pos = step_pos[:, -1:] + 1
            await asyncio.sleep(0)
            await self._paused.wait()

    def _append(self, p: _Pending, token_t: torch.Tensor, logprob_t: torch.Tensor) -> bool:
        """Record one sampled token; resolve the request and return True when it is done."""
        token = int(token_t)
        p.tokens.append(token)
        p.logprobs.append(min(0.0, float(logprob_t)))
        if token in self.eos_token_ids or (p.request.stop and self._hit_stop(p)):
            p.finish = "stop"
        elif len(p.tokens) >= p.request.max_new_tokens:
            p.finish = "length"
        if p.finish:
            p.future.set_result(GenerateResult(p.tokens, p.logprobs, p.finish, p.version))
        return bool(p.finish)

    def _hit_stop(self, p: _Pending) -> bool:
        p.text = self.tokenizer.decode(p.tokens, skip_special_tokens=True)
        return any(s in p.text for s in p.request.stop)

    def _sample(
        self, logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample per row; log-prob of the token under softmax(logits / T) before top-p."""
        greedy = temps <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
        logp = torch.log_softmax(scaled, dim=-1)
        probs = logp.exp()
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_ps.unsqueeze(1)
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p, 1, generator=self._generator).squeeze(1)
        sampled = order.gather(1, choice.unsqueeze(1)).squeeze(1)
        tokens = torch.where(greedy, logits.argmax(-1), sampled)
        return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
