"""The learner scores response positions only (issue #46): `Trainer.token_stats` asks the
model for the logits of the positions that predict response tokens (`logits_to_keep`),
and gets the same log-probs and gradients as from the logits of every position.

In process, on the builtin tiny model (a one-rank gloo group). The reference is the same
trainer with `keeps_logits` off, which runs the LM head over the whole sequence, as
before; a hook on the LM head shows the new path is not the old one under another name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drmas.config import AgentConfig, DrmasConfig
from drmas.config.learner import LearnerConfig
from drmas.config.model import ModelConfig, WarmStartConfig
from drmas.learners.batching import collate, pack
from drmas.models.builtin import resolve_model_path
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import Sample

PROMPTS = (9, 4, 6)  # prompt lengths: the shortest decides where a padded batch starts
RESPONSES = (3, 5, 2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for p, t in zip(PROMPTS, RESPONSES):
        ids = torch.randint(3, 90, (p + t,), generator=gen)
        out.append(
            Sample("a", pack_ids(ids[:p]), pack_ids(ids[p:]), pack_logprobs(-torch.rand(t)), 0.5, 0)
        )
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_scoring_response_positions_only_changes_nothing_but_the_work(
    model_path: Path, group: None, packed: bool
) -> None:
    from drmas.learners.trainer import Trainer

    cfg = DrmasConfig(
        models={"m": ModelConfig(path=str(model_path))},
        agents={"a": AgentConfig(model="m")},
        learner=LearnerConfig(pack=packed),
    )
    cfg.sampling.temperature = 0.8
    trainer = Trainer(cfg, "m", 0, 1, "cpu", entropy_metric=True)
    assert trainer.keeps_logits, "the tiny Qwen2 takes logits_to_keep"
    weights = [1.0, 1.0, 0.0]  # the last row is a padding copy: scored nowhere
    mb = collate("a", samples(), weights, trainer.pad_id)
    if packed:
        mb.packed = pack(mb)
    rows: list[int] = []
    head = trainer.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, _i, out: rows.append(out.shape[-2]))

    def stats(keep: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        trainer.keeps_logits = keep
        trainer.model.zero_grad(set_to_none=True)
        logprobs, entropy = trainer.token_stats(trainer.model, mb, True)
        assert entropy is not None
        ((logprobs * mb.mask).sum() + (entropy * mb.mask).sum()).backward()
        grads = [p.grad.full_tensor().clone() for p in trainer.model.parameters()]
        return logprobs.detach() * mb.mask, entropy.detach() * mb.mask, grads

    full = stats(False)
    kept = stats(True)
    hook.remove()
    torch.testing.assert_close(kept[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[1], full[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(kept[2], full[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)

    longest = max(p + t for p, t in zip(PROMPTS, RESPONSES))
    scored = sum(RESPONSES[:2])  # the padding copy's tokens are not scored
    if packed:
        assert rows == [sum(PROMPTS) + sum(RESPONSES), scored]
    else:  # from the shortest scored prompt's last token to the end
        assert rows == [longest, longest - (min(PROMPTS[:2]) - 1)]
