"""GPU placement plans of `drmas train`, with a faked GPU count (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drmas.config import ConfigError, load_config
from drmas.launch import placement
from drmas.launch.placement import PlacementError, plan_placement, visible_gpus

SEARCH = ["experiment=search", "task.train_path=x.parquet"]  # 3 models, vLLM engines


def test_cpu_run_places_nothing() -> None:
    assert plan_placement(load_config([]), 0) is None


def test_gpus_are_counted_by_torch_only_where_a_gpu_driver_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a GPU driver's device file the count is 0 and torch is never asked (the
    launcher then starts without importing torch); with one, torch counts."""
    monkeypatch.setattr(placement.sys, "platform", "linux")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    cfg = load_config(["learner.device=auto"])
    monkeypatch.setattr(placement, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    assert visible_gpus(cfg) == 0
    (tmp_path / "nvidiactl").touch()
    assert visible_gpus(cfg) == 3
    assert visible_gpus(load_config(["learner.device=auto", "placement.gpus=8"])) == 8


def test_eight_gpus_search_team_is_exclusive() -> None:
    cfg = load_config([*SEARCH, "actor.num_actors=5", "actor.engine.gpu_memory_utilization=0.3"])
    plan = plan_placement(cfg, 8)
    assert plan is not None
    assert plan.learners == {"answerer": (0,), "searcher": (1,), "verifier": (2,)}
    assert plan.actors == ((3,), (4,), (5,), (6,), (7,))
    assert plan.shared == [] and plan.weights_backend == "nccl"
    assert plan.env_learner("searcher", 0) == {"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0"}
    assert plan.env_actor(4) == {"CUDA_VISIBLE_DEVICES": "7"}
    assert "every GPU exclusive" in plan.describe()


def test_learner_ranks_and_tensor_parallel_engines() -> None:
    cfg = load_config(
        [*SEARCH, "learner.world_size=2", "actor.num_actors=1",
         "actor.engine.tensor_parallel_size=2", "actor.engine.gpu_memory_utilization=0.3"]
    )  # fmt: skip
    plan = plan_placement(cfg, 8)
    assert plan is not None
    assert plan.learners == {"answerer": (0, 1), "searcher": (2, 3), "verifier": (4, 5)}
    assert plan.actors == ((6, 7),)
    assert plan.env_actor(0) == {"CUDA_VISIBLE_DEVICES": "6,7"}


def test_one_gpu_holds_a_shared_model_learner_and_its_engine() -> None:
    """The one-GPU check's layout: one learner and one vLLM engine on GPU 0."""
    cfg = load_config(["experiment=tiny_math_shared", "models.policy.precision=bf16-mixed",
                       "actor.engine.name=vllm", "actor.engine.gpu_memory_utilization=0.3"])  # fmt: skip
    plan = plan_placement(cfg, 1)
    assert plan is not None
    assert plan.learners == {"policy": (0,)} and plan.actors == ((0,),)
    assert plan.shared == [0] and plan.weights_backend == "gloo"


def test_fewer_gpus_than_learners_share_across_models_unless_exclusive() -> None:
    plan = plan_placement(load_config([]), 1)  # hf engines: no fixed memory fraction
    assert plan is not None and plan.learners == {"solver": (0,), "verifier": (0,)}
    with pytest.raises(PlacementError, match=r"placement\.share=exclusive, but GPU 0"):
        plan_placement(load_config(["placement.share=exclusive"]), 1)
    with pytest.raises(PlacementError, match="learner answerer has 2 ranks but only 1 GPU"):
        plan_placement(load_config([*SEARCH, "learner.world_size=2"]), 1)
    # two learners on one GPU leave no room for engines that reserve memory
    with pytest.raises(PlacementError, match=r"beside 2 learner rank\(s\)"):
        plan_placement(load_config(["actor.engine.name=vllm"]), 1)


def test_colocated_actor_on_a_learner_gpu() -> None:
    cfg = load_config(["actor.engine.name=vllm", "actor.engine.gpu_memory_utilization=0.2"])
    plan = plan_placement(cfg, 2)  # 2 learner ranks fill both GPUs: the actor shares
    assert plan is not None
    assert plan.learners == {"solver": (0,), "verifier": (1,)} and plan.actors == ((0,),)
    assert plan.shared == [0] and plan.weights_backend == "gloo"
    assert plan.colocated == ("solver",)
    assert "shared GPUs: 0" in plan.describe() and "weight group of solver" in plan.describe()


def test_shared_engines_must_leave_room_for_the_learner() -> None:
    cfg = load_config(["actor.engine.name=vllm", "actor.engine.gpu_memory_utilization=0.4"])
    with pytest.raises(PlacementError, match=r"GPU 0 is oversubscribed: engines reserve 0\.80"):
        plan_placement(cfg, 2)  # two engines of 0.4 beside a learner that keeps 0.5


def test_exclusive_refuses_to_share_and_nccl_refuses_colocation() -> None:
    cfg = load_config(["placement.share=exclusive"])
    with pytest.raises(PlacementError, match=r"placement\.share=exclusive"):
        plan_placement(cfg, 2)
    cfg = load_config(["weights.backend=nccl", "actor.engine.name=vllm",
                       "actor.engine.gpu_memory_utilization=0.2"])  # fmt: skip
    with pytest.raises(PlacementError, match="NCCL cannot connect two ranks on one device"):
        plan_placement(cfg, 2)


def test_shared_mode_keeps_gpus_free() -> None:
    cfg = load_config(["placement.share=shared", "actor.num_actors=2"])
    plan = plan_placement(cfg, 4)  # hf engines reserve no fixed fraction
    assert plan is not None
    assert plan.actors == ((0,), (1,))


def test_explicit_lists() -> None:
    cfg = load_config(
        ["+placement.learners.solver=[3]", "+placement.learners.verifier=[2]",
         "+placement.actors.0=[0]", "actor.num_actors=2"]
    )  # fmt: skip
    plan = plan_placement(cfg, 4)
    assert plan is not None
    assert plan.learners == {"solver": (3,), "verifier": (2,)}
    assert plan.actors == ((0,), (1,))  # actor 1: the first GPU left


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["+placement.learners.solver=[0,1]"], r"lists 2 GPU\(s\) for 1 learner rank"),
        (["+placement.learners.solver=[7]"], "GPU 7 does not exist"),
        (["+placement.learners.solver=[1]", "+placement.learners.verifier=[1]",
          "placement.share=exclusive"],
         "GPU 1 is given to learner solver rank 0 and to learner verifier"),
        (["learner.world_size=2", "+placement.learners.solver=[1,1]"],
         "need different GPUs"),
        (["+placement.actors.0=[0,1]"], r"need 1 different GPU"),
    ],
)  # fmt: skip
def test_bad_explicit_lists_say_what_to_fix(overrides: list[str], match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        plan_placement(load_config(overrides), 4)


def test_unknown_share_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"placement\.share"):
        load_config(["placement.share=sometimes"])


