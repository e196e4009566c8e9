"""The math team: a Solver answers, a Verifier approves or sends it back.

workflow.py     the episode (MathTeam, registered as `workflow.name=math`)
prompts.py      instructions, prompt layout, answer and verdict parsing
arithmetic.py   the synthetic a+b task source (`task.name=arithmetic`)
grading.py      answer grading (math-verify, bounded)
transcripts.py  warm-start transcripts for the builtin tiny models
"""

from drmas.teams.math.workflow import MathTeam

__all__ = ["MathTeam"]
