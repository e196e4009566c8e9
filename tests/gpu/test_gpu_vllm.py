"""The vllm engine on CUDA with an NCCL weight sync (marker `gpu`; needs 2 GPUs and the
CUDA build of vLLM: `pip install 'drmas[vllm]'`). Run by scripts/gpu_check.sh.

NCCL puts one rank per GPU, so the learner side (a WeightSender, rank 0) runs in this
process on cuda:0 and the vLLM engine in a child process that sees only GPU 1
(CUDA_VISIBLE_DEVICES=1): the child starts the engine on the builtin-style tiny Qwen2,
generates, receives a second model's weights through the engine's worker extension
(NCCL), generates again and reports versions, digests and log-probs. Checked: the
reported version and digest (equal to the sender's) and that greedy log-probs changed.
Timings are printed (-s), never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="not on this GPU machine: vllm is not installed (pip install 'drmas[vllm]'; "
        "its CUDA wheels are far over what can travel to the GPU machine this project "
        "gets), so its GPU path stays untested",
    ),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL weight sync needs 2 GPUs"),
    pytest.mark.timeout(300),
]

CHILD = """
import asyncio, json, sys, time
import msgspec
from drmas.config.actor import EngineConfig
from drmas.actors.engines.base import GenerateRequest
from drmas.actors.engines.vllm import VLLMEngine
from drmas.protocol.messages import JoinWeightGroup

async def main():
    folder, join_file, out = sys.argv[1:4]
    cfg = EngineConfig(name="vllm", device="cuda", dtype="float32", max_batch=8,
                       gpu_memory_utilization=0.3, max_model_len=256)
    engine = VLLMEngine("m", folder, cfg)
    await engine.start()
    req = GenerateRequest([1, 2, 3, 4], temperature=0.0, top_p=1.0, max_new_tokens=8)
    before = await engine.generate(req)
    print("READY", flush=True)
    while True:  # the test writes the join once its sender is listening
        try:
            join = msgspec.json.decode(open(join_file, "rb").read(), type=JoinWeightGroup)
            break
        except (FileNotFoundError, msgspec.DecodeError):
            await asyncio.sleep(0.1)
    await engine.pause()
    start = time.perf_counter()
    digest = await engine.receive_weights(join, True)
    seconds = time.perf_counter() - start
    await engine.resume()
    after = await engine.generate(req)
    json.dump({"version": engine.version, "digest": digest, "seconds": seconds,
               "before": before.logprobs, "after": after.logprobs}, open(out, "w"))
    await engine.close()

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_vllm_engine_receives_an_nccl_publish(tmp_path: Path) -> None:
    from drmas.config.transport import WeightSyncConfig
    from drmas.protocol.messages import JoinWeightGroup
    from drmas.transports.digest import digest_of
    from drmas.transports.weights import WeightSender
    from tests.integration.test_fsdp_learner import tiny_qwen2

    folder = tiny_qwen2(tmp_path / "model")
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(7)
    new = Qwen2ForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = [(n, p.detach().cuda(0)) for n, p in new.named_parameters()]

    script, join_file, out = tmp_path / "child.py", tmp_path / "join.json", tmp_path / "out.json"
    script.write_text(CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(folder), str(join_file), str(out)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "READY" not in child.stdout.readline():
            pass
        torch.cuda.set_device(0)
        sender = WeightSender(WeightSyncConfig(backend="nccl"), torch.device("cuda", 0))
        join = JoinWeightGroup("m", 1, "m-v1", sender.store_address, 1, 2, 120.0)
        join_file.write_bytes(msgspec.json.encode(join))
        start = time.perf_counter()
        stats = sender.publish("m-v1", 2, state, 120.0, peers=["vllm child"])
        print(f"\nNCCL publish into vLLM: {stats.bytes / 2**20:.1f} MiB in "
              f"{time.perf_counter() - start:.3f} s")  # fmt: skip
        assert child.wait(240) == 0
    finally:
        if child.poll() is None:
            child.kill()
    got = json.loads(out.read_text())
    print(f"vLLM worker load: {got['seconds']:.3f} s")
    assert got["version"] == 1
    if got["digest"]:  # empty when the engine cannot read its weights back
        assert got["digest"] == digest_of((n, t.cpu()) for n, t in state)
    assert got["before"] != got["after"]  # the new weights generate differently