def test_a_chosen_port_is_bindable_and_outside_the_kernels_ephemeral_range() -> None:
    """A learner binds its MASTER_PORT seconds after drmas train chose it; a port from the
    ephemeral range could meanwhile be handed to any port-0 bind or outgoing connection
    (a CI run lost a learner to EADDRINUSE that way)."""
    import socket

    from drmas.transports.ports import LOWEST, ephemeral_range, free_port

    low, _ = ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free when chosen


def test_the_plan_says_what_a_lora_base_holds() -> None:
    from drmas.launch.placement import adapter_plan

    cfg = load_config(
        [
            "models.solver.lora.rank=8",
            "agents.verifier.model=solver",
            "agents.verifier.adapter=solver",
        ]
    )
    assert adapter_plan(cfg) == (
        "model solver: 1 LoRA adapters of rank 8 on one frozen base [solver (solver+verifier)]; "
        "one learner group trains them all; the hf engine holds one copy of the base and 1 "
        "adapters"
    )
    vllm = load_config(
        ["models.solver.lora.rank=4", "agents.verifier.model=solver", "actor.engine.name=vllm"]
    )
    assert adapter_plan(vllm).endswith(
        "vLLM holds max_loras=2 (one more on CPU, where the base is served by an all-zero "
        "adapter), max_lora_rank=8"  # rank 4 rounded up to vLLM's smallest slot that holds it
    )
    sglang = load_config(
        ["models.solver.lora.rank=4", "agents.verifier.model=solver", "actor.engine.name=sglang"]
    )
    assert adapter_plan(sglang).endswith("SGLang holds max_loras_per_batch=5, max_lora_rank=4")
    assert adapter_plan(load_config([])) == ""  # full fine-tuning: nothing to say
