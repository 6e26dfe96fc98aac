"""The shapes of a ChatTTS model, as a ChatTTS ``Config``.

The real weights use ChatTTS's default ``Config``. A self-built model may carry an
``architecture.json`` beside ``asset/`` that overrides those shapes; the same loader reads both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURE_FILE_NAME = "architecture.json"

# Keys an architecture file may set, by section; anything else is rejected so a typo is loud.
_SECTIONS = {
    "gpt": {
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "num_text_tokens",
        "max_position_embeddings",
    },
    "embed": {"hidden_size", "num_text_tokens"},
    "decoder": {"idim", "odim", "hidden", "n_layer", "bn_dim"},
    "dvae_encoder": {"idim", "odim", "hidden", "n_layer", "bn_dim"},
    "dvae_decoder": {"idim", "odim", "hidden", "n_layer", "bn_dim"},
    "dvae_vq": {"dim"},
    "vocos_backbone": {"dim", "intermediate_dim", "num_layers"},
    "vocos_head": {"dim"},
}


def config_from_architecture(architecture: dict[str, Any] | None):
    """A fresh ChatTTS ``Config`` with the given overrides.

    ChatTTS's ``Config()`` sub-objects are class-level defaults shared by every instance, so
    every section is rebuilt as a new object rather than mutated in place.
    """
    from chattts_service.inference import upstream

    upstream.install()
    from ChatTTS.config.config import (
        DVAE,
        GPT,
        VQ,
        Backbone,
        BackboneInitArgs,
        Config,
        Decoder,
        Embed,
        FourierHead,
        FourierHeadInitArgs,
        Vocos,
    )

    architecture = dict(architecture or {})
    unknown = set(architecture) - set(_SECTIONS) - {"spk_stat", "name", "seed"}
    if unknown:
        raise ValueError(f"unknown architecture sections: {sorted(unknown)}")
    for name, allowed in _SECTIONS.items():
        extra = set(architecture.get(name, {})) - allowed
        if extra:
            raise ValueError(f"unknown keys in architecture section {name!r}: {sorted(extra)}")

    def section(name: str) -> dict[str, Any]:
        return dict(architecture.get(name, {}))

    config = Config()
    config.gpt = GPT(**section("gpt"))
    config.embed = Embed(**section("embed"))
    config.decoder = Decoder(**section("decoder"))
    default_dvae = DVAE()
    config.dvae = DVAE(
        encoder=Decoder(**{**vars(default_dvae.encoder), **section("dvae_encoder")}),
        decoder=Decoder(**{**vars(default_dvae.decoder), **section("dvae_decoder")}),
        vq=VQ(**{**vars(default_dvae.vq), **section("dvae_vq")}),
    )
    default_vocos = Vocos()
    config.vocos = Vocos(
        feature_extractor=default_vocos.feature_extractor,
        backbone=Backbone(
            init_args=BackboneInitArgs(
                **{**vars(default_vocos.backbone.init_args), **section("vocos_backbone")}
            )
        ),
        head=FourierHead(
            init_args=FourierHeadInitArgs(
                **{**vars(default_vocos.head.init_args), **section("vocos_head")}
            )
        ),
    )
    if "spk_stat" in architecture:
        config.spk_stat = architecture["spk_stat"]
    return config


def read_architecture(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
