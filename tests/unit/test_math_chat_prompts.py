"""The math team's chat style: each agent's worked examples come as earlier user/assistant
turns between the system instruction and the real question, laid out like the real
question; the plain style has none."""

from __future__ import annotations

from drmas.teams.math import prompts as mp


def test_verifier_sees_a_rejection_then_an_approval_before_the_question() -> None:
    turns = [(mp.SOLVER, "12+5 = 17. \\boxed{17}")]
    messages = mp.chat_messages(mp.VERIFIER, "12+5", turns, "Judge.")
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "user", "assistant", "user",
    ]  # fmt: skip
    assert messages[0]["content"] == "Judge."
    closing = "\nYou are the Verifier. Respond now."
    assert messages[1]["content"] == (
        "Question: 15-9\n\nTeam so far:\nSolver: 15-9 = 5. \\boxed{5}\n" + closing
    )
    assert messages[2]["content"] == "15-9 = 6, not 5. <verify>no</verify>"
    assert mp.parse_verdict(messages[2]["content"]) is False
    assert mp.parse_verdict(messages[4]["content"]) is True
    assert messages[5]["content"] == (
        "Question: 12+5\n\nTeam so far:\nSolver: 12+5 = 17. \\boxed{17}\n" + closing
    )


def test_solver_example_is_a_parseable_right_answer_and_plain_prompts_have_none() -> None:
    messages = mp.chat_messages(mp.SOLVER, "2+3", [], "Solve.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"] == "Question: 3+4\n\nYou are the Solver. Respond now."
    assert mp.parse_boxed(messages[2]["content"]) == "7"
    assert messages[3]["content"] == "Question: 2+3\n\nYou are the Solver. Respond now."
    assert mp.plain_prompt(mp.SOLVER, "2+3", [], "Solve.") == "Solve.\nQuestion: 2+3\nSolver:"
