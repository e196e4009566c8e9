"""Adapter versions on a LoRA base (issue #23, the rest): each adapter's own version U[x]
counts the learner steps that changed it; the learner sends U with every BatchRequest and
PublishRequest and in its StepReport metrics, publishes only the adapters the broker's
plan names (possibly none) while its digest covers every adapter, and checkpoints keep U.

In process: the builtin tiny model as the base with four agents a, b, c, d (four adapters;
tests/unit/test_lora_learner.py's setup), a one-rank gloo group, and learner rank 0's own
code (drmas/learners/main.py's Learner) talking to a fake broker client and publishing
through a real WeightSender to a real WeightReceiver on a thread. Expected versions are
counted by hand from which agents each batch holds; the expected digest is digest_of over
every adapter tensor in the publish dtype, computed apart from the publish.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from drmas.config.model import WarmStartConfig
from drmas.models.builtin import resolve_model_path
from drmas.protocol.messages import (
    BatchRequest,
    JoinWeightGroup,
    PublishDone,
    PublishRequest,
    StepReport,
    WeightGroupPlan,
)
from drmas.transports.digest import digest_of
from tests.unit.test_lora_learner import AGENTS, MODEL, lora_config, make_samples, shard_of

if TYPE_CHECKING:
    from drmas.config import DrmasConfig
    from drmas.learners.main import Learner


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def of(agents: str, per_agent: int = 2) -> list:
    """Samples of these agents only (one letter each)."""
    return [s for s in make_samples(per_agent=per_agent) if s.agent in agents]


def versions(metrics: dict[str, float]) -> dict[str, float]:
    return {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("adapter_version/")}


# ------------------------------------------------------------------ counting
def test_each_adapter_counts_the_batches_that_held_its_agents(
    model_path: Path, group: None
) -> None:
    from drmas.learners.trainer import Trainer

    trainer = Trainer(lora_config(model_path), MODEL, 0, 1, "cpu")
    assert trainer.lora is not None and trainer.lora.versions == dict.fromkeys(AGENTS, 0)
    expected = dict.fromkeys(AGENTS, 0)
    for batch in ("ab", "c", "abcd", "b"):
        metrics = trainer.step(shard_of(of(batch)))
        for agent in batch:
            expected[agent] += 1
        assert trainer.lora.versions == expected, batch
        assert versions(metrics) == {k: float(v) for k, v in expected.items()}, batch
    assert expected == {"a": 2, "b": 3, "c": 2, "d": 1}


def test_several_updates_of_a_batch_count_once_and_shared_adapters_once(
    model_path: Path, group: None
) -> None:
    """Two PPO epochs of two mini-batches are one learner step; agents a and b train one
    adapter "a": a batch of both moves it by one."""
    from drmas.learners.trainer import Trainer

    cfg = lora_config(model_path)
    cfg.learner.ppo_minibatches, cfg.learner.ppo_epochs = 2, 2
    cfg.agents["b"].adapter = "a"
    trainer = Trainer(cfg, MODEL, 0, 1, "cpu")
    assert trainer.lora is not None
    metrics = trainer.step(shard_of(of("abc", per_agent=4)))
    assert metrics[f"updates/{MODEL}"] == 4.0
    assert versions(metrics) == {"a": 1.0, "c": 1.0, "d": 0.0}
    assert trainer.step(shard_of(of("b")))["adapter_version/a"] == 2.0


# -------------------------------------------------------------- checkpoints
def test_a_checkpoint_keeps_the_adapter_versions(
    model_path: Path, group: None, tmp_path: Path
) -> None:
    from drmas.checkpoints import store
    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer

    cfg = lora_config(model_path)
    first = Trainer(cfg, MODEL, 0, 1, "cpu")
    for batch in ("ab", "a", "d"):
        first.step(shard_of(of(batch)))
    folder = ckpt.save(first, tmp_path / MODEL, 3, keep=2)
    manifest = store.read_manifest(folder)
    assert manifest is not None
    assert manifest["adapter_versions"] == {"a": 2, "b": 1, "c": 0, "d": 1}

    def resumed() -> Trainer:
        trainer = Trainer(cfg, MODEL, 0, 1, "cpu")
        found = store.find(tmp_path / MODEL, 3)
        assert found is not None
        ckpt.load(trainer, found)
        return trainer

    again = resumed()
    assert again.lora is not None and again.lora.versions == {"a": 2, "b": 1, "c": 0, "d": 1}
    metrics = again.step(shard_of(of("c")))
    assert versions(metrics) == {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}

    # written before adapters had versions: every adapter at the checkpoint's version
    path = folder / store.MANIFEST
    old = json.loads(path.read_text())
    del old["adapter_versions"]
    path.write_text(json.dumps(old))
    derived = resumed()
    assert derived.lora is not None and derived.lora.versions == dict.fromkeys(AGENTS, 3)

    for bad in ({"a": 2, "b": 1, "c": 0}, {"a": 4, "b": 1, "c": 0, "d": 1}):
        path.write_text(json.dumps(old | {"adapter_versions": bad}))
        with pytest.raises(ValueError, match="adapter versions"):
            resumed()


# ------------------------------------------------------------ the learner
class FakeClient:
    """The broker as learner rank 0 sees it: answers requests from `replies`, in order."""

    client_id = f"learner-{MODEL}-0"

    def __init__(self) -> None:
        self.inbox: list[object] = []
        self.requests: list[object] = []
        self.sent: list[object] = []
        self.replies: list[object] = []

    def request(self, message: object, expect: object, timeout_s: float) -> Any:
        self.requests.append(message)
        return self.replies.pop(0)

    def send(self, message: object) -> None:
        self.sent.append(message)

    def last(self, kind: type) -> Any:
        return [m for m in self.requests + self.sent if isinstance(m, kind)][-1]


@pytest.fixture
def learners(model_path: Path, group: None) -> Iterator[Any]:
    """Builds rank 0 of a one-rank learner group around a FakeClient; closes its store."""
    from drmas.learners.main import Heartbeats, Learner
    from drmas.learners.trainer import Trainer
    from drmas.transports.weights import WeightSender

    made: list[Learner] = []

    def make(cfg: DrmasConfig) -> tuple[Learner, FakeClient]:
        cfg.weights.bucket_mb = 0.01  # several buckets per publish
        cfg.weights.timeout_s = 30.0
        learner = Learner(cfg, MODEL, 0, 1)
        client = FakeClient()
        learner.trainer = Trainer(cfg, MODEL, 0, 1, "cpu")
        learner._client = client  # type: ignore[assignment]
        learner.beat = Heartbeats(client, MODEL, 0, 3600.0)  # type: ignore[arg-type]
        learner.sender = WeightSender(cfg.weights, "cpu")
        made.append(learner)
        return learner, client

    yield make
    for learner in made:
        assert learner.sender is not None
        learner.sender.close()


def publish_to_one_actor(
    learner: Learner, client: FakeClient, receiver: Any, adapters: list[str]
) -> list[tuple[str, torch.Tensor]]:
    """learner.publish() to one actor, `receiver` on a thread; what the actor received."""
    assert learner.sender is not None
    name = f"{MODEL}/actor-0"  # the same members each time: both sides keep the group
    v = learner.version
    client.replies.append(WeightGroupPlan(MODEL, v, name, ["actor-0"], 30.0, adapters=adapters))
    join = JoinWeightGroup(MODEL, v, name, learner.sender.store_address, 1, 2, 30.0)
    received: list[tuple[str, torch.Tensor]] = []
    counted: list[int] = []

    def actor() -> None:
        stats = receiver.receive_into(join, lambda b: received.extend((n, t.clone()) for n, t in b))
        counted.append(stats.tensors)

    thread = threading.Thread(target=actor, daemon=True)
    thread.start()
    learner.publish()
    thread.join(60)
    assert counted == [len(received)], "the actor did not finish receiving"
    return received


def every_adapter(learner: Learner) -> list[tuple[str, torch.Tensor]]:
    """Every adapter tensor at the learner's version in the publish dtype, by wire name."""
    trainer = learner.trainer
    return list(trainer.full_state_dict_iter(dtype=trainer.publish_dtype))


