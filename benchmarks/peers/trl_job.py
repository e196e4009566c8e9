"""TRL's side of bench_trl.py: the solo job (solo.py) trained by TRL's GRPOTrainer, in a
process of its own, as a TRL user would write it: TRL's defaults except what must match
drmas's run (the settings below, each commented). It writes, into --out:

- steps.jsonl: one line per optimizer step: wall-clock start and end (time.time()) and
  the seconds TRL spent generating in it (its `_generate_single_turn`, timed around);
- model/: the trained model as a Hugging Face folder (for the held-out evaluation);
- job.json: the settings, TRL's and transformers' versions, the thread count.

Run by bench_trl.py; alone: python benchmarks/peers/trl_job.py --model DIR --out DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # solo.py, the job's tasks, prompts and grading

import solo  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (SmolLM2-135M)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--micro", type=int, default=16, help="sequences per forward/backward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-val", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args.out.mkdir(parents=True, exist_ok=True)
    task_cfg = SimpleNamespace(seed=0, num_val=args.num_val, options={"max": 19})
    train, _ = solo.tasks(task_cfg)  # the held-out part is bench_trl.py's to evaluate
    dataset = Dataset.from_list(
        [{"prompt": solo.messages(t["question"]), "answer": t["answer"]} for t in train]
    )

    def correct(completions: list, answer: list[str], **_: object) -> list[float]:
        return [solo.reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    batch = args.prompts * args.group
    micro = min(args.micro, batch)
    if batch % micro:
        raise SystemExit(f"--micro {micro} must divide prompts x group = {batch}")
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        max_steps=args.steps,
        # one generation batch of prompts x G per optimizer step, micro-batched as drmas
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        learning_rate=1e-6,  # TRL's default, and drmas's run
        lr_scheduler_type="constant",  # TRL decays linearly to 0; drmas's lr is constant
        beta=0.0,  # TRL's default: no KL
        loss_type="dapo",  # TRL's default (= drmas token-mean)
        scale_rewards="group",  # TRL's default (= drmas global, eps 1e-4)
        temperature=1.0,  # TRL's default
        top_p=1.0,  # TRL's default
        bf16=False,  # TRL's default is bf16 autocast; the job is fp32 on both sides
        use_cpu=True,
        seed=args.seed,  # the task order and the sampling
        report_to=[],
        logging_steps=1,
        save_strategy="no",
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )

    generating = [0.0]
    generate = trainer._generate_single_turn

    def timed_generate(*a: object, **k: object) -> object:
        start = time.monotonic()
        try:
            return generate(*a, **k)
        finally:
            generating[0] += time.monotonic() - start

    trainer._generate_single_turn = timed_generate  # type: ignore[method-assign]
    steps = (args.out / "steps.jsonl").open("w")

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.begin, generating[0] = time.time(), 0.0

        def on_step_end(self, _a: object, state: object, *_: object, **__: object) -> None:
            line = {"step": state.global_step, "start": self.begin, "end": time.time()}  # type: ignore[attr-defined]
            steps.write(json.dumps(line | {"generate_s": generating[0]}) + "\n")
            steps.flush()

    trainer.add_callback(Steps())
    info = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gradient_checkpointing": config.gradient_checkpointing,
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
    }
    (args.out / "job.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    trainer.train()
    steps.close()
    trainer.save_model(str(args.out / "model"))
    tokenizer.save_pretrained(str(args.out / "model"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
