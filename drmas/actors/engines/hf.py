"""The embedded engine: in-process transformers + torch, CPU or one GPU.

Scheduling is iteration-level (continuous batching, as in Orca/vLLM, over a plain
transformers DynamicCache). The queue, pause/resume and shutdown are the scheduler the
sim engine shares (scheduler.py); its one background task owns the model and each
iteration

1. admits pending requests while the running batch has room: prefills them as their own
   left-padded batch, samples their first token, and merges their KV cache into the
   running one (the shorter cache is left-padded along the sequence axis, masked out, and
   the two are concatenated along the batch axis; every row keeps its own attention mask
   and position ids, so a row's tokens do not depend on what it was batched with);
2. runs one decode step for every running row;
3. drops finished rows (index-select on the cache; leading columns that no live row
   attends to are cut off), so compute goes to live sequences;
4. resolves the finished rows' results on the event loop, and yields to it
   (`asyncio.sleep(0)`): weight loads run between steps; `pause()` waits for exactly
   that point.

On a LoRA model (models.<m>.lora.rank > 0) the engine holds one copy of the frozen base
with every agent's adapter on it (drmas.models.lora.add_adapters, built exactly as the
learner builds them), and one decode batch mixes rows of different adapters: each forward
names every row's adapter (peft's mixed-batch `adapter_names`; "__base__" for a request
with adapter ""), so each row computes the base plus its own adapter only. Measured on
the tiny model on a CPU, such a decode step costs 2-3 times a plain one (the hooks peft
registers per call, one gather per adapter and layer); grouping rows by adapter instead
would split the KV cache and cost a forward per adapter. A publish carries only adapter
tensors, of the adapters that changed since the version the actor holds (possibly none):
`load_weights` copies them by their PeftModel names, every other adapter stays as it is,
and `weights_digest` fingerprints every adapter, as the learner does for the version.

Each step's model calls run in a worker thread (`asyncio.to_thread`; torch releases the
interpreter lock while it computes), so the actor's event loop keeps sending heartbeats and
answering the broker during a long step: a prefill of 64 SmolLM2 prompts takes tens of
seconds on two loaded cores, longer than broker.heartbeat_timeout_s, and on the loop
thread it got the actor dropped as lost. One step runs at a time (the scheduler awaits
it), and weights load only while paused, between steps.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch

from drmas import cpu_share
from drmas.actors.engines.base import GenerateRequest, GenerateResult, fit_context
from drmas.actors.engines.hf_batch import Batch, is_plain_layer, pad_left, top_p_filter
from drmas.actors.engines.scheduler import RequestScheduler, Row, hit_stop
from drmas.config.actor import EngineConfig
from drmas.config.model import LoraConfig
from drmas.config.types import Dtype
from drmas.models.lora import BASE_ADAPTER, adapter_of_param, adapter_param_names, add_adapters
from drmas.protocol.validate import context_from_config
from drmas.transports.digest import digest_of
from drmas.transports.weights.layout import Expected, expected_of

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

log = logging.getLogger("drmas.engine.hf")

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(Dtype)}
"""actor.engine.dtype's choices (declared once, in drmas.config) -> torch dtypes."""


