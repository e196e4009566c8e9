"""Runs inside each vLLM worker process: joins a drmas weight group and loads the weights.

Who talks to whom: the actor's VLLMEngine.receive_weights calls
AsyncLLM.collective_rpc("drmas_receive_weights") -> vLLM's EngineCore -> this method in
every worker (vLLM mixes the class into its Worker: `worker_extension_cls`). The worker
then receives from learner rank 0 over drmas.transports.weights.WeightReceiver (its own
torch.distributed group per publish: gloo on CPU, NCCL on GPU; vLLM's own process groups
are not touched) and loads the buckets through vLLM's in-place reload path
(`Worker.reload_weights`), which takes Hugging Face names and handles fused layers
(qkv_proj, gate_up_proj), vocabulary padding and tied embeddings. On CPU a second plain
`model.load_weights` can fail after vLLM's post-load processing; the reload path does not.

On a LoRA base the publish carries adapter tensors only, of the adapters that changed
(possibly none): `drmas_receive_adapters` receives them the same way (the worker's device,
so the learner's NCCL group works on GPU) and writes each received adapter's
adapter_model.safetensors into the folder the engine named for it (vllm_lora.py); the
engine then loads those folders as new LoRA adapters.

Nothing here is imported by the actor process itself; vLLM imports it by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from drmas.actors.engines.expected import unpack
from drmas.actors.engines.lora_folders import write_adapter_tensors
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.digest import Digest, digest_of
from drmas.transports.weights import WeightReceiver

log = logging.getLogger("drmas.engine.vllm_worker")


class DrmasWorkerExtension:
    """Mixed into vLLM's Worker; `self` has the worker's `device`, `model_runner` and
    `reload_weights`."""

    device: torch.device
    model_runner: Any

    def drmas_receive_weights(
        self, join_payload: bytes, want_digest: bool, expected: bytes = b""
    ) -> dict[str, Any]:
        """Receive one publish and load it. Never raises: an exception in a worker RPC would
        take vLLM's EngineCore down with it, so a failure comes back as "error" (the model
        may then hold a mix of versions until the next publish: the actor quarantines it).
        `expected` (expected.pack): the parameter set the header must cover, checked before
        the first tensor reaches the reload; a digest trailer that differs from what
        arrived fails the reload at its last tensor, before the engine resumes.
        Reply: error, digest ("" unless asked), digest_source, tensors, bytes, seconds."""
        start = time.monotonic()
        reply: dict[str, Any] = {"error": "", "digest": "", "digest_source": "", "tensors": 0}
        received = Digest()
        shapes: dict[str, tuple[int, ...]] = {}
        nbytes = 0
        try:
            join = msgspec.msgpack.decode(join_payload, type=JoinWeightGroup)
            receiver = self._drmas_weight_receiver()

            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal nbytes
                assert receiver is not None
                for name, tensor in receiver.receive(join, unpack(expected)):
                    shapes[name] = tuple(tensor.shape)
                    nbytes += tensor.numel() * tensor.element_size()
                    if want_digest and not receiver.verifying:  # else it hashes them
                        received.add(name, tensor)
                    # The reload path may hold a tensor until its whole layer arrived, and
                    # the receiver reuses the bucket buffer: hand over a copy.
                    yield name, tensor.clone()

            self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
            receiver.release()
            _repack_cpu_kept_weights(self.model_runner.get_model())
            if want_digest:
                digest = _read_back_digest(self.model_runner.get_model(), shapes)
                source = "read back"
                if not digest:
                    # CPU GEMM prepacking moves linear weights into opaque handles: then the
                    # digest proves what arrived and went into the reload, not a read-back.
                    digest = receiver.arrived_digest or received.hexdigest()
                    source = "received"
                reply.update(digest=digest, digest_source=source)
        except Exception as exc:
            log.exception("drmas weight receive failed")
            reply["error"] = f"{type(exc).__name__}: {exc}"
        reply.update(tensors=len(shapes), bytes=nbytes, seconds=time.monotonic() - start)
        return reply

    def drmas_receive_adapters(
        self, join_payload: bytes, folders: dict[str, str], expected: bytes = b""
    ) -> dict[str, Any]:
        """LoRA base: receive one publish of adapter tensors and write each received
        adapter's adapter_model.safetensors into `folders[adapter]` (created; the engine
        adds adapter_config.json). Never raises (see drmas_receive_weights). Reply: error,
        adapters (those received, sorted), tensors, bytes, seconds."""
        start = time.monotonic()
        reply: dict[str, Any] = {"error": "", "adapters": [], "tensors": 0, "bytes": 0}
        try:
            join = msgspec.msgpack.decode(join_payload, type=JoinWeightGroup)
            receiver = self._drmas_weight_receiver()
            # copies: the receiver reuses its bucket buffers, and the files are written last
            received = receiver.receive(join, unpack(expected))  # checked as in the above
            named = [(name, t.to("cpu", copy=True)) for name, t in received]
            receiver.release()
            paths = {adapter: Path(folder) for adapter, folder in folders.items()}
            written = write_adapter_tensors(named, paths)
            reply.update(adapters=sorted(written), tensors=sum(written.values()))
            reply["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
        except Exception as exc:
            log.exception("drmas adapter receive failed")
            reply["error"] = f"{type(exc).__name__}: {exc}"
        reply["seconds"] = time.monotonic() - start
        return reply

    def _drmas_weight_receiver(self) -> WeightReceiver:
        """This worker's receiver, kept across versions (its bucket buffers are reused)."""
        receiver: WeightReceiver | None = getattr(self, "_drmas_receiver", None)
        if receiver is None:
            receiver = WeightReceiver(device=self.device)
            self._drmas_receiver = receiver
        return receiver


