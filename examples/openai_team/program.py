"""A Solver and a Checker written against the OpenAI client only: nothing here imports
drmas, and the same function runs against any OpenAI-compatible server.

The Solver answers an arithmetic question and the Checker judges the answer; the team gives
an answer only when the Checker approves it. The team scores a right answer it gave; each
agent is paid for its own job: the Solver for a right answer, the Checker for a verdict
that matches the truth.

    drmas train --config examples/openai_team/config.yaml
"""

import re

SOLVE = "Solve."
CHECK = "Check."


def number(text):
    found = re.search(r"-?\d+", text)
    return found.group(0) if found else None


async def ask(client, agent, messages):
    reply = await client.chat.completions.create(model=agent, messages=messages)
    return reply.choices[0].message.content.strip()


async def episode(client, task):
    solver = [{"role": "system", "content": SOLVE}, {"role": "user", "content": task.question}]
    first = await ask(client, "solver", solver)
    verdict = await ask(
        client,
        "checker",
        [
            {"role": "system", "content": CHECK},
            {"role": "user", "content": f"{task.question} = {first}"},
        ],
    )
    approved = verdict.lower().startswith("yes")
    right = number(first) == task.answer
    return {
        "reward": float(right and approved),
        "rewards": {"solver": float(right), "checker": float(approved == right)},
        "metrics": {"approved": float(approved), "solver_right": float(right)},
    }
