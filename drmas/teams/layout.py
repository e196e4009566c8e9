"""How a team's prompts are laid out, shared by every team's prompt module.

plain (what the tiny builtin models are warm-started on):

    {instruction}
    Question: {question}
    {Label}: {earlier output}        one line per team-context entry
    {Label of the agent to answer}:

chat: a system message with the instruction, and a user message with the question, the
team context under "Team so far:" and "You are the {Label}{role_suffix}. Respond now."
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TeamLayout:
    labels: dict[str, str]
    """Agent (or other context entry, e.g. retrieved passages) -> its label."""
    role_suffix: str = ""
    """Appended to the label in the chat style's closing line (" agent")."""

    def label(self, who: str) -> str:
        """The label of an agent, tool or other context entry (unlisted: its capitalised key)."""
        return self.labels.get(who) or who.capitalize()

    def context_lines(self, turns: Sequence[tuple[str, str]]) -> str:
        """Team context: one `Label: text` line per earlier entry."""
        return "".join(f"{self.label(who)}: {text.strip()}\n" for who, text in turns)

    def plain_prompt(
        self, agent: str, question: str, turns: Sequence[tuple[str, str]], instruction: str
    ) -> str:
        context = self.context_lines(turns)
        return f"{instruction}\nQuestion: {question}\n{context}{self.label(agent)}:"

    def chat_messages(
        self, agent: str, question: str, turns: Sequence[tuple[str, str]], instruction: str
    ) -> list[dict[str, str]]:
        user = f"Question: {question}\n"
        if turns:
            user += f"\nTeam so far:\n{self.context_lines(turns)}"
        user += f"\nYou are the {self.label(agent)}{self.role_suffix}. Respond now."
        return [{"role": "system", "content": instruction}, {"role": "user", "content": user}]
