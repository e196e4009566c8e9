"""The search team: a Verifier routes, a Search Agent queries the retriever tool, an
Answer Agent answers.

    workflow.py     the episode (SearchTeam, registered as `workflow.name=search`) and
                    the retriever as the team's `search` tool
    prompts.py      instructions, prompt layout, action parsing, passage rendering
    kb.py           the synthetic knowledge base: corpus and questions (`task.name=kb`),
                    and the corpus the team's retriever indexes (`search_corpus`)
    qa.py           answer normalisation, exact match and F1
    transcripts.py  warm-start transcripts for the builtin tiny models
"""

from drmas.teams.search.workflow import SearchTeam

__all__ = ["SearchTeam"]
