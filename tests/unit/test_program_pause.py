"""A program's request in flight when new weights load follows the engine's pause_mode as a
built-in team's call does: on the hf engine (keep) it waits through the load and finishes
on the new weights, its step carrying the version it was admitted at; the program's next
call is served by, and records, the new version. The real hf engine on the tiny builtin,
the real openai client in process, greedy (validation sampling) so the first call is still
decoding when the engine pauses."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from drmas.actors.engines.hf import HFEngine
from drmas.broker.sampling import lease_sampling
from drmas.config.model import WarmStartConfig
from drmas.models.builtin import resolve_model_path
from tests.unit.test_program_team import TASK, config, team_of

pytest.importorskip("openai")

PROGRAM = """
async def episode(client, task):
    for agent in ("writer", "critic"):
        await client.chat.completions.create(
            model=agent, max_tokens=40, messages=[{"role": "user", "content": task.question}])
    return 1.0
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def test_a_program_request_in_flight_waits_through_a_load_and_keeps_its_version(
    tmp_path: Path, model_path: Path
) -> None:
    cfg = config(tmp_path, PROGRAM, "val.temperature=0", "actor.engine.max_batch=1")
    engine = HFEngine("m", model_path, cfg.actor.engine_of("m"))

    async def main() -> list[int]:
        await engine.start()
        try:
            team = team_of(cfg, engine)
            sampling = lease_sampling(cfg, validation=True)
            group = asyncio.ensure_future(team.run_group(TASK, sampling, 1))
            while engine.num_running == 0:
                await asyncio.sleep(0.01)
            await engine.pause()
            held = engine.tokens_generated
            for _ in range(20):
                await asyncio.sleep(0)
            assert engine.tokens_generated == held and not group.done()  # it waits
            assert engine.model is not None
            new = {n: p.detach() + 0.01 for n, p in engine.model.named_parameters()}
            engine.load_weights(new.items(), version=1)
            await engine.resume()
            (episode,) = await asyncio.wait_for(group, 120)
            with torch.no_grad():  # the load went in while the call waited
                name, param = next(iter(engine.model.named_parameters()))
                assert torch.equal(param, new[name])
            return [step.version for step in episode.steps]
        finally:
            await engine.close()

    assert asyncio.run(main()) == [0, 1]  # admitted at v0; the next call on v1
