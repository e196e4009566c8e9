"""Teams from plain programs written against the OpenAI client (team.py), the endpoint
their client calls (endpoint.py) and the requests it takes (chat.py)."""

from drmas.teams.program.team import ProgramTeam, program_team

__all__ = ["ProgramTeam", "program_team"]
