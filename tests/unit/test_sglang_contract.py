"""Every request the sglang engine makes, checked against SGLang's own request types.

`sglang` cannot be imported without a GPU build, so the types come from its source:
tests/data/sglang/io_struct.py.txt and sampling_params.py.txt (sglang 0.5.23, copied
unmodified from the PyPI wheel; provenance at the top of each), parsed with `ast`. For each
route the adapter uses, every key it sends must be a field of the request type (own or
inherited from BaseReq), every field without a default must be sent, and each value must
fit the field's annotation (Optional/Union/List/Dict/Literal/Annotated/str/int/float/bool).

Routes and request types, as declared in sglang 0.5.23
python/sglang/srt/entrypoints/http_server.py (`@app.post` / `@app.get` decorators):
  POST /generate                        GenerateReqInput (sampling_params -> SamplingParams)
  POST /pause_generation                PauseGenerationReqInput (mode abort|retract|in_place)
  POST /continue_generation             ContinueGenerationReqInput
  POST /init_weights_update_group       InitWeightsUpdateGroupReqInput
  POST /update_weights_from_distributed UpdateWeightsFromDistributedReqInput
  POST /destroy_weights_update_group    DestroyWeightsUpdateGroupReqInput
  POST /begin_weight_update             BeginWeightUpdateReqInput (0.5.2x; 404 before)
  POST /end_weight_update               EndWeightUpdateReqInput
  POST /load_lora_adapter               LoadLoRAAdapterReqInput (LoRA base)
  POST /unload_lora_adapter             UnloadLoRAAdapterReqInput (LoRA base)
  GET  /health, GET /get_model_info     no body

Response fields the adapter reads, checked by hand in sglang 0.5.23 source:
  /generate (tokenizer_manager.py, _handle_batch_output + add_logprob_to_meta_info +
  detokenize_logprob_tokens): top-level "output_ids" (list of int), "meta_info" with
  "finish_reason" (BaseFinishReason.to_json in schedule_batch.py: {"type": "stop",
  "matched": ...} | {"type": "length", "length": n} | {"type": "abort", "message": ...}),
  "weight_version", "output_token_logprobs" = list of (logprob, token_id, text-or-None)
  triples (text None unless return_text_in_logprobs). The scheduler's outputs behind them
  are BatchStrOutput.finished_reasons / output_ids / output_token_logprobs_val / _idx,
  checked below in the vendored io_struct.
  weight routes (http_server.py): {"success": bool, "message": str}, 200 or 400; the
  matching *ReqOutput types have exactly those fields (checked below).
  /load_lora_adapter, /unload_lora_adapter (http_server.py): LoRAUpdateOutput, {"success":
  bool, "error_message": str | None, "loaded_adapters": {name: path}}, 200 or 400 (checked
  below); GenerateReqInput.lora_path takes a loaded adapter's name (None: the base).
  /get_model_info: {"weight_version": ..., "model_path": ..., ...}.
"""

from __future__ import annotations

import ast
import asyncio
import functools
from pathlib import Path
from typing import Any, get_args

import pytest

from drmas.actors.engines import sglang as sg
from drmas.actors.engines import sglang_requests as sq
from drmas.actors.engines import sglang_server as ss
from drmas.actors.engines.base import GenerateRequest
from drmas.config.actor import EngineConfig
from drmas.config.types import PauseMode
from drmas.transports.digest import digest_of
from tests.unit.lora_helpers import ADAPTERS, LORA, peft_model, published, tiny_model_folder

DATA = Path(__file__).resolve().parents[1] / "data" / "sglang"

ROUTES: dict[str, str | None] = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/health": None,
    "/get_model_info": None,
}


