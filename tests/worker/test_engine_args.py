"""Worker engine arguments: the split-engine settings and the ``engine_args`` pass-through,
checked against vLLM's own EngineArgs at start-up (imports vLLM, starts no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmesh.meshconfig import WorkerConfig, load_mesh_config
from llmesh.up import _flags
from services.common.settings import settings_from_args
from services.worker import cli
from services.worker.server import check_settings, engine_args
from services.worker.settings import WorkerSettings

pytest.importorskip("vllm")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def settings(model_dir: Path, **fields: object) -> WorkerSettings:
    return WorkerSettings(model=str(model_dir), device="cpu", **fields)  # type: ignore[arg-type]


def test_an_unknown_engine_arg_is_refused_with_its_name(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown vLLM engine argument 'max_num_seqz'.*did you mean") as err:
        check_settings(settings(model_dir, engine_args={"max_num_seqz": 4}))
    assert "max_num_seqz" in str(err.value)


def test_the_worker_cli_refuses_a_mistyped_engine_arg_before_any_engine(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["--model", str(model_dir), "--device", "cpu",
                   "--engine-args", '{"kv_cache_dtyp": "fp8"}'])
    assert rc == 2  # the exit code of every other configuration error
    err = capsys.readouterr().err
    assert "'kv_cache_dtyp'" in err and "'kv_cache_dtype'" in err


@pytest.mark.parametrize(("key", "hint"), [
    ("model", "--model"),
    ("tokenizer", "llmesh sets it itself"),
    ("logits_processors", "llmesh sets it itself"),
    ("tensor_parallel_size", "--tensor-parallel-size"),
    ("data_parallel_size", "--data-parallel-size"),
    ("max_num_seqs", "--max-num-seqs"),
])
def test_names_llmesh_owns_are_refused_not_silently_overridden(
    model_dir: Path, key: str, hint: str
) -> None:
    with pytest.raises(ValueError, match=f"'{key}' is not allowed here") as err:
        check_settings(settings(model_dir, engine_args={key: 2}))
    assert hint in str(err.value)


def test_known_engine_args_pass_through_last(model_dir: Path) -> None:
    s = settings(model_dir, engine_args={"kv_cache_dtype": "auto", "max_loras": 3},
                 lora_modules=("a=/x",), data_parallel_size=2, data_parallel_size_local=1,
                 data_parallel_start_rank=1, data_parallel_address="10.0.0.1",
                 data_parallel_rpc_port=13345, distributed_executor_backend="mp")
    check_settings(s)
    args = engine_args(s, "cpu")
    assert args["kv_cache_dtype"] == "auto"
    assert args["max_loras"] == 3  # engine_args refines what llmesh derived (1 adapter)
    assert args["data_parallel_size"] == 2
    assert args["data_parallel_size_local"] == 1
    assert args["data_parallel_start_rank"] == 1
    assert args["data_parallel_address"] == "10.0.0.1"
    assert args["data_parallel_rpc_port"] == 13345
    assert args["distributed_executor_backend"] == "mp"
    # Unset multi-node fields keep vLLM's defaults (not passed at all).
    plain = engine_args(settings(model_dir), "cpu")
    assert "data_parallel_address" not in plain and "distributed_executor_backend" not in plain


@pytest.mark.parametrize(("fields", "message"), [
    ({"data_parallel_size": 0}, "--data-parallel-size must be at least 1"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "--data-parallel-size-local"),
    ({"data_parallel_size": 2, "data_parallel_start_rank": 2}, "--data-parallel-start-rank"),
    ({"distributed_executor_backend": "uni-proc"}, "--distributed-executor-backend"),
    ({"data_parallel_backend": "rpc"}, "--data-parallel-backend"),
    ({"tensor_parallel_size": 2, "cpu_omp_threads_bind": "0-1"}, "1 core group"),
    ({"data_parallel_size": 2, "cpu_omp_threads_bind": "0|1|1"}, "3 core group"),
])
def test_parallel_settings_that_cannot_work_are_refused(
    model_dir: Path, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_settings(settings(model_dir, **fields))


def test_one_core_group_per_local_rank_is_accepted(model_dir: Path) -> None:
    check_settings(settings(model_dir, tensor_parallel_size=2, cpu_omp_threads_bind="0|1"))
    check_settings(settings(model_dir, data_parallel_size=4, data_parallel_size_local=2,
                            cpu_omp_threads_bind="0|1"))


def test_mesh_config_engine_args_reach_the_worker_flags(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": [{
        "zone": "zone-a", "settings": {"tensor_parallel_size": 2},
        "engine_args": {"kv_cache_dtype": "auto", "max_logprobs": 20},
    }]}))
    worker = load_mesh_config(path).workers[0]
    assert worker.engine_args == {"kv_cache_dtype": "auto", "max_logprobs": 20}
    # up.py passes them as --engine-args JSON; the worker's CLI reads back the same mapping.
    flags = _flags({**worker.settings, "engine_args": worker.engine_args})
    parsed = settings_from_args(WorkerSettings, cli.build_parser().parse_args(flags))
    assert parsed.engine_args == worker.engine_args
    assert parsed.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="engine_arg"):
        WorkerConfig.model_validate({"engine_arg": {"kv_cache_dtype": "auto"}})


def test_engine_args_from_the_environment(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMESH_WORKER_ENGINE_ARGS", '{"enable_chunked_prefil": false}')
    with pytest.raises(ValueError, match="'enable_chunked_prefil'"):
        check_settings(WorkerSettings(model=str(model_dir)))


@pytest.mark.parametrize(("fields", "message"), [
    ({"headless": True}, "--data-parallel-address"),
    ({"headless": True, "engine": "fake", "data_parallel_address": "10.0.0.1"}, "--engine vllm"),
])
def test_a_headless_follower_needs_the_leader_and_the_real_engine(
    model_dir: Path, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_settings(settings(model_dir, **fields))
    check_settings(settings(model_dir, headless=True, data_parallel_size=2, data_parallel_size_local=1,
                            data_parallel_start_rank=1, data_parallel_address="10.0.0.1"))


def test_auto_dtype_keeps_a_float32_checkpoint_in_float32_on_a_cpu(tmp_path: Path) -> None:
    """vLLM's auto would run a float32 checkpoint in bf16 on a CPU; the worker keeps it."""
    from services.common.modelinfo import engine_dtype

    stored = {"float32": tmp_path / "f32", "bfloat16": tmp_path / "bf16"}
    for dtype, directory in stored.items():
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"dtype": dtype}))
    assert engine_dtype("auto", stored["float32"], "cpu") == "float32"
    assert engine_dtype("auto", stored["bfloat16"], "cpu") == "auto"
    assert engine_dtype("auto", stored["float32"], "cuda") == "auto"  # vLLM's choice there
    assert engine_dtype("bfloat16", stored["float32"], "cpu") == "bfloat16"  # asked for
    assert engine_dtype("auto", tmp_path / "missing", "cpu") == "auto"
    assert engine_args(settings(stored["float32"]), "cpu")["dtype"] == "float32"
