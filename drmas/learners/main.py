"""The learner process of one model's group: setup -> loop(pull batch, step, publish) -> cleanup.

Started once per rank (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every rank
talks to the broker itself (its own shard, its own heartbeats); rank 0 alone reports steps
and publishes weights. Decisions that change which collectives run next (train, wait or
stop; publish to how many actors) are made by rank 0 and broadcast, so every rank always
runs the same collectives in the same order.

Message sequence per version v (rank 0 unless noted):
    BatchRequest(v) -> BatchShard | NoBatch        every rank, for its own shard
    StepReport(v + 1)                              after the optimizer step
    PublishRequest(v + 1) -> WeightGroupPlan       always, also when no actor is attached
    [broadcast over the plan's weight group]       only when the plan has members
    PublishDone(v + 1)                             only then (ok=False when it failed); a plan
                                                   without members is closed by the broker
    [checkpoint of v + 1]                          every rank, when checkpoint.every divides it

With run.resume the group loads the checkpoint of the version the broker's Welcome names
(drmas/checkpoints/learner.py); the actors still hold older weights, so the broker answers
the first batch requests with republish and rank 0 sends them the resumed weights.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from drmas.checkpoints import learner as checkpoints
from drmas.checkpoints import store
from drmas.learners.trainer import Trainer
from drmas.protocol.messages import (
    BatchRequest,
    BatchShard,
    Goodbye,
    Heartbeat,
    NoBatch,
    PublishDone,
    PublishRequest,
    Shutdown,
    StepReport,
    WeightGroupPlan,
)
from drmas.threads import env_threads
from drmas.transports.channel import BrokerClient
from drmas.transports.digest import Digest, hashing
from drmas.transports.weights import WeightSender, WeightSyncError

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.learner")

T = TypeVar("T")

# What rank 0 tells the group after asking the broker for a batch.
TRAIN, WAIT, STOP, REPUBLISH = 0, 1, 2, 3


def run_learner(cfg: DrmasConfig, model: str, rank: int, world_size: int) -> None:
    """Train `model` as rank `rank` of its learner group until train.steps or the broker
    says done; then save the model to RUN_DIR/models/<model>."""
    device = learner_device(cfg.learner.device)
    threads = cpu_threads(cfg.learner.threads)
    if threads:
        torch.set_num_threads(threads)
    if cfg.weights.timeout_s >= cfg.learner.timeout_s:
        log.warning(
            "weights.timeout_s (%.0f) >= learner.timeout_s (%.0f): the other learner ranks "
            "may time out while rank 0 waits for actors to join a weight group",
            cfg.weights.timeout_s, cfg.learner.timeout_s,
        )  # fmt: skip
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=cfg.learner.timeout_s),
    )
    client: BrokerClient | None = None
    sender: WeightSender | None = None
    try:
        trainer = Trainer(cfg, model, rank, world_size, device)
        client = BrokerClient(
            cfg.broker.address,
            f"learner-{model}-{rank}",
            max_message_bytes=cfg.broker.max_message_bytes,
            security=cfg.security,
        )
        welcome = client.hello(
            "learner", [model], rank=rank, world_size=world_size, timeout_s=cfg.learner.timeout_s
        )
        version = broadcast_int(welcome.model_versions[model], device)
        beat = Heartbeats(client, model, version, welcome.heartbeat_interval_s)
        sender = WeightSender(cfg.weights, device, cfg.broker.address) if rank == 0 else None
        if sender is not None:  # the one port of this process other hosts must reach
            log.info("%s weight store listening on %s only", model, sender.store_address)
        saved = resume(cfg, trainer, version)
        log.info(
            "%s rank %d/%d ready at version %d on %s", model, rank, world_size, version, device
        )

        while version < cfg.train.steps:

            def republish(v: int = version) -> None:
                publish(client, trainer, sender, model, v, cfg, beat, device)

            asked = time.monotonic()
            shard = next_shard(
                client, cfg, model, rank, world_size, version, beat, device, republish
            )
            if shard is None:
                break
            got = time.monotonic()
            metrics = trainer.step(shard, tick=beat.maybe_send)
            # where this learner's time goes: waiting for data vs training (is it the bottleneck?)
            metrics[f"batch_wait_s/{model}"] = got - asked
            metrics[f"train_s/{model}"] = time.monotonic() - got
            version += 1
            beat.version = version
            if rank == 0:
                client.send(StepReport(model, version, metrics))
                log.info("%s step %d: %s", model, version, _brief(metrics, model))
            publish(client, trainer, sender, model, version, cfg, beat, device)
            if cfg.checkpoint.every and version % cfg.checkpoint.every == 0:
                saved = save_checkpoint(cfg, trainer, version, beat)

        if saved != version:  # the end is always saved
            save_checkpoint(cfg, trainer, version, beat)
        if cfg.run.dir:
            trainer.save_pretrained(Path(cfg.run.dir) / "models" / model)
        else:
            log.warning("run.dir is empty: %s is not saved", model)
    finally:
        if sender is not None:
            sender.close()  # the group kept for the next publish too
        if client is not None:
            client.send(Goodbye(client.client_id))  # lets a finished broker exit at once
            client.close()
        dist.destroy_process_group()


# ------------------------------------------------------------------------ batches
def next_shard(
    client: BrokerClient,
    cfg: DrmasConfig,
    model: str,
    rank: int,
    world_size: int,
    version: int,
    beat: Heartbeats,
    device: torch.device,
    republish: Callable[[], None],
) -> BatchShard | None:
    """This rank's shard for `version`, or None when the group stops (same on every rank).

    Rank 0 polls the broker and broadcasts TRAIN / WAIT / STOP after each poll, so the other
    ranks never sit in a collective for longer than one poll and keep their heartbeats
    going; once rank 0 holds its shard the batch is cut, and each rank fetches its own."""
    request = BatchRequest(client.client_id, model, rank, world_size, version)
    while True:
        beat.maybe_send()
        code, shard, wait_s = WAIT, None, 0.0
        if rank == 0:
            code, shard, wait_s = ask_for_batch(client, request, cfg)
        code = broadcast_int(code, device)
        if code == STOP:
            return None
        if code == REPUBLISH:  # actors behind (failed sync, late attach): send them `version`
            republish()
            continue
        if code == TRAIN:
            return shard if rank == 0 else fetch_cut_shard(client, request, cfg, beat)
        if rank:
            client.inbox.clear()  # rank 0 alone acts on Shutdown
        time.sleep(wait_s)


def ask_for_batch(
    client: BrokerClient, request: BatchRequest, cfg: DrmasConfig
) -> tuple[int, BatchShard | None, float]:
    """One poll by rank 0: (TRAIN, shard, 0) | (WAIT, None, seconds) | (STOP | REPUBLISH, None, 0)."""
    if _shutdown_requested(client):
        return STOP, None, 0.0
    reply: BatchShard | NoBatch = client.request(
        request, (BatchShard, NoBatch), cfg.learner.timeout_s
    )
    if isinstance(reply, BatchShard):
        return TRAIN, reply, 0.0
    if reply.done or _shutdown_requested(client):
        log.info("%s: broker says training is over (%s)", request.model, reply.reason)
        return STOP, None, 0.0
    if reply.republish:
        return REPUBLISH, None, 0.0
    return WAIT, None, min(max(reply.retry_after_s, cfg.learner.poll_s), 1.0)


def fetch_cut_shard(
    client: BrokerClient, request: BatchRequest, cfg: DrmasConfig, beat: Heartbeats
) -> BatchShard:
    """Ranks > 0, after rank 0 got its shard of the same version: fetch ours."""
    deadline = time.monotonic() + cfg.learner.timeout_s
    while time.monotonic() < deadline:
        reply: BatchShard | NoBatch = client.request(
            request, (BatchShard, NoBatch), cfg.learner.timeout_s
        )
        if isinstance(reply, BatchShard):
            return reply
        if reply.done:
            raise RuntimeError(
                f"broker answered done to {request.model} rank {request.rank} for version "
                f"{request.version} after handing rank 0 its shard; a batch must be cut for "
                "all ranks at once"
            )
        beat.maybe_send()
        time.sleep(min(max(reply.retry_after_s, cfg.learner.poll_s), 1.0))
    raise TimeoutError(
        f"{request.model} rank {request.rank}: no shard for version {request.version} within "
        f"{cfg.learner.timeout_s:.0f}s although rank 0 got its own"
    )


# ------------------------------------------------------------------------ weights
def publish(
    client: BrokerClient,
    trainer: Trainer,
    sender: WeightSender | None,
    model: str,
    version: int,
    cfg: DrmasConfig,
    beat: Heartbeats,
    device: torch.device,
) -> float:
    """Send `version` to the actors the broker names; returns seconds spent (rank 0).

    A failed broadcast (timeout, dead actor) is reported in PublishDone(ok=False) and
    training goes on: those actors re-sync at the next version."""
    plan: WeightGroupPlan | None = None
    if sender is not None:
        request = PublishRequest(model, version, sender.store_address)
        plan = client.request(request, WeightGroupPlan, cfg.weights.timeout_s)
    if plan is not None and (plan.model, plan.version) != (model, version):
        log.warning(
            "plan for %s v%d answered publish of %s v%d", plan.model, plan.version, model, version
        )
    members = broadcast_int(len(plan.members) if plan is not None else 0, device)
    if members == 0:  # nobody to send to; the broker closes such a publish itself
        return 0.0

    # A collective over the learner group: every rank runs it to the end, whatever happens
    # to the broadcast on rank 0.
    gathered = _ticking(
        trainer.full_state_dict_iter(sender.device if sender else None, trainer.publish_dtype), beat
    )
    if sender is None or plan is None:
        for _ in gathered:
            pass
        return 0.0
    start = time.monotonic()
    digest = Digest()
    try:
        stream = hashing(gathered, digest) if cfg.weights.verify_digest else gathered
        stats = sender.publish(
            plan.group_name,
            members + 1,
            stream,
            plan.timeout_s,
            specs=trainer.param_specs(),
            peers=plan.members,
        )
        fingerprint = digest.hexdigest() if cfg.weights.verify_digest else ""
        done = PublishDone(model, version, stats.seconds, stats.bytes, digest=fingerprint)
    except WeightSyncError as exc:
        log.warning("%s v%d: weight broadcast failed, going on: %s", model, version, exc)
        done = PublishDone(model, version, time.monotonic() - start, 0, ok=False, error=str(exc))
    finally:
        for _ in gathered:  # keep gathering in step with the other ranks
            pass
    client.send(done)
    sender.release()  # tear the group down now, while the actors load and resume
    return done.seconds


# ------------------------------------------------------------------------ checkpoints
def resume(cfg: DrmasConfig, trainer: Trainer, version: int) -> int:
    """With run.resume: load the checkpoint of `version`, the version the broker chose for
    this model (its Welcome). Returns the version the learner's state is saved at (-1:
    none yet, so the end of the run saves one)."""
    if not cfg.run.resume:
        return -1
    model_dir = store.root_for(cfg.run.resume, cfg.checkpoint.dir) / trainer.name
    if version == 0:
        log.info(
            "%s: resuming at version 0 (no checkpoint was complete): fresh start", trainer.name
        )
        return -1
    checkpoint = store.find(model_dir, version)
    if checkpoint is None:
        have = [c.version for c in store.complete(model_dir)]
        raise FileNotFoundError(
            f"the broker resumes {trainer.name} at version {version}, but {model_dir} has no "
            f"complete checkpoint of that version (complete: {have}); resume the broker and "
            "the learners from the same run folder"
        )
    checkpoints.load(trainer, checkpoint)
    return version


def save_checkpoint(cfg: DrmasConfig, trainer: Trainer, version: int, beat: Heartbeats) -> int:
    """Collective: save `version` under the run's checkpoint folder; returns `version`."""
    run_dir = cfg.run.dir or cfg.run.resume
    if not (run_dir or cfg.checkpoint.dir):
        log.warning(
            "run.dir and checkpoint.dir are empty: %s v%d is not saved", trainer.name, version
        )
        return version
    beat.maybe_send()
    root = store.root_for(run_dir, cfg.checkpoint.dir)
    checkpoints.save(trainer, root / trainer.name, version, cfg.checkpoint.keep)
    beat.maybe_send()
    return version


