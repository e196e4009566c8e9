"""When a publish on a LoRA base is whole, for the sglang engine (sglang_lora.py), without a
server: the buckets come one call at a time and none says it is the last, so the engine
decides from the wire order (every adapter's first name sorts before every other's last)
and from a call without tensors (the publish ended). Refused: names out of order, twice,
with a gap, after the publish was whole, or a publish that ended with an adapter in part.
test_sglang_engine.py runs the same against a fake server over real weight groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drmas.actors.engines.sglang_lora import SGLangAdapters
from drmas.transports.digest import digest_of
from tests.unit.lora_helpers import ADAPTERS, LORA, peft_model, published, tiny_model_folder

Named = list[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def sent(model_path: Path) -> Named:
    return published(peft_model(model_path, seed=1))


class Server:
    """The adapter routes: records each (route, lora_name)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, route: str, body: dict[str, Any]) -> Any:
        self.calls.append((route, body["lora_name"]))
        return {"success": True}


def started(model_path: Path) -> tuple[SGLangAdapters, Server]:
    server = Server()
    adapters = SGLangAdapters("m", model_path, LORA, ADAPTERS, server)
    adapters.start()
    return adapters, server


def of(named: Named, adapter: str) -> Named:
    return [(n, t) for n, t in named if f".{adapter}." in n]


def test_each_adapter_alone_loads_at_its_last_tensor(model_path: Path, sent: Named) -> None:
    """The verifier alone, one tensor per call: loaded exactly at its last tensor (the
    solver's first name sorts before it, so the solver is not in this publish); then the
    solver alone. A digest over both, the verifier's version kept."""
    adapters, server = started(model_path)
    verifier = of(sent, "verifier")
    loaded = [adapters.receive([pair], 1) for pair in verifier]
    assert loaded == [False] * (len(verifier) - 1) + [True]
    assert server.calls == [("/load_lora_adapter", "verifier-v1-1")]
    assert adapters.slots.current == {}  # staged: it serves once committed
    assert adapters.commit() == 1 and sorted(adapters.slots.current) == ["verifier"]
    kept = adapters.slots.current["verifier"]
    assert adapters.receive(of(sent, "solver"), 2) and adapters.commit() == 2
    assert adapters.slots.current["verifier"] is kept
    assert adapters.digest == digest_of(sent)
    assert adapters.receive([], 2)  # the actor's end of that publish: nothing more
    assert server.calls[1:] == [("/load_lora_adapter", "solver-v2-2")]
    adapters.close()


def test_a_publish_of_nothing_loads_nothing(model_path: Path, sent: Named) -> None:
    adapters, server = started(model_path)
    assert adapters.receive([], 1) and adapters.commit() == 1
    assert server.calls == [] and adapters.slots.current == {}
    assert adapters.receive(sent, 2) and adapters.commit() == 2
    assert adapters.receive([], 3) and adapters.commit() == 3
    assert adapters.digest == digest_of(sent) and len(server.calls) == 2
    adapters.close()


def test_a_publish_that_ends_with_an_adapter_in_part_fails(model_path: Path, sent: Named) -> None:
    """Both adapters began to arrive: not whole until each has all its tensors; a call
    without tensors while they are in part fails the publish and forgets it."""
    adapters, server = started(model_path)
    assert not adapters.receive(sent[:-1], 1)
    with pytest.raises(ValueError, match=r"ended with adapter\(s\) \['solver', 'verifier'\]"):
        adapters.receive([], 1)
    assert server.calls == [] and adapters.slots.current == {}
    assert adapters.receive(sent, 1) and adapters.commit() == 1  # the re-publish loads whole
    adapters.close()


@pytest.mark.parametrize(
    ("mangle", "problem"),
    [
        (lambda s: [s[1], s[0], *s[2:]], "not sorted, or twice"),
        (lambda s: [s[0], s[0], *s[1:]], "not sorted, or twice"),
        (lambda s: s[:2] + s[4:], "skipped .*lora_B.solver"),
        (lambda s: [*s, ("base_model.model.model.norm.weight", torch.ones(16))], "not a tensor"),
    ],
)
def test_a_publish_out_of_order_twice_or_with_a_gap_is_refused(
    model_path: Path, sent: Named, mangle: Any, problem: str
) -> None:
    adapters, server = started(model_path)
    with pytest.raises(ValueError, match=problem):
        adapters.receive(mangle(sent), 1)
    assert server.calls == [] and adapters.slots.current == {}
    assert adapters.receive(sent, 2) and adapters.commit() == 2
    assert adapters.digest == digest_of(sent)
    with pytest.raises(ValueError, match="after version 2's publish was whole"):
        adapters.receive(sent[:1], 2)
    adapters.close()


def test_a_staged_publish_serves_only_once_committed(model_path: Path, sent: Named) -> None:
    """Whole is not verified: a publish is staged in the server when its last tensor
    arrives, before the receiver checks the digest trailer. Discarded (the check failed),
    its new versions are unloaded and the previous ones keep serving; committed, it
    serves."""
    adapters, server = started(model_path)
    assert adapters.receive(sent, 1) and adapters.commit() == 1
    serving = dict(adapters.slots.current)
    before = adapters.digest
    other = published(peft_model(model_path, seed=2))
    assert adapters.receive(other, 2)
    assert adapters.staged_digest == digest_of(other) != before
    assert adapters.slots.current == serving and adapters.acquire("solver") is serving["solver"]
    adapters.discard()  # the actor's restore_weights after a digest mismatch
    assert adapters.slots.current == serving and adapters.digest == before
    assert adapters.staged_digest == "" and adapters.commit() is None
    assert server.calls[-2:] == [
        ("/unload_lora_adapter", "solver-v2-3"), ("/unload_lora_adapter", "verifier-v2-4"),
    ]  # fmt: skip
    assert adapters.root is not None
    assert sorted(p.name for p in adapters.root.iterdir()) == sorted(
        loaded.lora_name for loaded in serving.values()
    )
    assert adapters.receive(other, 3) and adapters.commit() == 3
    assert adapters.digest == digest_of(other)
    adapters.close()
