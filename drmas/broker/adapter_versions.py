"""Per-adapter versions of the LoRA bases, as the broker learns them from the learners.

On a LoRA base (a model with `lora.rank > 0`, docs/lora.md) the model version v counts the
learner group's optimizer steps, but a step changes only the adapters of the agents its
batch held samples of. Each adapter x therefore has its own version U[x]: the steps that
changed it. Learner rank 0 reports U(v), the map at model version v, with every
BatchRequest and PublishRequest (`adapter_versions`; empty for a whole model). The broker
keeps a bounded history of those maps per model and uses it for two things:
- staleness (drmas/broker/buffers.py, through BrokerState): a sample of an agent training
  adapter x, generated at model version v_b and trained at v_l, is U(v_l)[x] - U(v_b)[x]
  versions stale, not v_l - v_b: steps that trained only other adapters did not move x;
- publishes (drmas/broker/publishing.py): a publish of v carries only the adapters whose
  U(v) differs from U(h) for the version h some member of the group holds; every member
  already holds the others bit for bit.
Whenever a version's map is unknown (older than the history, or from before a broker
resume) both fall back to what a whole model does: v_l - v_b, and every adapter.

Fed by the broker loop (drmas/broker/server.py) after the gate (drmas/broker/gate.py) has
checked the map with `check`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from drmas.config import DrmasConfig
from drmas.protocol import ProtocolError

HISTORY = 1024
"""Model versions whose adapter map is kept per LoRA base (U(0), all zeros, always is)."""

Staleness = Callable[[str, int, int], int]
"""(agent, learner version v_l, behaviour version v_b) -> how many versions stale."""


class AdapterVersions:
    """U(v) per LoRA base: adapter -> the learner steps that changed it by model version v."""

    def __init__(self, cfg: DrmasConfig, keep: int = HISTORY) -> None:
        self.keep = keep
        self.adapters = {m: cfg.adapters_of(m) for m in cfg.models if cfg.has_adapters(m)}
        self.adapter_of = {a: cfg.adapter_of(a) for a in cfg.agents}
        # model -> model version -> U at that version (version 0 is never stored: zeros)
        self.history: dict[str, dict[int, dict[str, int]]] = {m: {} for m in self.adapters}

    def check(self, model: str, version: int, versions: Mapping[str, int]) -> None:
        """Raise ProtocolError("invalid") unless `versions` is a valid U(version) of
        `model`: exactly its adapters on a LoRA base, each 0..version; empty otherwise."""
        if model not in self.adapters:
            if versions:
                raise ProtocolError(
                    "invalid",
                    f"{model} trains whole (lora.rank 0) but the message carries adapter "
                    f"versions for {sorted(versions)[:8]}; send an empty adapter_versions",
                )
            return
        expected = self.adapters[model]
        if set(versions) != set(expected):
            raise ProtocolError(
                "invalid",
                f"adapter_versions of {model} v{version} name {sorted(versions)[:8]}; this "
                f"LoRA base has the adapters {sorted(expected)}: send every one of them",
            )
        for adapter, value in versions.items():
            if type(value) is not int or not 0 <= value <= version:
                raise ProtocolError(
                    "invalid",
                    f"adapter {adapter!r} of {model} at v{version} says version {value!r}; "
                    f"an adapter's version is an integer 0..{version} (the steps that changed it)",
                )

    def record(self, model: str, version: int, versions: Mapping[str, int]) -> None:
        """Keep U(version) of `model` (checked first; a whole model's empty map is ignored).
        A learner that rewinds (a resumed run) may report a version again with another map:
        it replaces the old one, and the versions after it, of the lineage left behind, are
        forgotten."""
        self.check(model, version, versions)
        known = self.history.get(model)
        if known is None or version == 0:
            return
        old = known.get(version)
        if old == versions:
            return  # every BatchRequest of a version repeats it: the common case, one compare
        if old is not None:
            for newer in [v for v in known if v > version]:
                del known[newer]
        known[version] = dict(versions)
        while len(known) > self.keep:
            del known[min(known)]

    def at(self, model: str, version: int) -> dict[str, int] | None:
        """U(version) of a LoRA base, or None when the history does not hold it."""
        if version == 0:
            return dict.fromkeys(self.adapters[model], 0)
        return self.history[model].get(version)

    def staleness(self, model: str, agent: str, trained: int, generated: int) -> int:
        """How stale a sample of `agent` made at model version `generated` is when trained
        at `trained`: in its adapter's own versions on a LoRA base when both maps are
        known, else (a whole model, or a map not known) in model versions."""
        if model in self.adapters:
            now, then = self.at(model, trained), self.at(model, generated)
            if now is not None and then is not None:
                adapter = self.adapter_of[agent]
                return now[adapter] - then[adapter]
        return trained - generated

    def staleness_of(self, model: str) -> Staleness | None:
        """The staleness function of `model`'s buffer: None for a whole model (its buffer
        then counts model versions, as it always has)."""
        if model not in self.adapters:
            return None
        return lambda agent, trained, generated: self.staleness(model, agent, trained, generated)

    def to_send(self, model: str, version: int, held: Iterable[int]) -> list[str]:
        """The adapters (sorted) a publish of `version` must carry to members holding the
        model versions `held`: those whose U(version) differs from U(h) for some h; every
        adapter when a map is not known. Empty for a whole model (it sends everything)."""
        if model not in self.adapters:
            return []
        every = sorted(self.adapters[model])
        now = self.at(model, version)
        if now is None:
            return every
        changed: set[str] = set()
        for h in set(held):
            then = self.at(model, h)
            if then is None:
                return every
            changed.update(x for x in every if now[x] != then[x])
        return sorted(changed)
