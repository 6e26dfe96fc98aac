"""Build a ChatTTS model of the real architecture with random weights, offline.

    python -m chattts_service.tools.testmodel OUT_DIR --size tiny|full [--seed N]

Every module is made by ChatTTS's own classes (Vocos, DVAE, Embed, transformers' LlamaModel) and
saved in the layout ChatTTS expects, so the service loads it through the same code path as the
real weights. ``tiny`` (a few MB, loads in a second) is for tests; ``full`` has the real shapes
and therefore the real compute cost, for benchmarks. The same seed gives byte-identical files.

Random heads almost never choose end-of-speech, so every generation would run to the token cap.
The builder raises the weight-norm gain of the end-of-speech row of each code head so that
generations end after a sentence-like number of steps, as with real weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chattts_service.inference.architecture import ARCHITECTURE_FILE_NAME, config_from_architecture

# ChatTTS's tokenizer: a 21128-entry BERT vocabulary plus these 50 added special tokens.
SPECIAL_TOKENS = (
    [
        "[Sasr]",
        "[Pasr]",
        "[Easr]",
        "[Stts]",
        "[Ptts]",
        "[Etts]",
        "[Sbreak]",
        "[Pbreak]",
        "[Ebreak]",
        "[uv_break]",
        "[v_break]",
        "[lbreak]",
        "[llbreak]",
        "[undefine]",
        "[laugh]",
        "[spk_emb]",
        "[empty_spk]",
        "[music]",
        "[pure]",
    ]
    + [f"[break_{i}]" for i in range(8)]
    + [f"[laugh_{i}]" for i in range(3)]
    + [f"[oral_{i}]" for i in range(10)]
    + [f"[speed_{i}]" for i in range(10)]
)
BASE_VOCAB_SIZE = 21128
NUM_TEXT_TOKENS = BASE_VOCAB_SIZE + len(SPECIAL_TOKENS)
END_OF_SPEECH = 625  # the last of the 626 audio tokens

TINY = {
    "name": "tiny-random",
    "gpt": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "num_text_tokens": NUM_TEXT_TOKENS,
    },
    "embed": {"hidden_size": 32, "num_text_tokens": NUM_TEXT_TOKENS},
    # The decoder reads GPT hidden states folded in two: idim = hidden / 2.
    "decoder": {"idim": 16, "odim": 16, "hidden": 32, "n_layer": 1, "bn_dim": 16},
    # DVAE: decoder idim/odim = vq dim / 2; the encoder maps dim -> vq dim.
    "dvae_encoder": {"idim": 32, "odim": 64, "hidden": 16, "n_layer": 1, "bn_dim": 16},
    "dvae_decoder": {"idim": 32, "odim": 32, "hidden": 16, "n_layer": 1, "bn_dim": 16},
    "dvae_vq": {"dim": 64},
    "vocos_backbone": {"dim": 32, "intermediate_dim": 64, "num_layers": 1},
    "vocos_head": {"dim": 32},
}
FULL = {"name": "full-random"}  # ChatTTS's default shapes are the real ones

SIZES: dict[str, dict[str, Any]] = {"tiny": TINY, "full": FULL}
# Gain applied to the end-of-speech row of each code head (measured to give sentence-like
# lengths: a few seconds of audio for a short sentence).
EOS_GAIN = {"tiny": 1.3, "full": 1.2}
LAYER_SCALE = 0.25  # ConvNeXt layer scale, the order of a trained vocoder's


def _base_vocabulary() -> list[str]:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ascii_chars = [chr(c) for c in range(33, 127)]
    vocab += ascii_chars
    vocab += ["##" + c for c in ascii_chars if c.isalnum()]
    vocab += list("，。、！？：；“”‘’（）《》—…")
    for code_point in range(0x4E00, 0xA000):
        if len(vocab) >= BASE_VOCAB_SIZE:
            break
        vocab.append(chr(code_point))
    assert len(vocab) == BASE_VOCAB_SIZE, len(vocab)
    return vocab


def build_tokenizer(out_dir: Path) -> int:
    """Write a BERT-style tokenizer with ChatTTS's special tokens; return its length."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]  # a lazy export

    vocabulary = {token: index for index, token in enumerate(_base_vocabulary())}
    backend = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = BertTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        do_lower_case=True,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    special_map = out_dir / "special_tokens_map.json"
    if not special_map.exists():  # transformers 5 no longer writes it; ChatTTS's layout has it
        special_map.write_text(
            json.dumps(
                {
                    "additional_special_tokens": SPECIAL_TOKENS,
                    "cls_token": "[CLS]",
                    "mask_token": "[MASK]",
                    "pad_token": "[PAD]",
                    "sep_token": "[SEP]",
                    "unk_token": "[UNK]",
                },
                ensure_ascii=False,
                indent=2,
            ),
            encoding="utf-8",
        )
    for extra in ("vocab.txt", "chat_template.jinja"):
        (out_dir / extra).unlink(missing_ok=True)
    return len(tokenizer)