def _repack_cpu_kept_weights(model: torch.nn.Module) -> None:
    """vLLM on CPU packs each linear weight into a GEMM handle when it loads. The reload
    path repacks every layer it reloads, but a tied lm_head shares the embedding's weight
    without being reloaded itself, so its handle would keep the old weights (measured:
    log-probs off by ~1 after the first update). Repack every module that kept its plain
    weight next to its handle (embeddings / lm_head: packed with remove_weight=False);
    linear layers that dropped theirs were repacked by the reload. No-op on GPU."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        kept = weight is not None and weight.numel() > 0
        if hasattr(module, "cpu_linear") and method is not None and kept:
            method.process_weights_after_loading(module)


def _read_back_digest(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> str:
    """drmas digest of the model's weights under the Hugging Face names that were sent:
    fused parameters are split back along dim 0 (vLLM's `packed_modules_mapping`, in its
    order), padded ones (vocabulary) are cut to the sent shape. "" when some sent tensor
    has no plain counterpart."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    pieces: list[tuple[str, torch.Tensor]] = []
    for name, param in model.named_parameters():
        names = [name]
        for fused, parts in packed.items():
            token = f".{fused}."
            if token in name:
                names = [name.replace(token, f".{p}.") for p in parts]
                break
        if not all(n in shapes for n in names):
            continue
        offset = 0
        for n in names:
            shape = shapes[n]
            if param.dim() != len(shape) or param.shape[0] < offset + shape[0]:
                return ""  # not a plain tensor any more (e.g. CPU-prepacked linear weight)
            piece = param.data.narrow(0, offset, shape[0])
            offset += shape[0]
            for dim in range(1, len(shape)):
                if piece.shape[dim] < shape[dim]:
                    return ""
                piece = piece.narrow(dim, 0, shape[dim])
            pieces.append((n, piece))
    missing = set(shapes) - {n for n, _ in pieces}
    if missing:
        log.info("cannot read back %d sent tensors (e.g. %s)", len(missing), min(missing))
        return ""
    return digest_of(pieces)