# ------------------------------------------------------------------ vendored types
@functools.cache
def _classes(filename: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse((DATA / filename).read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


@functools.cache
def _aliases(filename: str) -> dict[str, ast.expr]:
    """Module-level `Name = <type>` assignments (type aliases)."""
    tree = ast.parse((DATA / filename).read_text())
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                out[target.id] = node.value
    return out


def fields(cls: str, filename: str = "io_struct.py.txt") -> dict[str, tuple[ast.expr, bool]]:
    """name -> (annotation, has_default) over the class and its bases in the same file."""
    node = _classes(filename)[cls]
    out: dict[str, tuple[ast.expr, bool]] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in _classes(filename):
            out.update(fields(base.id, filename))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out[stmt.target.id] = (stmt.annotation, stmt.value is not None)
    return out


def _sub_args(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


@functools.cache
def _parse_annotation(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def _parse_everything_now() -> None:
    """Parse the vendored files and every string annotation at import, in the main thread.

    The fake server (test_sglang_engine.py) checks bodies in its handler threads; on
    CPython 3.11, ast.parse in a thread can raise "AST constructor recursion depth mismatch"
    after another test (hypothesis) changed the recursion limit, so threads must only
    read these caches."""
    for filename in ("io_struct.py.txt", "sampling_params.py.txt"):
        if not (DATA / filename).exists():
            continue
        _aliases(filename)
        for cls in _classes(filename).values():
            for node in ast.walk(cls):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    try:
                        _parse_annotation(node.value)
                    except SyntaxError:
                        continue  # a docstring or default, not an annotation


def conforms(value: Any, ann: ast.expr, filename: str = "io_struct.py.txt") -> bool:
    """Does a JSON value fit the annotation (as pydantic would accept it)?"""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # string annotation
        return conforms(value, _parse_annotation(ann.value), filename)
    if isinstance(ann, ast.Name):
        name = ann.id
        simple: dict[str, Any] = {
            "str": lambda v: isinstance(v, str),
            "bool": lambda v: isinstance(v, bool),
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "Any": lambda v: True,
        }
        if name in simple:
            return bool(simple[name](value))
        alias = _aliases(filename).get(name)
        if alias is not None:
            return conforms(value, alias, filename)
        raise AssertionError(f"contract checker cannot interpret annotation {name!r}")
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name):
        head, args = ann.value.id, _sub_args(ann)
        if head == "Optional":
            return value is None or conforms(value, args[0], filename)
        if head == "Union":
            return any(conforms(value, a, filename) for a in args)
        if head in ("List", "Set", "list", "set"):
            return isinstance(value, list) and all(conforms(v, args[0], filename) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict) and all(
                conforms(k, args[0], filename) and conforms(v, args[1], filename)
                for k, v in value.items()
            )
        if head == "Literal":
            return any(isinstance(a, ast.Constant) and a.value == value for a in args)
        if head == "Annotated":
            return conforms(value, args[0], filename)
    raise AssertionError(f"contract checker cannot interpret annotation {ast.unparse(ann)}")


def violations(route: str, body: dict[str, Any] | None) -> list[str]:
    """Why `body` sent to `route` does not fit SGLang's request type ([] when it does)."""
    if route not in ROUTES:
        return [f"{route} is not an SGLang route the contract knows"]
    cls = ROUTES[route]
    if cls is None:
        return [] if body is None else [f"{route} takes no body"]
    if body is None:
        return [f"{route} needs a JSON body ({cls})"]
    problems = _check_fields(body, cls, "io_struct.py.txt")
    if route == "/generate" and isinstance(body.get("sampling_params"), dict):
        problems += _check_fields(
            body["sampling_params"], "SamplingParams", "sampling_params.py.txt"
        )
    return problems


def _check_fields(body: dict[str, Any], cls: str, filename: str) -> list[str]:
    known = fields(cls, filename)
    problems = [f"{cls} has no field {k!r}" for k in body if k not in known]
    problems += [
        f"{cls}.{k} is required" for k, (_, has_default) in known.items()
        if not has_default and k not in body
    ]  # fmt: skip
    problems += [
        f"{cls}.{k} = {v!r} does not fit {ast.unparse(known[k][0])}"
        for k, v in body.items()
        if k in known and not conforms(v, known[k][0], filename)
    ]
    return problems


# ------------------------------------------------------------------ the checker itself
_parse_everything_now()


def test_checker_rejects_what_sglang_would_reject() -> None:
    assert violations("/generate", {"input_ids": [1, 2], "bogus": 1}) == [
        "GenerateReqInput has no field 'bogus'"
    ]
    assert violations("/init_weights_update_group", {"master_address": "h"})  # missing fields
    bad_type = {"names": ["a"], "dtypes": ["float32"], "shapes": [["2"]]}
    assert violations("/update_weights_from_distributed", bad_type)
    assert violations("/pause_generation", {"mode": "keep"})  # not one of SGLang's modes
    assert violations("/generate", {"sampling_params": {"max_tokens": 3}})  # vLLM's name
    assert violations("/flush_everything", {})


# ------------------------------------------------------------------ bodies
REQUEST = GenerateRequest([5, 6, 7], temperature=0.7, top_p=0.9, max_new_tokens=12, stop=("\n",))


def test_generate_body_fits_generate_req_input_and_sampling_params() -> None:
    body = sq.generate_body(REQUEST)
    assert violations("/generate", body) == []
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] is True
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 12 and params["stop"] == ["\n"]
    assert params["temperature"] == 0.7 and params["top_p"] == 0.9


# SamplingParams fields SGLang sets itself (__post_init__, normalize), not request input.
SAMPLING_INTERNAL = {
    "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
    "ebnf_full_assistant",
}  # fmt: skip
PER_REQUEST = {"temperature", "top_p", "max_new_tokens", "stop", "no_stop_trim"}


def _sampling_defaults() -> dict[str, ast.expr]:
    node = _classes("sampling_params.py.txt")["SamplingParams"]
    return {
        stmt.target.id: stmt.value
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value
    }


def test_generate_body_sends_every_sampling_field() -> None:
    """A field left out would take a server default (--preferred-sampling-params, the
    model's generation config) and change the distribution the engine samples from."""
    api = set(fields("SamplingParams", "sampling_params.py.txt")) - SAMPLING_INTERNAL
    defaults = _sampling_defaults()
    none_by_default = {
        k for k in api - PER_REQUEST if k in defaults and ast.unparse(defaults[k]) == "None"
    }
    for body in (sq.generate_body(REQUEST), sq.generate_body(REQUEST, "solver-v3-5")):
        assert set(body["sampling_params"]) == api - none_by_default
    assert set(sq.NEUTRAL_SAMPLING) == api - PER_REQUEST - none_by_default
    assert {"top_k", "min_p", "repetition_penalty"} <= set(sq.NEUTRAL_SAMPLING)


def test_pinned_sampling_fields_are_sglangs_own_defaults() -> None:
    """Each pinned field is the value SGLang itself defaults to, i.e. its feature off; top_k
    is sent as -1, which SamplingParams.__post_init__ turns into its default TOP_K_ALL
    (the whole vocabulary)."""
    defaults = _sampling_defaults()
    for key, value in sq.NEUTRAL_SAMPLING.items():
        if key == "top_k":
            assert value == -1 and ast.unparse(defaults[key]) == "TOP_K_ALL"
            continue
        assert ast.literal_eval(defaults[key]) == value, key
    assert (
        "if self.top_k == -1:\n            self.top_k = TOP_K_ALL"
        in (DATA / "sampling_params.py.txt").read_text()
    )


def test_every_pause_mode_has_an_sglang_mode() -> None:
    assert set(sq.PAUSE_MODES) == set(get_args(PauseMode))


@pytest.mark.parametrize("mode", get_args(PauseMode))
def test_pause_body_maps_our_modes_to_sglang_modes(mode: PauseMode) -> None:
    body = sq.pause_body(mode)
    assert violations("/pause_generation", body) == []
    assert body["mode"] == {"keep": "retract", "abort": "abort"}[mode]


def test_weight_bodies_fit_their_request_types() -> None:
    init = sq.init_group_body("127.0.0.1", 29500, 3, "g")
    assert violations("/init_weights_update_group", init) == []
    assert init["rank_offset"] == 1 and init["world_size"] == 3 and init["backend"] == "gloo"
    update = sq.update_body(["w", "b"], ["bfloat16", "float32"], [(4, 2), (4,)], "g", 7)
    assert violations("/update_weights_from_distributed", update) == []
    assert update["weight_version"] == "7" and update["shapes"] == [[4, 2], [4]]
    assert update["flush_cache"] is True
    assert violations("/destroy_weights_update_group", sq.destroy_group_body("g")) == []
    assert violations("/begin_weight_update", sq.begin_update_body()) == []
    assert violations("/end_weight_update", sq.end_update_body()) == []
    assert violations("/continue_generation", sq.continue_body()) == []


def test_lora_bodies_fit_their_request_types() -> None:
    load = sq.load_lora_body("solver-v3-5", "/tmp/drmas-lora-m/solver-v3-5")
    assert violations("/load_lora_adapter", load) == []
    assert load == {"lora_name": "solver-v3-5", "lora_path": "/tmp/drmas-lora-m/solver-v3-5"}
    assert violations("/unload_lora_adapter", sq.unload_lora_body("solver-v3-5")) == []
    body = sq.generate_body(REQUEST, "solver-v3-5")
    assert violations("/generate", body) == [] and body["lora_path"] == "solver-v3-5"
    assert "lora_path" not in sq.generate_body(REQUEST)  # the base, or a full model
    # both LoRA routes answer LoRAUpdateOutput (200, or 400 with success false)
    reply = set(fields("LoRAUpdateOutput")) - {"rid", "http_worker_ipc"}
    assert reply == {"success", "error_message", "loaded_adapters"}


def test_dtype_names_we_send_are_torch_attribute_names() -> None:
    """SGLang turns each dtype string into `getattr(torch, name)`."""
    import torch

    from drmas.transports.weights import spec_of

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = spec_of("w", torch.zeros(2, dtype=dtype)).dtype
        assert getattr(torch, name) is dtype


# ------------------------------------------------------------------ the engine's calls
def test_every_call_the_engine_makes_fits_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drive the engine's control paths with HTTP recorded, then check each request."""
    sent: list[tuple[str, dict[str, Any] | None]] = []

    def fake_http(url: str, route: str, body: dict[str, Any] | None, timeout_s: float):
        assert timeout_s > 0
        sent.append((route, body))
        if route == "/generate":
            meta = {"finish_reason": {"type": "length", "length": 2}, "weight_version": "default",
                    "output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None]]}  # fmt: skip
            return 200, {"text": "ab", "output_ids": [11, 12], "meta_info": meta}
        if route == "/get_model_info":
            return 200, {"weight_version": "3", "model_path": "m"}
        return 200, {"success": True, "message": "ok"}

    monkeypatch.setattr(sq, "http_call", fake_http)
    engine = sg.SGLangEngine("m", "unused", EngineConfig(), ss.SGLangOptions(url="http://x"))

    async def drive() -> None:
        result = await engine.generate(REQUEST)
        assert result.token_ids == [11, 12] and result.logprobs == [-0.5, -1.5]
        await engine.pause()
        engine._session_call("/begin_weight_update", sq.begin_update_body())
        engine._session = 1
        await engine.resume()
        assert engine.server_weight_version() == "3"
        assert engine.backup_weights() is None  # a full model cannot roll back
        with pytest.raises(ValueError, match="has no adapters"):
            await engine.generate(GenerateRequest([1, 2], 1.0, 1.0, 1, adapter="solver"))
        await engine.close()

    asyncio.run(drive())
    routes = [r for r, _ in sent]
    assert routes == ["/generate", "/pause_generation", "/begin_weight_update",
                      "/end_weight_update", "/continue_generation", "/get_model_info"]  # fmt: skip
    for route, body in sent:
        assert violations(route, body) == [], route


def test_every_call_a_lora_engine_makes_fits_the_contract(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A LoRA base with HTTP recorded: two publishes (each adapter loaded under a new name
    per version, the versions no request uses unloaded), generation on each adapter."""
    sent: list[tuple[str, dict[str, Any] | None]] = []

    def fake_http(url: str, route: str, body: dict[str, Any] | None, timeout_s: float):
        sent.append((route, body))
        if route == "/generate":
            meta = {"finish_reason": {"type": "length", "length": 1}, "weight_version": "1",
                    "output_token_logprobs": [[-0.5, 11, None]]}  # fmt: skip
            return 200, {"text": "a", "output_ids": [11], "meta_info": meta}
        return 200, {"success": True, "error_message": "", "loaded_adapters": {}}

    monkeypatch.setattr(sq, "http_call", fake_http)
    model = tiny_model_folder(tmp_path)
    engine = sg.SGLangEngine(
        "m", model, EngineConfig(), ss.SGLangOptions(url="http://x"), lora=LORA, adapters=ADAPTERS
    )
    assert engine.adapters is not None
    engine.adapters.start()

    async def drive() -> None:
        first = await engine.generate(GenerateRequest([1, 2], 1.0, 1.0, 1, adapter="solver"))
        assert first.version == 0
        for version in (1, 2):
            named = published(peft_model(model, seed=version))
            await engine.pause()
            engine.load_weights(named[:3], version)  # in buckets, staged once whole
            assert engine.version == version - 1
            engine.load_weights(named[3:], version)
            assert engine.version == version - 1 and engine.weights_digest() == digest_of(named)
            await engine.resume()  # the load went through: the staged adapters serve
            assert engine.version == version and engine.weights_digest() == digest_of(named)
            await engine.generate(GenerateRequest([1, 2], 1.0, 1.0, 1, adapter="verifier"))
        # the actor's failure path: a publish received in part is dropped, nothing loads,
        # and a later call that starts mid-adapter is refused (the sorted wire order says
        # what a whole publish is), leaving version 2 serving
        backup = engine.backup_weights()
        engine.load_weights(named[:3], 3)
        engine.restore_weights(backup)
        with pytest.raises(ValueError, match="the publish skipped"):
            engine.load_weights(named[3:], 3)
        engine.restore_weights(backup)
        assert engine.version == 2 and engine.weights_digest() == digest_of(named)
        with pytest.raises(ValueError, match=r"'critic'; this engine serves"):
            await engine.generate(GenerateRequest([1, 2], 1.0, 1.0, 1, adapter="critic"))
        await engine.close()

    asyncio.run(drive())
    for route, body in sent:
        assert violations(route, body) == [], route
    adapter_routes = ("/generate", "/load_lora_adapter", "/unload_lora_adapter")
    calls = [
        (r, (b or {}).get("lora_name", (b or {}).get("lora_path")))
        for r, b in sent
        if r in adapter_routes
    ]
    assert calls == [
        ("/generate", None),  # before the first publish: the base
        ("/load_lora_adapter", "solver-v1-1"), ("/load_lora_adapter", "verifier-v1-2"),
        ("/generate", "verifier-v1-2"),
        ("/load_lora_adapter", "solver-v2-3"), ("/load_lora_adapter", "verifier-v2-4"),
        ("/unload_lora_adapter", "solver-v1-1"), ("/unload_lora_adapter", "verifier-v1-2"),
        ("/generate", "verifier-v2-4"),
    ]  # fmt: skip


# ------------------------------------------------------------------ responses
def test_scheduler_outputs_behind_the_fields_we_read_exist() -> None:
    out = fields("BatchStrOutput")
    for name in ("finished_reasons", "output_ids", "output_token_logprobs_val",
                 "output_token_logprobs_idx"):  # fmt: skip
        assert name in out, name
    for cls in ("InitWeightsUpdateGroupReqOutput", "UpdateWeightsFromDistributedReqOutput",
                "DestroyWeightsUpdateGroupReqOutput", "BeginWeightUpdateReqOutput",
                "EndWeightUpdateReqOutput"):  # fmt: skip
        assert set(fields(cls)) - {"rid", "http_worker_ipc"} == {"success", "message"}, cls


def test_parse_generate_reads_sglang_reply_shapes() -> None:
    def reply(reason: dict[str, Any], triples: list[list[Any]]) -> dict[str, Any]:
        meta = {"id": "r", "finish_reason": reason, "prompt_tokens": 3,
                "weight_version": "2", "output_token_logprobs": triples}  # fmt: skip
        return {"text": "", "output_ids": [t[1] for t in triples], "meta_info": meta}

    got = sq.parse_generate(
        reply({"type": "stop", "matched": 2}, [[-0.1, 9, None], [-2.0, 2, None]])
    )
    assert got == ([9, 2], [-0.1, -2.0], "stop")
    got = sq.parse_generate(reply({"type": "length", "length": 1}, [[-0.3, 4, None]]))
    assert got == ([4], [-0.3], "length")
    assert sq.parse_generate(reply({"type": "abort", "message": "x"}, []))[2] == "abort"
    broken = reply({"type": "stop", "matched": "\n"}, [[-0.1, 9, None]])
    broken["output_ids"] = [9, 10]
    with pytest.raises(ValueError, match="disagree"):
        sq.parse_generate(broken)
    with pytest.raises(ValueError, match="output_token_logprobs"):
        sq.parse_generate({"output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}})


def test_launch_args_use_sglang_server_flags() -> None:
    """Flag names are SGLang ServerArgs fields (sglang/srt/arg_groups/fields, 0.5.23)."""
    opts = ss.SGLangOptions(port=1, tp_size=2, context_length=512, prefix_caching=False,
                            command=["sglang"])  # fmt: skip
    args = ss.launch_args(opts, "/m", 1234)
    flags = {a for a in args if a.startswith("--")}
    assert flags == {"--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static",
                     "--dtype", "--random-seed", "--context-length", "--disable-radix-cache"}  # fmt: skip
    assert args[args.index("--port") + 1] == "1234" and args[args.index("--tp-size") + 1] == "2"


def test_launch_args_on_a_lora_base() -> None:
    """ServerArgs fields enable_lora, max_lora_rank, lora_target_modules (a list: nargs)
    and max_loras_per_batch: the adapters are loaded later, so rank and modules are given
    up front (SGLang's LoRA docs, "Dynamic LoRA loading")."""
    args = ss.launch_args(ss.SGLangOptions(command=["sglang"]), "/m", 1, LORA, ADAPTERS)
    assert args[args.index("--enable-lora") :] == [
        "--enable-lora", "--max-lora-rank", "4",
        "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
        "--max-loras-per-batch", "5",  # two versions of each adapter, and the base
    ]  # fmt: skip
    assert "--enable-lora" not in ss.launch_args(ss.SGLangOptions(command=["sglang"]), "/m", 1)
    clash = ss.SGLangOptions(command=["sglang"], extra_args=["--max-lora-rank", "8"])
    with pytest.raises(ValueError, match=r"may not set \['--max-lora-rank'\]"):
        ss.launch_args(clash, "/m", 1, LORA, ADAPTERS)


def test_options_come_from_the_engine_config_fields() -> None:
    """The pool's engine arguments pass through (field names shared with the vllm engine)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(name="sglang", max_batch=16, dtype="bfloat16", seed=3,
                          tensor_parallel_size=2, gpu_memory_utilization=0.7, max_model_len=1024,
                          enable_prefix_caching=False, pause_mode="abort",
                          extra_args={"chunked_prefill_size": 512, "enable_torch_compile": True,
                                      "disable_cuda_graph": False},
                          sglang_url="http://h:1")  # fmt: skip
    opts = ss.SGLangOptions.from_config(cfg)  # type: ignore[arg-type]
    assert (opts.tp_size, opts.mem_fraction, opts.context_length) == (2, 0.7, 1024)
    assert (opts.prefix_caching, opts.pause_mode, opts.url) == (False, "abort", "http://h:1")
    assert (opts.dtype, opts.seed, opts.max_concurrency) == ("bfloat16", 3, 16)
    args = ss.launch_args(opts, "/m", 1)
    assert args[-3:] == ["--chunked-prefill-size", "512", "--enable-torch-compile"]
    assert "--disable-radix-cache" in args and "--disable-cuda-graph" not in args
    with pytest.raises(ValueError, match="pause_mode"):
        ss.SGLangOptions.from_config(SimpleNamespace(pause_mode="drain"))  # type: ignore[arg-type]


def test_missing_sglang_is_reported_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'drmas\[sglang\]'"):
        ss.require_sglang(ss.SGLangOptions())
    ss.require_sglang(ss.SGLangOptions(url="http://h:1"))  # a running server needs no package