def _speaker_statistics(hidden_size: int, seed: int) -> str:
    import numpy as np
    import pybase16384 as b14

    rng = np.random.default_rng(seed)
    std = rng.uniform(0.5, 1.5, hidden_size)
    mean = rng.normal(0.0, 0.5, hidden_size)
    return b14.encode_to_string(np.concatenate([std, mean]).astype(np.float16).tobytes())


def _set_layer_scales(module) -> None:
    """Give the ConvNeXt blocks of the decoder and vocoder a trained network's layer scale.

    Freshly initialised blocks scale their residual branch by 1e-6, which makes them all but
    pass-through: the decoders would then look at a few frames around each output sample
    instead of their full receptive field, and anything that depends on that context (the
    overlap of streamed chunks) could not be tested on a random model."""
    from ChatTTS.model.dvae import ConvNeXtBlock as DecoderBlock
    from vocos.modules import ConvNeXtBlock as VocoderBlock

    for block in module.modules():
        if isinstance(block, DecoderBlock) and block.weight is not None:
            block.weight.fill_(LAYER_SCALE)
        elif isinstance(block, VocoderBlock) and block.gamma is not None:
            block.gamma.fill_(LAYER_SCALE)


def _save(module, path: Path) -> None:
    from safetensors.torch import save_file

    state = {
        name: tensor.detach().contiguous().clone() for name, tensor in module.state_dict().items()
    }
    save_file(state, str(path), metadata={"format": "pt"})


# Long: it writes ChatTTS's model layout file by file, in one readable sequence.
def build(out_dir: Path, size: str = "tiny", seed: int = 0, speech_ends: bool = True) -> Path:
    """Write a random-weight model to ``out_dir`` and return it. Without ``speech_ends`` the
    end-of-speech code never wins (its logit is 0 among hundreds of positive ones): every
    request runs to its step cap, as capacity measurements over HTTP need."""
    import torch
    from ChatTTS.model.dvae import DVAE
    from ChatTTS.model.embed import Embed
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}")
    architecture = dict(SIZES[size])
    if size == "tiny":
        architecture["spk_stat"] = _speaker_statistics(architecture["gpt"]["hidden_size"], seed)
    config = config_from_architecture(architecture)

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    asset = staging / "asset"
    (asset / "gpt").mkdir(parents=True)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        vocos = Vocos(
            feature_extractor=instantiate_class(
                args=(), init=asdict(config.vocos.feature_extractor)
            ),
            backbone=instantiate_class(args=(), init=asdict(config.vocos.backbone)),
            head=instantiate_class(args=(), init=asdict(config.vocos.head)),
        )
        _set_layer_scales(vocos)
        _save(vocos, asset / "Vocos.safetensors")
        del vocos

        dvae = DVAE(
            decoder_config=asdict(config.dvae.decoder),
            encoder_config=asdict(config.dvae.encoder),
            vq_config=asdict(config.dvae.vq),
            dim=config.dvae.decoder.idim,
        )
        _save(dvae, asset / "DVAE.safetensors")
        del dvae

        decoder = DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim)
        _set_layer_scales(decoder)
        _save(decoder, asset / "Decoder.safetensors")
        del decoder

        embed = Embed(
            config.embed.hidden_size,
            config.embed.num_audio_tokens,
            config.embed.num_text_tokens,
            config.embed.num_vq,
        )
        for head in embed.head_code:
            gain = EOS_GAIN[size] if speech_ends else 0.0
            head.parametrizations.weight.original0[END_OF_SPEECH] *= gain
        _save(embed, asset / "Embed.safetensors")
        del embed

        gpt_fields = asdict(config.gpt)
        llama_config = LlamaConfig(
            hidden_size=gpt_fields["hidden_size"],
            intermediate_size=gpt_fields["intermediate_size"],
            num_attention_heads=gpt_fields["num_attention_heads"],
            num_key_value_heads=gpt_fields["num_attention_heads"],
            num_hidden_layers=gpt_fields["num_hidden_layers"],
            max_position_embeddings=gpt_fields["max_position_embeddings"],
            # ChatTTS deletes the token embedding after loading and feeds its own embeddings.
            vocab_size=1,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        gpt = LlamaModel(llama_config)
        gpt.save_pretrained(str(asset / "gpt"), safe_serialization=True)
        del gpt

    token_count = build_tokenizer(asset / "tokenizer")
    if token_count != config.gpt.num_text_tokens:
        raise RuntimeError(
            f"tokenizer has {token_count} tokens, GPT expects {config.gpt.num_text_tokens}"
        )
    (staging / ARCHITECTURE_FILE_NAME).write_text(
        json.dumps({**architecture, "seed": seed}, ensure_ascii=False, indent=1, sort_keys=True),
        encoding="utf-8",
    )
    # safetensors writes 0600 files; a container's non-root user must be able to read them
    for path in staging.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chattts_service.tools.testmodel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--endless", action="store_true", help="speech never ends before the step cap"
    )
    args = parser.parse_args(argv)
    path = build(args.out_dir, args.size, args.seed, speech_ends=not args.endless)
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"wrote {args.size} random-weight model to {path} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