class HFEngine:
    """Engine protocol (drmas/actors/engines/base.py) over a transformers causal LM."""

    def __init__(
        self,
        model_name: str,
        model_path: str | Path,
        cfg: EngineConfig,
        lora: LoraConfig | None = None,
        adapters: Sequence[str] = (),
    ) -> None:
        """`lora`, `adapters`: a LoRA base's settings and adapter names (None, () for a model
        that is served whole)."""
        if cfg.dtype not in DTYPES:
            raise ValueError(f"engine dtype {cfg.dtype!r} is not one of {sorted(DTYPES)}")
        if cfg.max_batch < 1:
            raise ValueError(f"engine max_batch must be >= 1, got {cfg.max_batch}")
        self.model_name = model_name
        self.model_path = Path(model_path)
        self.cfg = cfg
        self.lora = lora
        self.adapters = list(adapters)
        if bool(self.adapters) != (lora is not None and lora.rank > 0):
            raise ValueError(
                f"engine {model_name!r}: adapters {self.adapters} need lora.rank > 0 and "
                "the other way round (make_engine passes both for a LoRA base)"
            )
        self.version = 0
        self.tokenizer: Any = None
        self.model: PreTrainedModel | None = None
        self.eos_token_ids: set[int] = set()
        self.tokens_generated = 0
        """Tokens sampled since start (all requests): for throughput metrics."""
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        self._batch: Batch | None = None
        self._finished: list[tuple[Row, GenerateResult]] = []
        """Rows the step now running finished, with their results (answered on the loop)."""
        self._merge_ok = True
        self._scheduler = RequestScheduler("hf", model_name, self)
        self._generator: torch.Generator | None = None
        self._cache_kwarg = "cache"
        self._pad_id = 0
        self._vocab_size = 0
        self._context: int | None = None
        self._adapter_params: dict[str, torch.Tensor] = {}
        """LoRA base: every adapter parameter by its PeftModel name, sorted (what a
        publish carries and the digest covers)."""
        self._backup: dict[str, torch.Tensor] = {}
        """backup_weights' host copy, kept between loads: copying into it took 0.05 s for
        SmolLM2's 538 MB on a 2-core CPU, allocating it anew each load 0.4 s."""

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._scheduler.start()

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model: Any = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=DTYPES[self.cfg.dtype]
        )
        # transformers 5 renamed the forward argument `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if self.adapters:
            model = self._add_adapters(model)
        model.to(self.device).eval().requires_grad_(False)
        self.model = model
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos_ids
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(eos_ids, default=0)
        self._vocab_size = model.get_input_embeddings().weight.shape[0]
        self._context = context_from_config(model.config.to_dict())  # prompt + response
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(self.cfg.seed)
        log.info(
            "%s: loaded %s on %s (%s), eos ids %s, adapters %s",
            self.model_name,
            self.model_path,
            self.device,
            self.cfg.dtype,
            sorted(eos_ids),
            self.adapters or "none",
        )

    def _add_adapters(self, model: PreTrainedModel) -> PeftModel:
        """The adapters on the base, built on the CPU from the learner's seed, held in the
        engine dtype (what a publish sends: peft keeps them fp32 under a bf16 base)."""
        assert self.lora is not None
        peft_model = add_adapters(model, self.lora, self.adapters)
        named = dict(peft_model.named_parameters())
        self._adapter_params = {n: named[n] for n in adapter_param_names(peft_model)}
        for param in self._adapter_params.values():
            param.data = param.data.to(DTYPES[self.cfg.dtype])
        return peft_model

    async def close(self) -> None:
        await self._scheduler.close()

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self._batch.rows) if self._batch else 0

    @property
    def num_pending(self) -> int:
        """Requests waiting for room in the running batch."""
        return self._scheduler.num_pending

    # ---------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.adapter and request.adapter not in self.adapters:
            raise ValueError(
                f"engine {self.model_name!r} has no adapter {request.adapter!r} (adapters: "
                f"{self.adapters or 'none, models.' + self.model_name + '.lora.rank is 0'})"
            )
        request = fit_context(request, self._context)
        return await self._scheduler.submit(request, self._vocab_size, self.version)

    async def pause(self) -> None:
        await self._scheduler.pause()

    async def resume(self) -> None:
        await self._scheduler.resume()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy by Hugging Face name (both names of tied weights are accepted); on a LoRA
        base by PeftModel name, adapter tensors only (the base never changes), of any
        subset of the adapters: those not received keep their tensors. Called once per
        bucket; a call without tensors only sets `version` (a publish that carried none).
        Stops at the first bad tensor; tensors already copied stay (backup_weights /
        restore_weights undo them), `version` is then left unchanged."""
        if self.model is None:
            raise RuntimeError(f"engine {self.model_name!r}: call start() before load_weights()")
        targets = self._targets()
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    what = "adapter parameter" if self.adapters else "parameter"
                    raise KeyError(f"{self.model_name}: unknown {what} {name!r}")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{self.model_name}: parameter {name!r} has shape {tuple(target.shape)}, "
                        f"received {tuple(tensor.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.version = version

    def expected_weights(self, adapters: Sequence[str]) -> Expected | None:
        """What a publish must carry (drmas/actors/engines/expected.py): every parameter,
        by the names named_parameters() gives (the learner sends exactly those); on a LoRA
        base every parameter of the adapters the publish carries, and nothing else (a join
        that names none: whole adapters only)."""
        if self.model is None:
            return None
        if self.adapters and not adapters:
            every = expected_of(
                self._adapter_params.items(), f"whole adapters of {self.model_name}"
            )
            return Expected(every.specs, every.what, adapter_of_param)
        if self.adapters:
            carried = set(adapters)
            return expected_of(
                ((n, t) for n, t in self._adapter_params.items() if adapter_of_param(n) in carried),
                f"the parameters of adapters {sorted(carried)} of {self.model_name}",
            )
        return expected_of(self.model.named_parameters(), f"every parameter of {self.model_name}")

    def _targets(self) -> dict[str, torch.Tensor]:
        """What a publish may write, by name: the adapters of a LoRA base, else every
        parameter and buffer."""
        assert self.model is not None
        if self.adapters:
            return self._adapter_params
        targets: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        return targets

    def backup_weights(self) -> object:
        """A copy of what a publish may change (on the CPU: every parameter and buffer, or
        a LoRA base's adapters) and the version: what a failed load restores. Costs that
        much host memory, kept for the next load (one backup at a time: the next call
        overwrites it)."""
        if self.model is None:
            raise RuntimeError(f"engine {self.model_name!r}: call start() before backup_weights()")
        kept = self._adapter_params if self.adapters else self.model.state_dict()
        with torch.no_grad():
            for name, value in kept.items():
                saved = self._backup.get(name)
                if saved is None or saved.shape != value.shape or saved.dtype != value.dtype:
                    self._backup[name] = value.detach().to("cpu", copy=True)
                else:
                    saved.copy_(value.detach())
        return self.version, self._backup

    def restore_weights(self, backup: object) -> None:
        assert self.model is not None and isinstance(backup, tuple)
        version, state = backup
        if self.adapters:
            with torch.no_grad():
                for name, saved in state.items():
                    self._adapter_params[name].copy_(saved)
        else:
            self.model.load_state_dict(state)
        self.version = version

    def loaded_view(self) -> Callable[[list[str]], list[tuple[str, torch.Tensor]]] | None:
        """What load_weights wrote, by the names it took (ReadsBack); None on a LoRA base
        (its fingerprint covers every adapter, a publish may carry some)."""
        if self.model is None or self.adapters:
            return None
        targets = self._targets()
        return lambda names: [(name, targets[name]) for name in names]

    def weights_digest(self) -> str:
        """Fingerprint of the weights generation uses (drmas.transports.digest): on a LoRA
        base, of every adapter (those the last publish carried and those it did not) and
        nothing of the base, as the learner fingerprints a version."""
        if self.model is None:
            return ""
        if self.adapters:
            return digest_of(self._adapter_params.items())
        return digest_of(self.model.named_parameters())

    # ------------------------------------------------- one step (scheduler.Stepper)

    def running(self) -> list[Row]:
        return self._batch.rows if self._batch else []

    def room(self) -> int:
        """Free batch slots; none while rows run whose cache cannot be merged into."""
        running = self.num_running
        if running and not self._merge_ok:
            return 0
        return self.cfg.max_batch - running

    def clear_running(self) -> None:
        self._batch = None

    async def step(self, newcomers: list[Row]) -> None:
        """The step's compute in a worker thread; its finished rows are answered here, on
        the event loop (asyncio futures are not thread-safe)."""
        for row, result in await asyncio.to_thread(self._step, newcomers):
            if not row.future.done():  # its caller may have given up meanwhile
                row.future.set_result(result)

    def _step(self, newcomers: list[Row]) -> list[tuple[Row, GenerateResult]]:
        """Prefill the newcomers, decode every running row; the rows that finished."""
        cpu_share.adjust()  # this worker thread's torch threads: the CPUs free right now
        self._finished = []
        with torch.inference_mode():
            if newcomers:
                fresh = self._prefill(newcomers)
                if fresh is not None:
                    self._batch = fresh if self._batch is None else self._merge(self._batch, fresh)
            if self._batch is not None:
                self._decode(self._batch)
        finished, self._finished = self._finished, []
        return finished

    def _forward(
        self,
        rows: list[Row],
        ids: torch.Tensor,
        batch_mask: torch.Tensor,
        pos: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Next-token logits [B, V] of each row, with its own adapter on a LoRA base."""
        assert self.model is not None
        kwargs: dict[str, Any] = {self._cache_kwarg: cache}
        if self.adapters:
            kwargs["adapter_names"] = [row.request.adapter or BASE_ADAPTER for row in rows]
        out = self.model(
            input_ids=ids,
            attention_mask=batch_mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[:, -1].float()

    def _prefill(self, rows: list[Row]) -> Batch | None:
        from transformers import DynamicCache

        assert self.model is not None
        width = max(len(row.request.prompt_ids) for row in rows)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            prompt = row.request.prompt_ids
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
            row.version = self.version
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Same position ids as transformers' generate: 0.. over the real tokens.
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(rows, ids, mask, positions, cache)
        batch = Batch(
            rows=rows,
            cache=cache,
            mask=mask,
            next_pos=mask.sum(-1),
            last=torch.zeros(len(rows), dtype=torch.long, device=self.device),
            temperature=torch.tensor(
                [row.request.temperature for row in rows], dtype=torch.float32, device=self.device
            ),
            top_p=torch.tensor(
                [row.request.top_p for row in rows], dtype=torch.float32, device=self.device
            ),
        )
        self._merge_ok = all(is_plain_layer(layer) for layer in cache.layers)
        return self._advance(batch, logits)

    def _decode(self, batch: Batch) -> None:
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], 1))], dim=1)
        logits = self._forward(
            batch.rows, batch.last[:, None], batch.mask, batch.next_pos[:, None], batch.cache
        )
        batch.next_pos = batch.next_pos + 1
        self._batch = self._advance(batch, logits)

    def _sample(self, batch: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, log-probs) [B]; log-prob = log_softmax(logits / T) before top-p, with
        T = 1 for greedy rows (T = 0)."""
        greedy = batch.temperature <= 0
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            probs = logp.exp()
            if batch.any_top_p:
                probs = top_p_filter(probs, batch.top_p)
            sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(1)
            tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1).clamp(max=0.0)

    def _advance(self, batch: Batch, logits: torch.Tensor) -> Batch | None:
        """Sample one token per row, resolve finished rows, return the live remainder."""
        tokens, logprobs = self._sample(batch, logits)
        batch.last = tokens
        self.tokens_generated += len(batch.rows)
        keep: list[int] = []
        for i, (row, token, logprob) in enumerate(
            zip(batch.rows, tokens.tolist(), logprobs.tolist())
        ):
            if row.future.done():  # cancelled by its caller
                continue
            row.tokens.append(token)
            row.logprobs.append(logprob)
            request = row.request
            if token in self.eos_token_ids or (request.stop and hit_stop(self.tokenizer, row)):
                reason = "stop"
            elif len(row.tokens) >= request.max_new_tokens:
                reason = "length"
            else:
                keep.append(i)
                continue
            self._finished.append(
                (row, GenerateResult(row.tokens, row.logprobs, reason, row.version))
            )
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            self._select(batch, keep)
        return batch

    def _select(self, batch: Batch, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        batch.rows = [batch.rows[i] for i in keep]
        batch.mask = batch.mask.index_select(0, index)
        batch.next_pos = batch.next_pos.index_select(0, index)
        batch.last = batch.last.index_select(0, index)
        batch.temperature = batch.temperature.index_select(0, index)
        batch.top_p = batch.top_p.index_select(0, index)
        if not self._merge_ok:
            batch.cache.batch_select_indices(index)
            return
        # Cut the leading columns no live row attends to (left padding of finished rows).
        start = int(batch.mask.any(dim=0).long().argmax())
        batch.mask = batch.mask[:, start:]
        layers: list[Any] = list(batch.cache.layers)
        for layer in layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def _merge(self, old: Batch, new: Batch) -> Batch:
        """One batch from two: the shorter cache is left-padded with masked zeros."""
        length = max(old.mask.shape[1], new.mask.shape[1])
        pairs: list[Any] = list(zip(old.cache.layers, new.cache.layers))
        for a, b in pairs:
            a.keys = torch.cat([pad_left(a.keys, length, 2), pad_left(b.keys, length, 2)])
            a.values = torch.cat([pad_left(a.values, length, 2), pad_left(b.values, length, 2)])
        return Batch(
            rows=old.rows + new.rows,
            cache=old.cache,
            mask=torch.cat([pad_left(old.mask, length, 1), pad_left(new.mask, length, 1)]),
            next_pos=torch.cat([old.next_pos, new.next_pos]),
            last=torch.cat([old.last, new.last]),
            temperature=torch.cat([old.temperature, new.temperature]),
            top_p=torch.cat([old.top_p, new.top_p]),
        )
