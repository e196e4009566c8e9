"""Programs written against the OpenAI client as teams (drmas/teams/program): the real
`openai.AsyncOpenAI` client, in process, against a scripted engine whose every answer and
request the test knows. Steps are recorded per agent with the engine's own token ids and
log-probs; a group's episodes call the engine concurrently; bad requests get their codes
while the episode goes on; a failing program fails only its group; each agent's sampling
reaches the engine."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest

from drmas.actors.engines.base import Engine
from drmas.broker.sampling import lease_sampling
from drmas.config import ConfigError, load_config
from drmas.protocol.arrays import unpack_ids, unpack_logprobs
from drmas.protocol.engine import GenerateRequest, GenerateResult
from drmas.protocol.messages import Episode, Task
from drmas.teams.resolve import resolve_team
from tests.fixtures.engines import FIRST_VERSION, LOGPROB, CharTokenizer, ScriptedEngine

TASK = Task("t:0", "3+4", "7", "t")
AGENTS = "+agents={writer: {model: m}, critic: {model: m}}"


def program_file(tmp_path: Path, body: str) -> str:
    file = tmp_path / "program.py"
    file.write_text(textwrap.dedent(body))
    return f"{file}:episode"


def config(tmp_path: Path, body: str, *overrides: str) -> Any:
    return load_config(
        [
            f"workflow.target={program_file(tmp_path, body)}",
            "~agents", AGENTS, "~models", "+models={m: {path: builtin:tiny-qwen2}}",
            *overrides,
        ]
    )  # fmt: skip


def team_of(cfg: Any, engine: Any) -> Any:
    engines = cast(dict[str, Engine], {"m": engine})
    agents = {a: cfg.model_of(a) for a in cfg.agents}
    return resolve_team(cfg).build(cfg, agents, engines, {"m": engine.tokenizer})


def writer_or_critic(prompt: str) -> str:
    return "critic" if "Check" in prompt else "writer"


def group(cfg: Any, engine: Any, size: int = 1) -> list[Episode]:
    team = team_of(cfg, engine)
    return asyncio.run(team.run_group(TASK, lease_sampling(cfg, validation=False), size))


TWO_AGENTS = """
async def episode(client, task):
    draft = await client.chat.completions.create(
        model="writer", messages=[{"role": "user", "content": "Solve " + task.question}])
    answer = draft.choices[0].message.content
    check = await client.chat.completions.create(
        model="critic", logprobs=True,
        messages=[{"role": "system", "content": "Check"}, {"role": "user", "content": answer}])
    assert draft.usage.completion_tokens == len(answer) + 1  # + EOS
    assert check.choices[0].logprobs.content[0].logprob == -0.25
    return {"reward": float(answer == task.answer), "rewards": {"critic": 0.5},
            "metrics": {"answer_chars": len(answer)}}
"""


def test_each_call_is_a_step_of_its_agent_with_the_engines_own_tokens(tmp_path: Path) -> None:
    cfg = config(tmp_path, TWO_AGENTS)
    engine = ScriptedEngine({"writer": ["7"], "critic": ["ok"]}, CharTokenizer(), writer_or_critic)
    (episode,) = group(cfg, engine)
    assert [s.agent for s in episode.steps] == ["writer", "critic"]
    assert (episode.reward, episode.metrics) == (1.0, {"answer_chars": 1.0})
    assert [s.reward for s in episode.steps] == [None, 0.5]  # critic paid its own
    for step, call in zip(episode.steps, engine.calls):
        # the prompt the engine got, token for token; the response and log-probs it gave
        assert unpack_ids(step.prompt_ids).tolist() == call.request.prompt_ids
        response = unpack_ids(step.response_ids).tolist()
        assert (
            CharTokenizer().decode(response) == {"writer": "7\x03", "critic": "ok\x03"}[call.agent]
        )
        assert unpack_logprobs(step.logprobs).tolist() == [LOGPROB] * len(response)
        assert step.version == engine.calls.index(call) + FIRST_VERSION
        assert step.valid and step.finish_reason == "stop"
    # no chat template on this tokenizer: one line per message, then the answer's label
    assert engine.calls[1].prompt == "System: Check\nUser: 7\nAssistant:"


class Gate:
    """An engine that answers only once `size` calls wait at once: proof that a group's
    episodes call it concurrently (a sequential group would wait until the timeout)."""

    def __init__(self, size: int) -> None:
        self.size, self.waiting = size, 0
        self.tokenizer = CharTokenizer()
        self.all_in = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.waiting += 1
        if self.waiting >= self.size:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 60)
        return GenerateResult([ord("7"), 3], [LOGPROB, LOGPROB], "stop", 0)


def test_a_groups_episodes_call_the_engine_concurrently(tmp_path: Path) -> None:
    body = """
    async def episode(client, task):
        await client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}])
        return 1.0
    """
    episodes = group(config(tmp_path, body), Gate(4), size=4)
    assert [len(e.steps) for e in episodes] == [1, 1, 1, 1]


BAD_REQUESTS = """
import openai

