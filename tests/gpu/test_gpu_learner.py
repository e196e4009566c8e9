"""The FSDP2 learner and the hf engine on one GPU, against what `drmas plan` budgets
(marker `gpu`; run by scripts/gpu_check.sh, skipped without CUDA).

A ~45M-parameter Qwen2 (wide enough that weights and optimizer state, not activations,
fill the memory) with the character tokenizer is written to a temporary folder.
- Learner, bf16-mixed (a one-rank NCCL group in a spawned process, as a learner runs):
  parameters and AdamW state stay fp32 on the GPU, a decoder layer computes in bf16, a
  few AdamW steps at lr 1e-6 move almost every master weight (bf16 weights would lose
  them: 2 % move, tests/integration/test_fsdp_learner.py), the published copies are bf16.
  torch.cuda.max_memory_allocated must hold the plan's 16 bytes per parameter (master,
  gradient, two AdamW moments) and at most twice that.
- Engine: the hf engine on CUDA in bfloat16 generates, and the memory its weights take is
  the plan's 2 bytes per parameter (within 20 %).
Timings and the measured/planned ratios are printed (-s), never asserted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.integration.test_fsdp_learner import MODEL, make_config, make_samples, shards
from tests.rendezvous import gloo_init

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(240),
]
STEPS = 3


def wide_qwen2(folder: Path) -> Path:
    """~45M parameters, vocabulary of the character tokenizer (99 >= the 64 ids
    make_samples draws)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from drmas.models.vocab import char_tokenizer, save_tokenizer

    tokenizer = char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_qwen2(tmp_path_factory.mktemp("wide") / "model")


def learner_worker(rank: int, init: str, cfg, shard, out: str) -> None:
    import torch.distributed as dist

    from drmas.learners.sharding import decoder_layers
    from drmas.learners.trainer import Trainer

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
    try:
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer = Trainer(cfg, MODEL, 0, 1, device)
        params = list(trainer.model.parameters())
        computed: list[torch.dtype] = []
        hook = decoder_layers(trainer.model)[0].register_forward_hook(
            lambda _m, _i, o: computed.append((o[0] if isinstance(o, tuple) else o).dtype)
        )
        before = {k: v.float() for k, v in trainer.full_state_dict_iter()}
        clock = time.perf_counter()
        for _ in range(STEPS):
            trainer.step(shard)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - clock
        hook.remove()
        peak = torch.cuda.max_memory_allocated(device) - start
        moments = [t for s in trainer.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0]  # fmt: skip
        torch.save(
            {
                "params": [(p.dtype, p.device.type) for p in params],
                "moments": [(t.dtype, t.device.type) for t in moments],
                "computed": computed,
                "before": before,
                "after": dict(trainer.full_state_dict_iter()),
                "published": {
                    v.dtype for _, v in trainer.full_state_dict_iter(dtype=trainer.publish_dtype)
                },
                "peak": peak,
                "seconds": seconds,
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def test_fsdp2_bf16_mixed_keeps_fp32_masters_within_the_plan(wide: Path, tmp_path: Path) -> None:
    from drmas.launch.plan import learner_bytes_per_param, model_size

    cfg = make_config(wide)
    cfg.models[MODEL].precision = "bf16-mixed"
    cfg.models[MODEL].lr = 1e-6
    cfg.learner.grad_clip = 1e9  # AdamW's step size, not the clip, sets the update
    out = tmp_path / "learner.pt"
    mp.spawn(
        learner_worker, args=(gloo_init(), cfg, shards(make_samples(), 1)[0], str(out)), nprocs=1
    )
    got = torch.load(out, weights_only=False)

    assert {d for d, _ in got["params"]} == {torch.float32}  # fp32 masters...
    assert {where for _, where in got["params"]} == {"cuda"}  # ...on the GPU
    assert len(got["moments"]) == 2 * len(got["params"])  # exp_avg, exp_avg_sq
    assert set(got["moments"]) == {(torch.float32, "cuda")}
    assert got["computed"] and set(got["computed"]) == {torch.bfloat16}  # bf16 compute
    assert got["published"] == {torch.bfloat16}
    deltas = torch.cat([(got["after"][k] - v).flatten() for k, v in got["before"].items()])
    moved = float((deltas != 0).float().mean())
    assert moved > 0.9, moved

    params = model_size(str(wide)).params
    assert params == sum(v.numel() for v in got["before"].values())
    planned = params * learner_bytes_per_param("bf16-mixed")
    print(
        f"\nlearner bf16-mixed on GPU: {STEPS} steps in {got['seconds']:.2f} s, "
        f"{moved:.3f} of the weights moved; peak {got['peak'] / 2**20:.0f} MiB, "
        f"plan {planned / 2**20:.0f} MiB (ratio {got['peak'] / planned:.2f})"
    )
    assert planned <= got["peak"] <= 2 * planned


def test_hf_engine_on_cuda_holds_the_planned_weights(wide: Path) -> None:
    from drmas.actors.engines.base import GenerateRequest
    from drmas.actors.engines.hf import HFEngine
    from drmas.config.actor import EngineConfig
    from drmas.launch.plan import model_size

    before = torch.cuda.memory_allocated()
    engine = HFEngine(MODEL, wide, EngineConfig(device="cuda", dtype="bfloat16", max_batch=32))

    async def main() -> tuple[list, int]:
        await engine.start()
        try:
            held = torch.cuda.memory_allocated() - before
            start = time.perf_counter()
            results = await asyncio.gather(
                *(engine.generate(GenerateRequest([5, 6, 7], 1.0, 1.0, 32)) for _ in range(32))
            )
            print(
                f"\nhf engine on CUDA: 32 x up to 32 tokens in {time.perf_counter() - start:.2f} s"
            )
            return results, held
        finally:
            await engine.close()

    results, held = asyncio.run(main())
    assert engine.device.type == "cuda"
    assert all(r.token_ids and len(r.logprobs) == len(r.token_ids) for r in results)
    assert all(max(r.logprobs) <= 0.0 for r in results)
    planned = model_size(str(wide)).params * 2  # bfloat16
    print(f"hf engine weights: {held / 2**20:.0f} MiB held, plan {planned / 2**20:.0f} MiB")
    assert planned <= held <= 1.2 * planned