def test_rank_0_sends_the_versions_and_publishes_the_planned_adapters(
    model_path: Path, learners: Any
) -> None:
    from drmas.transports.weights import WeightReceiver

    learner, client = learners(lora_config(model_path, "bf16-mixed"))
    client.replies.append(shard_of(of("ab")))
    shard = learner.next_shard()
    assert shard is not None
    assert client.last(BatchRequest).adapter_versions == dict.fromkeys(AGENTS, 0)
    learner.step(shard, waited_s=0.0)
    report = client.last(StepReport)
    assert (report.version, versions(report.metrics)) == (
        1,
        {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0},
    )

    receiver = WeightReceiver()
    try:
        received = publish_to_one_actor(learner, client, receiver, ["b", "a"])
        assert client.last(PublishRequest).adapter_versions == {"a": 1, "b": 1, "c": 0, "d": 0}
        everything = every_adapter(learner)
        sent = [(n, t) for n, t in everything if n.split(".")[-2] in ("a", "b")]
        assert [n for n, _ in received] == [n for n, _ in sent]  # sorted wire names
        assert len(sent) == len(everything) // 2 and len(sent) > 0
        assert all(
            torch.equal(t, s) and t.dtype == torch.bfloat16
            for (_, t), (_, s) in zip(received, sent)
        )
        done = client.last(PublishDone)
        assert done.ok and (done.model, done.version) == (MODEL, 1)
        assert done.bytes == sum(t.numel() * t.element_size() for _, t in sent)
        assert done.digest == digest_of(everything) != digest_of(sent)  # every adapter

        # every member holds every adapter already: the header lists no tensor
        assert publish_to_one_actor(learner, client, receiver, []) == []
        empty = client.last(PublishDone)
        assert empty is not done and empty.ok and empty.bytes == 0
        assert empty.digest == done.digest  # the same version: the same adapters
    finally:
        receiver.close()

    client.replies.append(WeightGroupPlan(MODEL, 1, "x", ["actor-0"], 1.0, adapters=["zz"]))
    learner.publish()  # a plan naming an adapter this base lacks: refused, not sent
    refused = client.last(PublishDone)
    assert not refused.ok and "zz" in refused.error and refused.bytes == 0


def test_a_whole_model_sends_no_versions_and_publishes_everything(
    model_path: Path, learners: Any
) -> None:
    from drmas.transports.weights import WeightReceiver

    cfg = lora_config(model_path)
    cfg.models[MODEL].lora.rank = 0
    learner, client = learners(cfg)
    client.replies.append(shard_of(of("abcd")))
    shard = learner.next_shard()
    assert shard is not None and client.last(BatchRequest).adapter_versions == {}
    learner.step(shard, waited_s=0.0)
    assert versions(client.last(StepReport).metrics) == {}
    receiver = WeightReceiver()
    try:
        received = publish_to_one_actor(learner, client, receiver, [])  # not used here
    finally:
        receiver.close()
    assert client.last(PublishRequest).adapter_versions == {}
    trainer = learner.trainer
    everything = list(trainer.full_state_dict_iter(dtype=trainer.publish_dtype))
    assert [n for n, _ in received] == [n for n, _ in everything]
    assert client.last(PublishDone).digest == digest_of(everything)
