"""Agent-wise (Dr. MAS) vs global (GRPO) advantages on `experiment=search_tiny`, over seeds.

    python benchmarks/studies/summarize_search_tiny.py [results folder]

Reads the `bench_train.py` results `search_tiny_{agent,global}.json` (seed 0) and
`search_tiny_{mode}_seed{N}.json` (`actor.engine.seed=N`: the same warm-started models
and task, other samples), and writes `search_tiny_summary.json`: per mode, each seed's
first- and last-quarter values of the key metrics, and their means over the seeds.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

METRICS = (
    "rollout/em",
    "val/avg@4",
    "val/pass@4",
    "rollout/search_calls",
    "val/search_calls",
    "rollout/invalid_actions",
)


def seed_of(path: Path) -> int:
    found = re.search(r"_seed(\d+)\.json$", path.name)
    return int(found.group(1)) if found else 0


def summarize(folder: Path) -> dict[str, object]:
    summary: dict[str, object] = {}
    for mode in ("agent", "global"):
        runs = sorted(
            [
                *folder.glob(f"search_tiny_{mode}.json"),
                *folder.glob(f"search_tiny_{mode}_seed*.json"),
            ],
            key=seed_of,
        )
        per_seed = {}
        for path in runs:
            result = json.loads(path.read_text())
            if result.get("exit_code") != 0:
                raise SystemExit(f"{path} is a failed run (exit {result.get('exit_code')})")
            per_seed[seed_of(path)] = {
                "wall_s": round(result["wall_s"], 1),
                **{
                    f"{m}/{q}": round(result[f"{m}/{q}_quarter"], 4)
                    for m in METRICS
                    for q in ("first", "last")
                },
            }
        if not per_seed:
            raise SystemExit(f"no search_tiny_{mode}*.json in {folder}")
        keys = next(iter(per_seed.values())).keys()
        summary[mode] = {
            "seeds": per_seed,
            "mean": {
                k: round(sum(s[k] for s in per_seed.values()) / len(per_seed), 4) for k in keys
            },
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description="agent vs global on search_tiny, over seeds")
    parser.add_argument("folder", nargs="?", type=Path, help="default: benchmarks/results/",
                        default=Path(__file__).resolve().parents[1] / "results")  # fmt: skip
    folder = parser.parse_args().folder
    summary = summarize(folder)
    out = folder / "search_tiny_summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    for mode, data in summary.items():
        assert isinstance(data, dict)
        mean = data["mean"]
        print(
            f"{mode} ({len(data['seeds'])} seeds): "
            + ", ".join(f"{m} {mean[m + '/first']:.3f} -> {mean[m + '/last']:.3f}" for m in METRICS)
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
