"""The sampling the broker puts in every Lease: the run's `sampling` (training) or `val`
(validation), and each agent's own where `agents.<name>.sampling` / `agents.<name>.val`
set something (resolved here, so every actor samples alike whatever its own config says).
`drmas eval` and `drmas probe` build theirs the same way."""

from __future__ import annotations

from drmas.config import DrmasConfig
from drmas.config.actor import SamplingConfig
from drmas.protocol.sampling import AgentSampling, SamplingParams


def lease_sampling(
    cfg: DrmasConfig, validation: bool, temperature: float | None = None, top_p: float | None = None
) -> SamplingParams:
    """Training or validation sampling for a lease. `temperature`/`top_p` (drmas eval's
    command line) replace the run's and every agent's own."""
    resolve = cfg.val_sampling_of if validation else cfg.sampling_of
    base = cfg.val if validation else cfg.sampling
    run = SamplingConfig(
        base.temperature if temperature is None else temperature,
        base.top_p if top_p is None else top_p,
        cfg.sampling.max_new_tokens,
        list(cfg.sampling.stop),
    )
    agents: dict[str, AgentSampling] = {}
    for agent in cfg.agents:
        own = resolve(agent)
        if temperature is not None:
            own.temperature = temperature
        if top_p is not None:
            own.top_p = top_p
        if own != run:
            agents[agent] = AgentSampling(own.temperature, own.top_p, own.max_new_tokens, own.stop)
    return SamplingParams(run.temperature, run.top_p, run.max_new_tokens, run.stop, agents)
