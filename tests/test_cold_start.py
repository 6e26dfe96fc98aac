"""What makes a start fast, held to what it replaces: the GPT read from its files without
transformers' model classes, the packed int8 layers kept on disk and mapped on later starts,
and ChatTTS imported without the model code the service never runs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from transformers import LlamaModel

from chattts_service.inference.gpt_weights import (
    GptConfig,
    GptFilesError,
    GptWeights,
    rotary_table,
)
from chattts_service.inference.packed_cache import PackedCache
from chattts_service.inference.transformer import Transformer


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, copy, ignore=shutil.ignore_patterns(".packed"))
    return copy


def _outputs(transformer: Transformer) -> list[torch.Tensor]:
    torch.manual_seed(0)
    hidden = transformer.hidden_size
    cache = transformer.new_cache()
    outputs = [transformer.prefill(torch.randn(7, hidden), cache)]
    for index in range(3):
        outputs.append(transformer.step(torch.randn(1, hidden), [cache], [7 + index])[0])
    return outputs


def _same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_rotary_table_is_transformers_to_the_bit(model_dir):
    llama = LlamaModel.from_pretrained(str(model_dir / "asset/gpt"))
    config = GptConfig.read(model_dir / "asset/gpt/config.json")
    positions = torch.arange(config.max_position_embeddings)[None]
    with torch.no_grad():
        cos, sin = llama.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    ours = rotary_table(config)
    assert torch.equal(ours[0], cos[0].float()) and torch.equal(ours[1], sin[0].float())


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_gpt_read_from_its_files_is_the_transformers_model(model_dir, quantization):
    llama = LlamaModel.from_pretrained(str(model_dir / "asset/gpt"))
    from_module = Transformer(llama, quantization)
    from_files = Transformer(GptWeights(model_dir / "asset/gpt"), quantization)
    assert _same(_outputs(from_module), _outputs(from_files))


def test_configs_the_service_cannot_run_are_refused(tmp_path):
    base = {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "max_position_embeddings": 64,
    }
    for extra, words in [
        ({"num_key_value_heads": 1}, "grouped-query"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope"),
        ({"hidden_size": "wide"}, "cannot read"),
    ]:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**base, **extra}))
        with pytest.raises(GptFilesError, match=words):
            GptConfig.read(path)
    path.write_text(json.dumps({**base, "rope_theta": 500.0}))  # the older spelling
    assert GptConfig.read(path).rope_theta == 500.0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_packed_cache_is_written_once_then_mapped(model_dir, quantization):
    gpt = model_dir / "asset/gpt"
    cache = PackedCache(model_dir, gpt, quantization)
    fresh = Transformer(
        GptWeights(gpt),
        quantization,
        "on",
        packed=lambda kernels: cache.load(kernels, GptWeights(gpt).config),
    )
    assert not fresh.from_packed_cache
    path = cache.save(fresh)
    assert path is not None and path.parent == model_dir / ".packed"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    product = "int4" if quantization == "int4" else fresh.kernels.int8_instructions
    assert path.name.startswith(f"gpt-{product}-")  # the CPU's product: vnni or avx2

    def mapped(kind: str) -> Transformer:
        return Transformer(
            GptWeights(gpt),
            kind,
            "on",
            packed=lambda kernels: PackedCache(model_dir, gpt, kind).load(
                kernels, GptWeights(gpt).config
            ),
        )

    again = mapped(quantization)
    assert again.from_packed_cache and again.linear_kernel == fresh.linear_kernel
    assert _same(_outputs(fresh), _outputs(again))  # the same bits as packing afresh
    assert again.linear_bytes == fresh.linear_bytes
    # the other quantization finds no file of its own: it packs, never reads this one
    other = "int8" if quantization == "int4" else "int4"
    assert not mapped(other).from_packed_cache


def test_the_first_start_runs_on_the_packed_file_it_wrote(model_dir):
    """A first start packs the GPT, keeps it, and then maps the kept file as later starts do
    (shared with replicas, no private copy), with the bits of its own packing."""
    from chattts_service.config import Settings
    from chattts_service.inference import loader, model_files

    settings = Settings.from_env({}, model_dir=model_dir, verify_model=False)
    gpt = model_dir / "asset/gpt"
    packed_afresh = Transformer(GptWeights(gpt), "int8", "on")
    first = loader._load_transformer(settings, model_files.ModelPaths(model_dir))
    assert first.from_packed_cache and list((model_dir / ".packed").glob("gpt-*.pt"))
    assert _same(_outputs(packed_afresh), _outputs(first))
    assert loader._load_transformer(settings, model_files.ModelPaths(model_dir)).from_packed_cache


def test_a_stale_or_corrupt_packed_cache_is_rebuilt_never_used(model_dir, caplog):
    gpt = model_dir / "asset/gpt"

    def start() -> Transformer:
        cache = PackedCache(model_dir, gpt)
        config = GptWeights(gpt).config
        transformer = Transformer(
            GptWeights(gpt), "int8", "on", packed=lambda kernels: cache.load(kernels, config)
        )
        if not transformer.from_packed_cache:
            cache.save(transformer)
        return transformer

    reference = _outputs(start())
    (old,) = (model_dir / ".packed").iterdir()

    # corrupt: cut short. A warning, a new packing, the same results
    old.write_bytes(old.read_bytes()[: old.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="chattts_service.inference.packed_cache"):
        rebuilt = start()
    assert not rebuilt.from_packed_cache and "unusable" in caplog.text
    assert _same(reference, _outputs(rebuilt))
    assert start().from_packed_cache  # whole again

    # the model's files changed: another key; the old file goes
    stat = (gpt / "model.safetensors").stat()
    os.utime(gpt / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert not start().from_packed_cache
    files = list((model_dir / ".packed").iterdir())
    assert len(files) == 1 and files[0] != old

    # a file of another model under the right name is refused by its stored key
    other = PackedCache(model_dir, gpt)
    stored = torch.load(files[0], weights_only=True)
    stored["key"] = "another-model"
    torch.save(stored, files[0])
    assert not Transformer(
        GptWeights(gpt),
        "int8",
        "on",
        packed=lambda kernels: other.load(kernels, GptWeights(gpt).config),
    ).from_packed_cache


def test_an_unwritable_packed_cache_leaves_the_start_working(model_dir, caplog):
    gpt = model_dir / "asset/gpt"
    (model_dir / ".packed").write_text("not a directory")  # as a read-only volume would fail
    cache = PackedCache(model_dir, gpt)
    transformer = Transformer(GptWeights(gpt), "int8", "on")
    with caplog.at_level(logging.WARNING, logger="chattts_service.inference.packed_cache"):
        assert cache.save(transformer) is None
    assert "cannot keep" in caplog.text
    assert cache.load(transformer.kernels, GptWeights(gpt).config) is None


def test_chattts_is_imported_without_the_code_the_service_never_runs():
    script = """
import sys
from chattts_service.inference import upstream
assert upstream.install()
from chattts_service.inference.chattts_norm import chattts_normaliser
from ChatTTS.model import DVAE, Embed, Speaker, Tokenizer
chattts_normaliser()("你好 [uv_break] hello-world")
heavy = [m for m in ("torch._dynamo", "einx", "vector_quantize_pytorch", "scipy.optimize",
                     "transformers", "numba", "ChatTTS.core", "ChatTTS.model.gpt")
         if m in sys.modules]
assert heavy == [], heavy
import ChatTTS
from ChatTTS import Chat  # still there, imported when asked for
from ChatTTS.model import GPT
assert "ChatTTS.core" in sys.modules and Chat.__module__ == "ChatTTS.core"
# the DVAE's quantizer (the encoder path) is built when asked for, by the real class
from ChatTTS.config.config import Config
config = Config()
parts = config.dvae
dvae = DVAE(decoder_config=parts.decoder.__dict__, encoder_config=parts.encoder.__dict__,
            vq_config=parts.vq.__dict__, dim=parts.decoder.idim)
assert type(dvae.vq_layer.quantizer).__module__.startswith("vector_quantize_pytorch")
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
