"""`drmas train` end to end: real broker, gloo FSDP learners and hf actors on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.integration.conftest import FAST, drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow


def check_run(run_dir: Path, models: set[str], steps: int) -> dict:
    lines = read_metrics(run_dir)
    train = [x for x in lines if "val/tasks" not in x]
    assert [x["step"] for x in train] == list(range(1, steps + 1))
    for line in train:
        for agent in ("solver", "verifier"):
            assert f"reward/{agent}/mean" in line and f"advantage/{agent}/std" in line
        for model in models:
            assert f"loss/{model}" in line and f"grad_norm/{model}" in line
            assert f"weight_sync_s/{model}" in line
        assert line["episodes_per_s"] > 0
    val = [x for x in lines if "val/tasks" in x]
    assert {x["step"] for x in val} >= {0, 2, steps}  # the starting point, every 2, the end
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c.get("groups_trained_twice", 0) == 0
    assert c.get("weight_digest_mismatch", 0) == 0
    assert c["weight_loads"] >= steps * len(models)  # every publish reached the actor
    for model in models:
        assert summary["trained_groups"][model] == steps * 4  # train.steps × batch_groups
        folder = run_dir / "models" / model
        assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
        assert load_file(str(folder / "model.safetensors"))  # loadable weights
    return summary


def test_train_non_shared(tmp_path: Path, model_cache: Path) -> None:
    """Also the GPU recipes' precision on CPU, for the Verifier's model: fp32 masters
    train under bf16-mixed, its hf engine runs bf16 and receives bf16 copies whose digests
    match what the learner published (the Solver stays fp32 end to end). And, in the same
    run (each run costs CI about a minute), the small-sample options on:
    agent_std_pool=batch, std_floor and skip_zero_variance (check_small_sample_options)."""
    run_dir = tmp_path / "run"
    out = drmas(
        "train",
        *FAST,
        "models.verifier.precision=bf16-mixed",
        "+actor.pools={verifier: {dtype: bfloat16}}",
        "logger=[jsonl,tensorboard]",
        *SMALL_SAMPLE,
        f"run.dir={run_dir}",
        f"run.cache_dir={model_cache}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "step    4/4" in out.stdout
    summary = check_run(run_dir, {"solver", "verifier"}, 4)
    check_small_sample_options(run_dir)
    c = summary["counters"]
    assert c["weight_digest_match"] == c["weight_loads"] > 0
    assert c.get("weight_digest_mismatch", 0) == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["actor"]["pools"]["verifier"]["dtype"] == "bfloat16"
    check_report(run_dir, tmp_path)
    check_samples(run_dir)
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 1000  # the lines went there too


SMALL_SAMPLE = [
    "algorithm.advantage.agent_std_pool=batch",
    "algorithm.advantage.std_floor=0.3",
    "algorithm.skip_zero_variance=true",
]
AGENTS = ("solver", "verifier")


def check_small_sample_options(run_dir: Path) -> None:
    """A run with SMALL_SAMPLE finishes with exact accounting, and its metrics lines carry
    the per-agent diagnostics and the running count of skipped zero-variance groups."""
    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    skipped = [x["zero_variance_groups_skipped"] for x in train]
    assert skipped == sorted(skipped)  # a running count
    for line in train:
        for agent in AGENTS:
            acting = line[f"groups_acting/{agent}"]
            assert acting == 4  # both agents act in every episode: in all 4 groups
            assert 0 <= line[f"groups_penalty_only/{agent}"] <= line[f"groups_varying/{agent}"]
            assert line[f"groups_lone/{agent}"] == 0
            assert line[f"advantage/{agent}/max_abs"] >= 0
    summary = read_summary(run_dir)
    c = summary["counters"]
    if not c.get("dropped_stale_groups", 0):
        # Both models then cut the same 4 groups (each has a slice of every group, taken in
        # the same order), and a skipped group never reaches a batch: in each of them some
        # agent's scores vary.
        for line in train:
            assert sum(line[f"groups_varying/{a}"] for a in AGENTS) >= 4
    assert c.get("groups_trained_twice", 0) == 0 and summary["leases"]["balanced"] == 1
    assert c.get("zero_variance_groups_skipped", 0) >= skipped[-1]
    for model in AGENTS:
        trained = summary["trained_groups"][model]
        assert trained == 4 * 4  # train.steps × batch_groups, topped up past skipped groups
        assert trained + c.get("zero_variance_groups_skipped", 0) <= summary["accepted_groups"]


def check_samples(run_dir: Path) -> None:
    """Transcripts: whole episodes as text, every agent's turns with advantages; drmas
    show prints them."""
    import json

    records = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert records and records[0]["step"] == 0  # run.samples_every=10: step 0 of 4
    episode = records[0]["episodes"][0]
    agents = [step["agent"] for step in episode["steps"]]
    assert agents[:2] == ["solver", "verifier"]
    first = episode["steps"][0]
    assert isinstance(first["prompt"], str) and "Question:" in first["prompt"]
    assert isinstance(first["response"], str) and first["version"] == 0
    assert all(isinstance(step["advantage"], float) for step in episode["steps"])
    shown = drmas("show", str(run_dir))
    assert shown.returncode == 0 and "episode 0" in shown.stdout and "[solver" in shown.stdout


def check_report(run_dir: Path, tmp_path: Path) -> None:
    """drmas report on this run and on an "older" copy of it without gradient metrics,
    overlaid: every panel of both opens, has titled axes and one line per run holding
    the metric; the older run's missing panel data is skipped, not an error."""
    import json

    import matplotlib.image

    from drmas.launch.report import write_report

    older = tmp_path / "older"
    older.mkdir()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    stripped = [{k: v for k, v in x.items() if "grad_norm" not in k} for x in lines]
    (older / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in stripped))
    out = tmp_path / "report"
    cli = drmas("report", str(run_dir), str(older), "--out", str(out))
    assert cli.returncode == 0, cli.stderr
    drawn = write_report([run_dir, older], tmp_path / "report2")
    assert drawn.pop("skipped") == []
    assert {"reward", "validation_avg", "grad_norm", "advantage_std", "throughput",
            "learner_time", "process_time"} <= set(drawn)  # fmt: skip
    for name, panel in drawn.items():
        image = matplotlib.image.imread(panel["file"])
        assert image.shape[0] > 100 and image.shape[1] > 100, name
        for axis in panel["axes"]:
            assert axis["title"] and axis["xlabel"] == "step" and axis["ylabel"]
            if "grad_norm" in name:
                # the older run has none; an agent whose advantages were all 0 in these 4
                # steps has norm 0 throughout, which a log axis cannot show
                assert axis["lines"] <= 1, (name, axis)
            else:
                assert axis["lines"] == 2, (name, axis)
    # the Solver always has a gradient (its reward varies within groups)
    solver = next(a for a in drawn["grad_norm"]["axes"] if a["title"] == "grad_norm/solver")
    assert solver["lines"] == 1
    summary = json.loads((out / "summary.json").read_text())
    (labelled, _), (older_label, _) = [(r["label"], r["path"]) for r in summary["runs"]]
    assert labelled.startswith("agent seed 0 η=1") and older_label == "older"
    spikes = summary["spikes"][labelled]
    assert spikes["model solver"]["steps"] == 4 and spikes["model solver"]["skipped_nonfinite"] == 0
    assert summary["spikes"]["older"] == {}
    final = summary["validation"][labelled]["val/avg@2"]["final"]
    assert final["step"] == 4 and final["se"] is not None
    assert "## Gradient norms" in (out / "summary.md").read_text()
    # where the time went: learner seconds from the metrics, the actor's from its time book
    spent = summary["time"][labelled]
    assert spent["span_s"] > 0 and set(spent["learners"]) == {"solver", "verifier"}
    assert all(parts["train_s"] > 0 for parts in spent["learners"].values())
    ((actor, book),) = spent["actors"].items()
    assert 0 < book["busy_fraction"] <= 1 and book["generating_s"] > 0, actor
    assert summary["time"]["older"]["actors"] == {}  # no logs folder: left out
    # the broker's CPU per message type: every kind a run must have sent, each costing time
    broker = spent["broker"]
    kinds = broker["by_kind"]
    assert {"hello", "lease_request", "group_result", "batch_request", "step_report"} <= set(kinds)
    assert kinds["group_result"]["count"] >= 4 * 4 and kinds["hello"]["count"] >= 3
    assert all(k["cpu_s"] > 0 for k in kinds.values()), kinds
    assert 0 < broker["busy_fraction"] < 1 and broker["cpu_s"] < broker["wall_s"]
    train_lines = [x for x in lines if "val/tasks" not in x]
    assert all(0 <= x["broker/busy"] < 1 for x in train_lines)
    # the actors' time per step, from their heartbeats: three shares that add up to 1
    # (a line with no heartbeat since the previous one has none)
    shares = [[x[f"actors/{s}"] for s in ("generating", "waiting_for_leases", "loading_weights")]
              for x in train_lines if "actors/generating" in x]  # fmt: skip
    assert len(shares) >= 2 and all(abs(sum(s) - 1) < 1e-9 for s in shares), shares
    assert any(s[0] > 0 for s in shares), shares
    assert "older" not in {label for label, t in summary["time"].items() if "broker" in t}
    text = (out / "summary.md").read_text()
    assert "## Where the time goes" in text and "| group_result |" in text


def test_train_shared_model_two_fsdp_ranks(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    out = drmas(
        "train",
        *FAST,
        "experiment=tiny_math_shared",
        "models.policy.warmstart.steps=60",  # FAST's short build (the shared model's own key)
        "learner.world_size=2",
        f"run.dir={run_dir}",
        f"run.cache_dir={model_cache}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = check_run(run_dir, {"policy"}, 4)
    assert set(summary["trained_groups"]) == {"policy"}
    line = next(x for x in read_metrics(run_dir) if "val/tasks" not in x)
    assert "agent_grad_norm/solver" in line and "agent_grad_norm/verifier" in line


def test_bad_config_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = drmas("train", "algorithm.advantage.mode=median", f"run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert "algorithm.advantage.mode='median' is not one of" in out.stderr
    assert not (tmp_path / "run").exists()
