"""Teams: who the agents are, what they say to each other, which tools they call and how an
episode is rewarded. One folder per built-in team (math/, search/), each holding its
workflow, prompts, task source, grading and warm-start transcripts; your own team is one
class in one file (see docs/own-team.md), loaded by `workflow.target`.

    base.py     Team: the class every team subclasses (agent calls, tool calls, reward)
    layout.py   TeamLayout: how prompts are rendered from the team context
    loader.py   targets (package.module:Name, file.py:Name) and the `drmas.teams` registry
"""

from drmas.teams.base import Team, ToolStep
from drmas.teams.layout import TeamLayout

__all__ = ["Team", "TeamLayout", "ToolStep"]