# ------------------------------------------------------------------------ helpers
class Heartbeats:
    """Sends Heartbeat(versions={model: version}) at most once per interval when asked."""

    def __init__(self, client: BrokerClient, model: str, version: int, interval_s: float) -> None:
        self.client = client
        self.model = model
        self.version = version
        self.interval_s = interval_s
        self.next_at = 0.0

    def maybe_send(self) -> None:
        now = time.monotonic()
        if now >= self.next_at:
            self.client.send(Heartbeat(self.client.client_id, versions={self.model: self.version}))
            self.next_at = now + self.interval_s


def learner_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def cpu_threads(setting: int) -> int:
    """Threads for this process's torch ops: `setting` if > 0, else the plan `drmas train`
    hands its children in DRMAS_TORCH_THREADS, else 0 (keep torch's default)."""
    if setting > 0:
        return setting
    return env_threads() or 0


def broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's `value` on every rank of the learner group."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def _shutdown_requested(client: BrokerClient) -> bool:
    stop = any(isinstance(m, Shutdown) for m in client.inbox)
    client.inbox.clear()  # nothing else the broker pushes concerns a learner
    return stop


def _ticking(items: Iterator[T], beat: Heartbeats) -> Iterator[T]:
    for item in items:
        beat.maybe_send()
        yield item


def _brief(metrics: dict[str, float], model: str) -> str:
    keys = ("loss", "grad_norm", "clip_frac", "entropy")
    return " ".join(f"{k}={metrics[f'{k}/{model}']:.4g}" for k in keys if f"{k}/{model}" in metrics)