async def episode(client, task):
    codes = {}
    tries = {
        "unknown model": dict(model="editor", messages=[{"role": "user", "content": "x"}]),
        "tools": dict(model="writer", messages=[{"role": "user", "content": "x"}],
                      tools=[{"type": "function", "function": {"name": "f"}}]),
        "stream": dict(model="writer", messages=[{"role": "user", "content": "x"}], stream=True),
        "n": dict(model="writer", messages=[{"role": "user", "content": "x"}], n=2),
        "role": dict(model="writer", messages=[{"role": "wizard", "content": "x"}]),
        "image": dict(model="writer", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]),
        "temperature": dict(model="writer", messages=[{"role": "user", "content": "x"}],
                            temperature=0.3),
    }
    for name, kwargs in tries.items():
        try:
            await client.chat.completions.create(**kwargs)
        except openai.APIStatusError as e:
            codes[name] = (e.status_code, e.body.get("param") if isinstance(e.body, dict) else None,
                           str(e))
    ok = await client.chat.completions.create(
        model="writer", messages=[{"role": "user", "content": "x"}], temperature=1.0, seed=3)
    models = [m.id for m in (await client.models.list()).data]
    return {"reward": 1.0, "metrics": {"codes": len(codes)}, "codes": codes, "models": models,
            "ok": ok.choices[0].message.content}
"""


def test_bad_requests_get_their_codes_and_the_episode_goes_on(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    cfg = config(tmp_path, BAD_REQUESTS)
    engine = ScriptedEngine(["7"], CharTokenizer())
    team = team_of(cfg, engine)
    program = type(team).program

    async def spy(client: Any, task: Task) -> Any:
        out = await program(client, task)
        seen.update(out)
        return out

    type(team).program = staticmethod(spy)
    (episode,) = asyncio.run(team.run_group(TASK, lease_sampling(cfg, validation=False), 1))
    codes = seen["codes"]
    assert codes["unknown model"][0] == 404 and "['writer', 'critic']" in codes["unknown model"][2]
    for name, param in (("tools", "tools"), ("stream", "stream"), ("n", "n"),
                        ("role", "messages[0].role"), ("image", "messages[0].content"),
                        ("temperature", "temperature")):  # fmt: skip
        assert codes[name][:2] == (400, param), (name, codes[name])
    assert "agents.writer.sampling.temperature" in codes["temperature"][2]
    assert seen["models"] == ["writer", "critic"] and seen["ok"] == "7"
    assert len(episode.steps) == 1  # only the call that was answered is a step
    assert len(engine.calls) == 1  # refused requests never reached the engine


@pytest.mark.parametrize(
    ("body", "error", "message"),
    [
        ("async def episode(client, task):\n    raise KeyError('mine')\n", KeyError, "mine"),
        ("async def episode(client, task):\n    return 1.0\n", RuntimeError, "called no agent"),
        ("import asyncio\nasync def episode(client, task):\n    await asyncio.sleep(60)\n",
         TimeoutError, r"episode_timeout_s=0\.2s"),
        ("async def episode(client, task):\n"
         "    await client.chat.completions.create(model='writer', messages=[{'role': 'user', 'content': 'x'}])\n"
         "    return {'reward': float('nan')}\n", ValueError, "must be finite"),
    ],
)  # fmt: skip
def test_a_failing_program_fails_its_group(
    tmp_path: Path, body: str, error: type, message: str
) -> None:
    cfg = config(tmp_path, body, "workflow.episode_timeout_s=0.2")
    with pytest.raises(error, match=message):
        group(cfg, ScriptedEngine(["7"], CharTokenizer()))


def test_each_agents_sampling_reaches_the_engine(tmp_path: Path) -> None:
    body = """
    async def episode(client, task):
        for agent in ("writer", "critic"):
            await client.chat.completions.create(
                model=agent, messages=[{"role": "user", "content": "x"}], max_tokens=10, stop=["!"])
        await client.chat.completions.create(
            model="critic", messages=[{"role": "user", "content": "x"}], temperature=0.5)
        return 1.0
    """
    cfg = config(tmp_path, body, "agents.critic.sampling.temperature=0.5",
                 "agents.critic.sampling.max_new_tokens=6", "agents.critic.sampling.stop=[END]")  # fmt: skip
    engine = ScriptedEngine(["a", "b", "c"], CharTokenizer())
    group(cfg, engine)
    writer, critic, critic_again = (c.request for c in engine.calls)
    assert (writer.temperature, writer.max_new_tokens, writer.stop) == (1.0, 10, ("!",))
    # the agent's cap (6) holds over a larger max_tokens (10); its stop strings come first
    assert (critic.temperature, critic.max_new_tokens, critic.stop) == (0.5, 6, ("END", "!"))
    assert critic_again.temperature == 0.5


def test_a_program_takes_neither_workflow_reward_nor_tools(tmp_path: Path) -> None:
    body = "async def episode(client, task):\n    return 1.0\n"
    with pytest.raises(ConfigError, match=r"workflow\.reward is set"):
        resolve_team(config(tmp_path, body, "workflow.reward=math:fsum"))
    sync = tmp_path / "sync.py"
    sync.write_text("def episode(client, task):\n    return 1.0\n")
    cfg = load_config([f"workflow.target={sync}:episode"])
    with pytest.raises(ConfigError, match=r"nor a program \(async def episode"):
        resolve_team(cfg)
