"""The `sim` engine: the Engine protocol with no model, for scale and scheduling tests.

Who calls it: the same as every engine (base.py): workflow coroutines call `generate`
concurrently, the actor process pauses it, feeds it a weight broadcast through
`load_weights` and reads `weights_digest`. It talks to nothing itself.

Timing model (a GPU-like batched decoder, no compute on this machine). Queueing,
admission, pause/resume and shutdown are the hf engine's own (scheduler.py), so what the
asynchrony benchmarks measure on sim is what the hf engine would do:

* one background task owns the "device"; each iteration it admits pending requests while
  the running batch has room (`max_batch`) and sleeps `sim_prompt_latency_s_per_token` ×
  (their prompt tokens summed) once for that prefill, then
* runs one decode step for every running row: a single sleep of `sim_token_latency_s`
  for the whole batch (so 64 concurrent requests finish as fast as one: concurrency helps
  as it does on a GPU), sampling one token per row;
* a row ends with "stop" when its token is EOS (probability `sim_stop_prob` per token) or
  a stop string appears, else with "length" at `max_new_tokens`.

Tokens are uniform over [0, V) minus the special ids (V = the model's vocabulary, or
`sim_vocab_size` if smaller), so every id passes the broker's vocabulary check; each
log-prob is the log of a uniform over those ids and EOS: finite and <= 0. The random stream is seeded from the engine seed
and the model name. `prefill_steps` / `decode_steps` count the batched steps, so tests can
check batching without reading a clock.

Weights: nothing is loaded from disk (only the tokenizer, which workflows need). A broadcast
is consumed tensor by tensor into a digest (drmas.transports.digest) over exactly what
arrived, so the broker's learner-vs-actor fingerprint check passes, and `version` is set.
On a LoRA base a publish carries only the adapters that changed while the learner
fingerprints all of them, so there the digest is kept by name across versions, starting
from every adapter's initial tensors (lora_folders.initial_adapter_tensors, built without
the base): what arrives replaces its names, the rest stays as last received.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.actors.engines.scheduler import RequestScheduler, Row, hit_stop
from drmas.config.actor import EngineConfig

if TYPE_CHECKING:
    import torch

    from drmas.config.model import LoraConfig
    from drmas.transports.digest import Digest
    from drmas.transports.weights.layout import Expected

log = logging.getLogger("drmas.engine.sim")


class SimEngine:
    """Engine protocol (drmas/actors/engines/base.py) with a timing model instead of a model."""

    def __init__(
        self,
        model_name: str,
        model_path: str | Path,
        cfg: EngineConfig,
        lora: LoraConfig | None = None,
        adapters: Sequence[str] = (),
    ) -> None:
        """`lora`, `adapters`: a LoRA base's settings and adapter names (None, () for a whole
        model); they only shape the weights digest, since sim runs no model."""
        if cfg.max_batch < 1:
            raise ValueError(f"actor.engine.max_batch must be >= 1, got {cfg.max_batch}")
        if cfg.sim_token_latency_s < 0 or cfg.sim_prompt_latency_s_per_token < 0:
            raise ValueError(
                "actor.engine.sim_token_latency_s and sim_prompt_latency_s_per_token must be "
                f">= 0, got {cfg.sim_token_latency_s} and {cfg.sim_prompt_latency_s_per_token}"
            )
        if not 0.0 <= cfg.sim_stop_prob <= 1.0:
            raise ValueError(
                f"actor.engine.sim_stop_prob must be in [0, 1], got {cfg.sim_stop_prob}"
            )
        if cfg.sim_vocab_size < 0:
            raise ValueError(f"actor.engine.sim_vocab_size must be >= 0, got {cfg.sim_vocab_size}")
        self.model_name = model_name
        self.model_path = Path(model_path) if str(model_path) else None
        self.lora = lora
        self.adapters = list(adapters)
        self.cfg = cfg
        self.version = 0
        self.tokenizer: Any = None
        self.vocab_size = 0
        """Ids a prompt may use (the model's vocabulary)."""
        self.eos_token_id = 0
        self.tokens_generated = 0
        """Tokens sampled since start (all requests)."""
        self.prefill_steps = 0
        """Batched prefills run (one per admission of pending requests)."""
        self.decode_steps = 0
        """Batched decode steps run (one sleep each, whatever the batch size)."""
        self.weight_loads = 0
        """load_weights calls (one per received bucket)."""
        self._rng = random.Random(cfg.seed * 1_000_003 + zlib.crc32(model_name.encode()))
        self._sample_ids: list[int] = []
        self._logprob = 0.0
        self._digest: Digest | None = None
        self._digest_version = -1
        self._running: list[Row] = []
        self._scheduler = RequestScheduler("sim", model_name, self)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self._load_tokenizer)
        self._scheduler.start()

    def _load_tokenizer(self) -> None:
        """The model folder's tokenizer (never its weights), or the builtin character
        tokenizer when no folder is given."""
        if self.model_path is None:
            from drmas.models.builtin import char_tokenizer

            self.tokenizer = char_tokenizer()
            model_vocab = len(self.tokenizer)
        else:
            from transformers import AutoTokenizer

            if not self.model_path.is_dir():
                raise FileNotFoundError(
                    f"sim engine for {self.model_name!r}: {self.model_path} is not a model "
                    "folder (it needs the tokenizer and config.json; run `drmas prepare`)"
                )
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            model_vocab = _config_vocab_size(self.model_path) or len(self.tokenizer)
        self.vocab_size = model_vocab
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = int(eos) if eos is not None else 0
        limit = min(model_vocab, self.cfg.sim_vocab_size or model_vocab)
        special = set(getattr(self.tokenizer, "all_special_ids", []))
        self._sample_ids = [i for i in range(limit) if i not in special] or list(range(limit))
        self._logprob = -math.log(len(self._sample_ids) + 1)  # uniform over ids and EOS
        log.info(
            "%s: sim engine, vocabulary %d (sampling %d ids), eos %d, %.4fs per decode step",
            self.model_name,
            model_vocab,
            len(self._sample_ids),
            self.eos_token_id,
            self.cfg.sim_token_latency_s,
        )

    async def close(self) -> None:
        await self._scheduler.close()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_pending(self) -> int:
        return self._scheduler.num_pending

    # ---------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self._scheduler.submit(request, self.vocab_size, self.version)

    async def pause(self) -> None:
        await self._scheduler.pause()

    async def resume(self) -> None:
        await self._scheduler.resume()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Consume the tensors into a digest of what arrived. The actor calls this once per
        received bucket of a publish: calls with the same version add to one digest, a new
        version starts a fresh one (on a LoRA base: updates the digest of every adapter by
        name, see the module docstring)."""
        from drmas.transports.digest import Digest

        if self.adapters:
            if self._digest is None:
                self._digest = self._initial_adapters_digest()
        elif self._digest is None or version != self._digest_version:
            self._digest, self._digest_version = Digest(), version
        for name, tensor in named_tensors:
            self._digest.add(name, tensor)
        self.weight_loads += 1
        self.version = version

    def expected_weights(self, adapters: Sequence[str]) -> Expected | None:
        """What a publish must carry (drmas/actors/engines/expected.py): every parameter of
        the model folder's architecture, on a LoRA base of the adapters the publish carries;
        None (sizes checked only) without a model folder."""
        from drmas.actors.engines.expected import adapters_expected, folder_expected

        if self.model_path is None:
            return None
        if self.adapters and self.lora is not None:
            return adapters_expected(self.model_path, self.lora, self.adapters, adapters)
        return folder_expected(str(self.model_path))

    def backup_weights(self) -> object:
        import copy

        return self.version, copy.deepcopy(self._digest), self._digest_version, self.weight_loads

    def restore_weights(self, backup: object) -> None:
        assert isinstance(backup, tuple)
        self.version, self._digest, self._digest_version, self.weight_loads = backup

    def weights_digest(self) -> str:
        """Fingerprint of every tensor received for the current version ("" before any); on
        a LoRA base of every adapter, received or initial."""
        return self._digest.hexdigest() if self._digest is not None else ""

    def _initial_adapters_digest(self) -> Digest:
        import torch

        from drmas.actors.engines.lora_folders import initial_adapter_tensors
        from drmas.transports.digest import Digest

        digest = Digest()
        if self.model_path is None or self.lora is None:
            log.warning(
                "%s: sim engine without a model folder on a LoRA base: its digest covers "
                "the adapters received so far only, so it matches the learner's once every "
                "adapter has been published",
                self.model_name,
            )
            return digest
        dtype = getattr(torch, self.cfg.dtype)
        for name, tensor in initial_adapter_tensors(
            self.model_path, self.lora, self.adapters, dtype
        ):
            digest.add(name, tensor)
        return digest

    # ------------------------------------------------- one step (scheduler.Stepper)

    def running(self) -> list[Row]:
        return self._running

    def room(self) -> int:
        return self.cfg.max_batch - len(self._running)

    def clear_running(self) -> None:
        self._running = []

    async def step(self, newcomers: list[Row]) -> None:
        """One prefill sleep for the newcomers together, one decode sleep for the batch."""
        if newcomers:
            prompt_tokens = sum(len(row.request.prompt_ids) for row in newcomers)
            self.prefill_steps += 1
            await asyncio.sleep(prompt_tokens * self.cfg.sim_prompt_latency_s_per_token)
            for row in newcomers:
                row.version = self.version
            self._running.extend(newcomers)
        await asyncio.sleep(self.cfg.sim_token_latency_s)
        self.decode_steps += 1
        self._running = [row for row in self._running if not self._advance(row)]

    def _advance(self, row: Row) -> bool:
        """Sample one token for `row`; True when the row is finished (resolved or dropped)."""
        if row.future.done():  # cancelled by its caller
            return True
        if self._rng.random() < self.cfg.sim_stop_prob:
            token = self.eos_token_id
        else:
            token = self._sample_ids[self._rng.randrange(len(self._sample_ids))]
        row.tokens.append(token)
        row.logprobs.append(self._logprob)
        self.tokens_generated += 1
        request = row.request
        if token == self.eos_token_id or (request.stop and hit_stop(self.tokenizer, row)):
            reason = "stop"
        elif len(row.tokens) >= request.max_new_tokens:
            reason = "length"
        else:
            return False
        row.future.set_result(GenerateResult(row.tokens, row.logprobs, reason, row.version))
        return True


def _config_vocab_size(folder: Path) -> int:
    """vocab_size from the folder's config.json (what the broker validates ids against)."""
    path = folder / "config.json"
    if not path.exists():
        return 0
    data = json.loads(path.read_text())
    return int(data.get("vocab_size") or data.get("text_config", {}).get("vocab_size") or 0)
