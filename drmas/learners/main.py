"""The learner process of one model's group: setup -> loop(pull batch, step, publish) -> cleanup.

Run once per rank by drmas/learners/entry.py, which places the rank in its group (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun, `drmas train` or Slurm). Every rank
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

On a LoRA base (models.<m>.lora.rank > 0) BatchRequest and PublishRequest also carry each
adapter's own version at v (adapter_versions: the steps that changed it), a publish
carries only the adapters the plan names (WeightGroupPlan.adapters, possibly none: the
header then lists zero tensors) while PublishDone.digest fingerprints every adapter at the
version, and the final save writes the base plus a PEFT folder per adapter
(drmas/learners/adapters.py).

With run.resume the group loads the checkpoint of the version the broker's Welcome names
(drmas/learners/checkpoint.py); the actors still hold older weights, so the broker answers
the first batch requests with republish and rank 0 sends them the resumed weights.

A rank the broker no longer knows (ErrorReply unknown_client: it was dropped after
broker.learner_timeout_s of silence, or the broker restarted) stops with LearnerDropped,
which says so: every later request would be refused too, and its seat is not taken back
behind the broker's back.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from drmas.checkpoints import store
from drmas.learners import checkpoint
from drmas.learners.leaving import goodbye
from drmas.learners.trainer import Trainer
from drmas.protocol.messages import (
    BatchRequest,
    BatchShard,
    ErrorReply,
    Heartbeat,
    NoBatch,
    PublishDone,
    PublishRequest,
    Shutdown,
    StepReport,
    WeightGroupPlan,
)
from drmas.transports.channel import BrokerClient, BrokerRefused
from drmas.transports.digest import Digest, hashing
from drmas.transports.learner_secret import load_secret, proof
from drmas.transports.weights import TensorSpec, WeightSender, WeightSyncError

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.learner")

T = TypeVar("T")

# What rank 0 tells the group after asking the broker for a batch.
TRAIN, WAIT, STOP, REPUBLISH = 0, 1, 2, 3


class LearnerDropped(RuntimeError):
    """The broker answered unknown_client: it no longer knows this learner rank."""


class Learner:
    """Rank `rank` of `model`'s learner group: trains until train.steps or the broker says
    done, then saves the model to RUN_DIR/models/<model>. `run()` is the whole life."""

    trainer: Trainer
    beat: Heartbeats

    def __init__(self, cfg: DrmasConfig, model: str, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.device = learner_device(cfg.learner.device)
        self.version = 0
        """Optimizer steps taken: the version of the weights this rank holds."""
        self.saved = -1
        """The version the learner's state is checkpointed at (-1: none yet)."""
        self._client: BrokerClient | None = None
        self.sender: WeightSender | None = None
        """Rank 0 only: the weight group store the actors join."""

    @property
    def client(self) -> BrokerClient:
        if self._client is None:
            raise RuntimeError("Learner.setup() has not connected to the broker yet")
        return self._client

    def run(self) -> None:
        """setup -> loop(pull shard, step, publish, checkpoint) -> final save -> cleanup."""
        self.join_group()
        try:
            self.setup()
            while self.version < self.cfg.train.steps:
                asked = time.monotonic()
                shard = self.next_shard()
                if shard is None:
                    break
                self.step(shard, waited_s=time.monotonic() - asked)
                self.publish()
                if self.cfg.checkpoint.every and self.version % self.cfg.checkpoint.every == 0:
                    self.save_checkpoint()
            if self.version >= self.cfg.train.steps:  # until the run is done: an actor that
                self.next_shard()  # missed the last publish gets it again (final validation)
            self.finish()
        except BrokerRefused as exc:
            if exc.code != "unknown_client":
                raise
            raise self.dropped(str(exc)) from None
        finally:
            self.cleanup()

    def dropped(self, refusal: str) -> LearnerDropped:
        """The error this rank stops with once the broker no longer knows it (logged too)."""
        cid = self._client.client_id if self._client is not None else "?"
        message = (
            f"{self.model} rank {self.rank} stops: the broker no longer knows this learner "
            f"({cid!r}; {refusal}). It dropped the rank after broker.learner_timeout_s="
            f"{self.cfg.broker.learner_timeout_s:g} s of silence, or the broker restarted; "
            "every later request would be refused too. Restart the run (with "
            "run.resume=RUN_DIR it continues from the last complete checkpoint)."
        )
        log.error("%s", message)
        return LearnerDropped(message)

    # ----------------------------------------------------------------- setup
    def join_group(self) -> None:
        """The torch.distributed group of this model's ranks (torchrun's rendezvous env)."""
        cfg = self.cfg
        if cfg.weights.timeout_s >= cfg.learner.timeout_s:
            log.warning(
                "weights.timeout_s (%.0f) >= learner.timeout_s (%.0f): the other learner ranks "
                "may time out while rank 0 waits for actors to join a weight group",
                cfg.weights.timeout_s, cfg.learner.timeout_s,
            )  # fmt: skip
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=cfg.learner.timeout_s),
        )

    def setup(self) -> None:
        """Load and shard the model, say Hello, take the broker's version of the model
        (loading its checkpoint with run.resume); rank 0 opens its weight store."""
        cfg, model, rank = self.cfg, self.model, self.rank
        secret = load_secret(cfg.security)  # the run's: proves this rank may take its seat
        self.trainer = Trainer(cfg, model, rank, self.world_size, self.device)
        client_id = f"learner-{model}-{rank}"
        self._client = BrokerClient(
            cfg.broker.address,
            client_id,
            max_message_bytes=cfg.broker.max_message_bytes,
            security=cfg.security,
        )
        welcome = self._client.hello(
            "learner",
            [model],
            rank=rank,
            world_size=self.world_size,
            timeout_s=cfg.learner.timeout_s,
            proof=proof(secret, client_id, model, rank) if secret is not None else "",
        )
        self.version = broadcast_int(welcome.model_versions[model], self.device)
        self.beat = Heartbeats(self._client, model, self.version, welcome.heartbeat_interval_s)
        if rank == 0:
            self.sender = WeightSender(cfg.weights, self.device, cfg.broker.address)
            # the one port of this process other hosts must reach
            log.info("%s weight store listening on %s only", model, self.sender.store_address)
        self.saved = self.resume()
        log.info(
            "%s rank %d/%d ready at version %d on %s",
            model, rank, self.world_size, self.version, self.device,
        )  # fmt: skip

    # ------------------------------------------------------------------ loop
    def next_shard(self) -> BatchShard | None:
        """This rank's shard for `version`, or None when the group stops (same on every rank).

        Rank 0 polls the broker and broadcasts TRAIN / WAIT / STOP after each poll, so the
        other ranks never sit in a collective for longer than one poll and keep their
        heartbeats going; once rank 0 holds its shard the batch is cut, and each rank
        fetches its own."""
        request = BatchRequest(
            self.client.client_id,
            self.model,
            self.rank,
            self.world_size,
            self.version,
            adapter_versions=self.adapter_versions(),
        )
        while True:
            self.beat.maybe_send()
            code, shard, wait_s = WAIT, None, 0.0
            if self.rank == 0:
                code, shard, wait_s = self.ask_for_batch(request)
            code = broadcast_int(code, self.device)
            if code == STOP:
                return None
            if code == REPUBLISH:  # actors behind (failed sync, late attach): send them `version`
                self.publish()
                continue
            if code == TRAIN:
                return shard if self.rank == 0 else self.fetch_cut_shard(request)
            if self.rank:
                # rank 0 alone acts on Shutdown; an unknown_client refusal stops every rank
                _shutdown_requested(self.client)
            time.sleep(wait_s)

    def ask_for_batch(self, request: BatchRequest) -> tuple[int, BatchShard | None, float]:
        """One poll by rank 0: (TRAIN, shard, 0) | (WAIT, None, seconds) | (STOP | REPUBLISH, None, 0)."""
        if _shutdown_requested(self.client):
            return STOP, None, 0.0
        reply: BatchShard | NoBatch = self.client.request(
            request, (BatchShard, NoBatch), self.cfg.learner.timeout_s
        )
        if isinstance(reply, BatchShard):
            return TRAIN, reply, 0.0
        if reply.done or _shutdown_requested(self.client):
            log.info("%s: broker says training is over (%s)", request.model, reply.reason)
            return STOP, None, 0.0
        if reply.republish:
            return REPUBLISH, None, 0.0
        return WAIT, None, self._retry_s(reply)

    def fetch_cut_shard(self, request: BatchRequest) -> BatchShard:
        """Ranks > 0, after rank 0 got its shard of the same version: fetch ours."""
        timeout_s = self.cfg.learner.timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply: BatchShard | NoBatch = self.client.request(
                request, (BatchShard, NoBatch), timeout_s
            )
            if isinstance(reply, BatchShard):
                return reply
            if reply.done:
                raise RuntimeError(
                    f"broker answered done to {request.model} rank {request.rank} for version "
                    f"{request.version} after handing rank 0 its shard; a batch must be cut for "
                    "all ranks at once"
                )
            self.beat.maybe_send()
            time.sleep(self._retry_s(reply))
        raise TimeoutError(
            f"{request.model} rank {request.rank}: no shard for version {request.version} "
            f"within {timeout_s:.0f}s although rank 0 got its own"
        )

    def _retry_s(self, reply: NoBatch) -> float:
        return min(max(reply.retry_after_s, self.cfg.learner.poll_s), 1.0)

    def step(self, shard: BatchShard, waited_s: float) -> None:
        """One optimizer step on the shard; rank 0 reports it. `waited_s`: how long the
        shard took to come (is this learner the bottleneck, or the actors?)."""
        start = time.monotonic()
        metrics = self.trainer.step(shard, tick=self.beat.maybe_send)
        self.trainer.refuse_non_finite(self.version + 1)  # before it is reported or published
        metrics[f"batch_wait_s/{self.model}"] = waited_s
        metrics[f"train_s/{self.model}"] = time.monotonic() - start
        self.version += 1
        self.beat.version = self.version
        if self.rank == 0:
            self.client.send(StepReport(self.model, self.version, metrics))
            log.info("%s step %d: %s", self.model, self.version, _brief(metrics, self.model))

    def publish(self) -> float:
        """Send `version` to the actors the broker names; returns seconds spent (rank 0).

        A failed broadcast (timeout, dead actor) is reported in PublishDone(ok=False) and
        training goes on: those actors re-sync at the next version."""
        plan: WeightGroupPlan | None = None
        if self.sender is not None:
            request = PublishRequest(
                self.model,
                self.version,
                self.sender.store_address,
                adapter_versions=self.adapter_versions(),
            )
            plan = self.client.request(request, WeightGroupPlan, self.cfg.weights.timeout_s)
        if plan is not None and (plan.model, plan.version) != (self.model, self.version):
            log.warning(
                "plan for %s v%d answered publish of %s v%d",
                plan.model, plan.version, self.model, self.version,
            )  # fmt: skip
        members = broadcast_int(len(plan.members) if plan is not None else 0, self.device)
        if members == 0:  # nobody to send to; the broker closes such a publish itself
            return 0.0
        # A collective over the learner group: every rank runs it to the end, come what may
        device = self.sender.device if self.sender is not None else None
        # no copy: the publish is done with each tensor before the next step changes it
        gathered = _ticking(self.trainer.weights_out(device, self.version), self.beat)
        if self.sender is None or plan is None:
            for _ in gathered:
                pass
            return 0.0
        return self._broadcast(self.sender, plan, members, gathered)

    def _broadcast(
        self,
        sender: WeightSender,
        plan: WeightGroupPlan,
        members: int,
        gathered: Iterator[tuple[str, torch.Tensor]],
    ) -> float:
        """Rank 0's part of a publish: stream the gathered tensors into the plan's weight
        group, then tell the broker how it went (PublishDone)."""
        model, version = self.model, self.version
        start = time.monotonic()
        digest = Digest()
        verify = self.cfg.weights.verify_digest
        try:
            stream = hashing(gathered, digest) if verify else gathered
            specs, stream = self._planned(plan, stream)
            stats = sender.publish(
                plan.group_name,
                members + 1,
                stream,
                plan.timeout_s,
                specs=specs,
                peers=plan.members,
                token=plan.token,
                digest=digest if verify else None,
                version=version,
            )
            sent_any = len(stats.left_out) < members  # else nothing was streamed (nor hashed)
            fingerprint = digest.hexdigest() if verify and sent_any else ""
            left_out = [plan.members[rank - 1] for rank in stats.left_out]
            done = PublishDone(
                model, version, stats.seconds, stats.bytes, digest=fingerprint, left_out=left_out
            )
        except WeightSyncError as exc:
            log.warning("%s v%d: weight broadcast failed, going on: %s", model, version, exc)
            seconds = time.monotonic() - start
            broke = [plan.members[r - 1] for r in exc.absent if r <= len(plan.members)]
            done = PublishDone(model, version, seconds, 0, False, str(exc), broke=broke)
        finally:
            for _ in gathered:  # keep gathering in step with the other ranks
                pass
            digest.wait()  # no hash still reading the weights the next step changes
        self.client.send(done)
        sender.release()  # tear the group down now, while the actors load and resume
        return done.seconds

    def _planned(
        self, plan: WeightGroupPlan, stream: Iterator[tuple[str, torch.Tensor]]
    ) -> tuple[list[TensorSpec], Iterator[tuple[str, torch.Tensor]]]:
        """(specs, tensors) of what the publish sends: everything of a whole model; on a
        LoRA base the adapters plan.adapters names, drawn from `stream`, which still passes
        every adapter through (the digest covers them all)."""
        lora = self.trainer.lora
        if lora is None:
            return self.trainer.param_specs(), stream
        try:
            adapters = lora.to_send(plan.adapters)
        except ValueError as exc:  # a PublishDone(ok=False) that says why
            raise WeightSyncError(str(exc)) from None
        return self.trainer.param_specs(adapters), lora.only(stream, adapters)

    def adapter_versions(self) -> dict[str, int]:
        """U at `version` for the broker (BatchRequest, PublishRequest): on a LoRA base each
        adapter's own version, the same on every rank; {} for a whole model."""
        lora = self.trainer.lora
        return dict(lora.versions) if lora else {}

    # ----------------------------------------------------------- checkpoints
    def resume(self) -> int:
        """With run.resume: load the checkpoint of `version`, the version the broker chose
        for this model (its Welcome). Returns the version the learner's state is saved at
        (-1: none yet, so the end of the run saves one)."""
        cfg, name, version = self.cfg, self.model, self.version
        if not cfg.run.resume:
            return -1
        model_dir = store.root_for(cfg.run.resume, cfg.checkpoint.dir) / name
        if version == 0:
            log.info("%s: resuming at version 0 (no checkpoint was complete): fresh start", name)
            return -1
        found = store.find(model_dir, version)
        if found is None:
            have = [c.version for c in store.complete(model_dir)]
            raise FileNotFoundError(
                f"the broker resumes {name} at version {version}, but {model_dir} has no "
                f"complete checkpoint of that version (complete: {have}); resume the broker "
                "and the learners from the same run folder"
            )
        checkpoint.load(self.trainer, found)
        return version

    def save_checkpoint(self) -> None:
        """Collective: save `version` under the run's checkpoint folder."""
        cfg, name, version = self.cfg, self.model, self.version
        self.saved = version
        run_dir = cfg.run.dir or cfg.run.resume
        if not (run_dir or cfg.checkpoint.dir):
            log.warning("run.dir and checkpoint.dir are empty: %s v%d is not saved", name, version)
            return
        self.beat.maybe_send()
        root = store.root_for(run_dir, cfg.checkpoint.dir)
        checkpoint.save(self.trainer, root / name, version, cfg.checkpoint.keep)
        self.beat.maybe_send()

    # ------------------------------------------------------- end and cleanup
    def finish(self) -> None:
        """Collective: the end is always checkpointed; the model goes to RUN_DIR/models."""
        if self.saved != self.version:
            self.save_checkpoint()
        if self.cfg.run.dir:
            self.trainer.save_pretrained(Path(self.cfg.run.dir) / "models" / self.model)
        else:
            log.warning("run.dir is empty: %s is not saved", self.model)

    def cleanup(self) -> None:
        """Close what setup opened, also after a failure: the weight store, the broker
        connection (a Goodbye first: it lets a finished broker exit at once), the group."""
        if self.sender is not None:
            self.sender.close()  # the group kept for the next publish too
        if self._client is not None:
            # flushed, for at most GOODBYE_FLUSH_S: closed at once, the Goodbye was sometimes
            # dropped and a finished broker waited for the rank's heartbeat grace (75 s)
            goodbye(self._client, "")
        dist.destroy_process_group()


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
    """LearnerConfig.device -> this rank's device (cuda: the GPU torchrun's LOCAL_RANK names)."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's `value` on every rank of the learner group."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def _shutdown_requested(client: BrokerClient) -> bool:
    """Whether the broker said Shutdown; raises BrokerRefused (unknown_client) if it
    refused a fire-and-forget message (Heartbeat, StepReport) as from an unknown client."""
    unknown = [m for m in client.inbox if isinstance(m, ErrorReply) and m.code == "unknown_client"]
    stop = any(isinstance(m, Shutdown) for m in client.inbox)
    client.inbox.clear()  # nothing else the broker pushes concerns a learner
    if unknown:
        refused = unknown[0]
        raise BrokerRefused(f"broker refused {refused.refused}: {refused.reason}", refused.code)
    return stop


def _ticking(items: Iterator[T], beat: Heartbeats) -> Iterator[T]:
    for item in items:
        beat.maybe_send()
        yield item


def _brief(metrics: dict[str, float], model: str) -> str:
    keys = ("loss", "grad_norm", "clip_frac", "entropy")
    return " ".join(f"{k}={metrics[f'{k}/{model}']:.4g}" for k in keys if f"{k}/{model}" in metrics)
