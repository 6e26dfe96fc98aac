"""Load ChatTTS's modules from a model directory, lean and in the order that keeps memory low.

``Chat.load`` is not used: its default source runs a downloaded binary, and it loads what the
service never uses (the DVAE encoder, the weight-normalised heads, the transformers GPT once
quantised). The same classes are built here from the model's files, the GPT first: its fp32
weights are memory-mapped, read once into the lean int8 transformer and unmapped before
anything else is loaded. Loaded state dicts are assigned, not copied.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chattts_service.config import Settings, SettingsError
from chattts_service.inference import model_files, upstream
from chattts_service.inference.architecture import config_from_architecture, read_architecture
from chattts_service.inference.chattts_norm import chattts_normaliser
from chattts_service.inference.decoding import AudioDecoder
from chattts_service.inference.download import ensure_model
from chattts_service.inference.generation import Batch, Heads
from chattts_service.inference.gpt_weights import GptWeights
from chattts_service.inference.packed_cache import DIRECTORY as PACKED_DIRECTORY
from chattts_service.inference.packed_cache import PackedCache
from chattts_service.inference.tokenizer import load_tokenizer
from chattts_service.inference.transformer import Transformer
from chattts_service.kernels import tuning
from chattts_service.runtime import heap, pages

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    chat: Any  # ChatTTS's parts (untyped): its normaliser, tokenizer, speaker...
    heads: Heads
    transformer: Transformer
    batch: Batch
    decoder: AudioDecoder
    kv_positions: int  # KV-cache budget in positions
    name: str
    seconds: float
    dvae_file: Path  # the DVAE's encoder (voices from a recording) is built from it

    @property
    def kernels(self) -> str:
        return "on" if self.transformer.kernels is not None else "off"

    @property
    def instructions(self) -> str:
        """The kernels' product (vnni, avx2, i8mm, dotprod, neon), which their int8 and int4
        linears both run on; "none" with the kernels off."""
        kernels = self.transformer.kernels
        return kernels.int8_instructions if kernels is not None else "none"


def load_model(settings: Settings) -> LoadedModel:
    """Verify (unless disabled) and load the model files; raise ModelFilesError when bad.
    Call it on the thread that will run the model."""
    quiet_library_chatter()
    started = time.perf_counter()
    model_dir = Path(settings.model_dir)
    ensure_model(settings)  # present and verified (fetched first where allowed)
    paths = model_files.ModelPaths(model_dir)
    architecture = read_architecture(paths.architecture)

    torch.set_num_threads(settings.torch_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass
    model = _load_modules(settings, paths, architecture)
    model.name = (architecture or {}).get("name", "chattts")
    model.seconds = time.perf_counter() - started
    log.info(
        "model %s loaded from %s in %.2fs (%s GPT linears on %s, %.0f MB; "
        "C++ kernels %s%s; %s KV cache; %s decoder; %d torch threads)",
        model.name,
        model_dir,
        model.seconds,
        settings.quantize,
        model.transformer.linear_kernel,
        model.transformer.linear_bytes / 1e6,
        model.kernels,
        f" ({model.transformer.tuning.describe()})" if model.transformer.tuning else "",
        model.transformer.cache_kind,
        settings.resolved_decoder_dtype,
        settings.torch_threads,
    )
    return model


@dataclass
class ChatParts:
    """The pieces of ChatTTS's ``Chat`` the service uses, built without ``Chat`` (whose import
    brings model code the service never runs; see ``upstream``)."""

    # ChatTTS's own classes, untyped
    config: Any
    normalizer: Any
    tokenizer: Any = None
    speaker: Any = None
    embed: Any = None
    decoder: Any = None
    vocos: Any = None


def _load_modules(settings: Settings, paths: model_files.ModelPaths, architecture) -> LoadedModel:
    upstream.install()
    from ChatTTS.model import Speaker

    config = config_from_architecture(architecture)
    chat = ChatParts(config=config, normalizer=chattts_normaliser())
    transformer = _load_transformer(settings, paths)  # first: its fp32 weights are unmapped after
    chat.embed, heads = _load_embeddings(settings, paths, config, transformer)
    chat.decoder, chat.vocos = _load_audio_modules(paths, config)
    chat.speaker = Speaker(config.gpt.hidden_size, config.spk_stat)
    kept = paths.base / PACKED_DIRECTORY if settings.packed_cache else None
    chat.tokenizer = load_tokenizer(paths.tokenizer, kept)
    if chat.tokenizer.len != config.gpt.num_text_tokens:
        raise model_files.ModelFilesError(
            f"tokenizer in {paths.tokenizer} has {chat.tokenizer.len} tokens, "
            f"the model expects {config.gpt.num_text_tokens}"
        )

    decoder = AudioDecoder(chat.decoder, chat.vocos, settings.resolved_decoder_dtype)
    if decoder.dtype == "fp32" and transformer.kernels is not None:
        decoder.depthwise_on(transformer.kernels)  # torch's float32 bits, no transposes
    if decoder.dtype in ("bf16", "int8"):
        if decoder.dtype == "bf16":
            decoder.hold_in_bf16(transformer.kernels)
        elif transformer.kernels is None:
            raise SettingsError(
                "CHATTTS_DECODER_DTYPE=int8 runs on the C++ kernels, which are off here "
                "(CHATTTS_KERNELS, or a CPU without AVX2): use bf16, fp32 or auto"
            )
        else:
            decoder.hold_in_int8(transformer.kernels)
        for path in (paths.decoder, paths.vocos):  # their fp32 weights, read once to convert
            pages.drop_mapped(path)
    heap.release()  # what loading freed goes back to the OS (nothing is cyclic: no gc pass)
    kv_positions = settings.kv_cache_mb * 2**20 // transformer.bytes_per_position()
    batch = Batch(transformer, heads, settings.max_batch, on_empty=heap.release)
    return LoadedModel(
        chat=chat,
        heads=heads,
        transformer=transformer,
        batch=batch,
        decoder=decoder,
        kv_positions=kv_positions,
        name="chattts",
        seconds=0.0,
        dvae_file=paths.dvae,
    )


def _load_transformer(settings: Settings, paths: model_files.ModelPaths) -> Transformer:
    """The GPT: its packed int8 (or int4) layers mapped from the cache of an earlier start, or
    its memory-mapped fp32 weights read once into the lean transformer, which is then kept in
    the cache for the next start."""
    weights = GptWeights(paths.gpt)
    config, cache = weights.config, None
    if settings.packed_cache and settings.quantize in ("int8", "int4"):
        cache = PackedCache(paths.base, paths.gpt, settings.quantize)

    def build() -> Transformer:
        return Transformer(
            weights,
            settings.quantize,
            settings.kernels,
            settings.int8_product,
            settings.kv_cache_dtype,
            kernel_dir=settings.kernel_dir,
            packed=(lambda kernels: cache.load(kernels, config)) if cache else None,
        )

    transformer = build()
    if cache is not None and not transformer.from_packed_cache:
        saved = cache.save(transformer)
        if saved is not None:
            log.info("packed GPT kept in %s for later starts", saved)
            # and used as every later start uses it: mapped (shared with replicas, in 2 MB
            # pages where the system allows), not this start's private copy
            mapped = build()
            if mapped.from_packed_cache:
                transformer = mapped
    if cache is not None and transformer.from_packed_cache:
        log.info("packed GPT mapped, %.0f%% of it in 2 MB pages", 100 * cache.huge_pages)
    if transformer.kernels is not None:
        transformer.tuning = tuning.choose(
            transformer.kernels,
            transformer.kernel_packings(),
            settings.kernel_tuning,
            cache.directory if cache is not None else None,
        )
    return transformer


def _load_embeddings(settings: Settings, paths, config, transformer: Transformer):
    """ChatTTS's ``Embed`` and the heads folded out of it (weight norm applied once)."""
    from ChatTTS.model import Embed
    from safetensors.torch import load_file as load_safetensors

    embed = Embed(
        config.embed.hidden_size,
        config.embed.num_audio_tokens,
        config.embed.num_text_tokens,
        config.embed.num_vq,
    )
    embed.load_state_dict(load_safetensors(str(paths.embed)), assign=True)
    heads = Heads(
        embed.eval().requires_grad_(False),
        rows=settings.max_batch,
        quantization=settings.quantize,
        kernels=transformer.kernels,
    )
    del embed.head_text, embed.head_code  # folded into Heads
    return embed, heads


def _load_audio_modules(paths, config):
    """ChatTTS's mel decoder (the DVAE's decoder path only) and the Vocos vocoder."""
    from ChatTTS.model import DVAE
    from safetensors.torch import load_file as load_safetensors
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    decoder = DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim)
    decoder.load_state_dict(load_safetensors(str(paths.decoder)), assign=True)
    vocos = Vocos(
        feature_extractor=instantiate_class(args=(), init=asdict(config.vocos.feature_extractor)),
        backbone=instantiate_class(args=(), init=asdict(config.vocos.backbone)),
        head=instantiate_class(args=(), init=asdict(config.vocos.head)),
    )
    vocos.load_state_dict(load_safetensors(str(paths.vocos)), assign=True)
    return decoder.eval().requires_grad_(False), vocos.eval().requires_grad_(False)


def quiet_library_chatter() -> None:
    """No warning about ChatTTS's use of ``past_key_values`` (transformers issues one on every
    forward pass of ChatTTS's GPT); transformers itself is quietened where it is imported."""
    import warnings

    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    upstream.quiet_transformers()
