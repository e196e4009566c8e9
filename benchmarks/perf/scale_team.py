"""Teams of 2, 4 and 8 agents for bench_broker_scale.py: only their names and bounds.

The broker reads a team for its agent list and its bound on steps per episode; the
simulated actors of the benchmark never run a workflow, so these teams have no episodes.
"""

from drmas.teams import Team, TeamLayout


def _chain(n: int) -> type[Team]:
    agents = tuple(f"a{i}" for i in range(n))
    return type(
        f"Chain{n}",
        (Team,),
        {
            "name": f"chain{n}",
            "agents": agents,
            "layout": TeamLayout({a: a.upper() for a in agents}),
            "default_instructions": {"plain": dict.fromkeys(agents, "Go.")},
        },
    )


Chain2, Chain4, Chain8 = _chain(2), _chain(4), _chain(8)
