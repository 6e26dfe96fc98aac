"""ChatTTS's tokenizer without importing transformers at every start (~0.7 s of a restart).

ChatTTS's ``Tokenizer`` holds transformers' ``BertTokenizerFast``, a wrapper around a
``tokenizers.Tokenizer`` (the Rust backend) that does all the work of the calls ChatTTS makes:
``encode_plus`` of one text without special tokens, ``batch_decode``, ``convert_tokens_to_ids``
and ``len()``. At the first start the tokenizer is built as upstream builds it, through
transformers, and the backend transformers configured (its ``to_str()``: vocabulary, added
tokens, normaliser, pre-tokeniser, decoder) is kept, with the three settings the wrapper adds
around it, in ``<model dir>/.packed/tokenizer-<key>.json``. Later starts read that backend back
with ``tokenizers`` alone and answer the same calls from it: the same backend, so the same ids.

The key names the tokenizer's files (name, size, modification time), the versions of
transformers and tokenizers, and the snapshot's format: a change to any makes another key and
the tokenizer is built through transformers again. A snapshot that cannot be read is rebuilt,
with a warning; a directory that cannot be written leaves every start on the upstream path.
"""

from __future__ import annotations

import json
import logging
from importlib.metadata import version
from pathlib import Path

import torch

from chattts_service.inference import upstream
from chattts_service.runtime.files import identity_key, listing, replace_atomically

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1  # bump when what is stored, or how it is read, changes
# what ChatTTS's Tokenizer.__init__ looks up by name
NAMED_TOKENS = {"spk_emb_ids": "[spk_emb]", "break_0_ids": "[break_0]", "eos_token": "[Ebreak]"}


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``, as ``decode`` applies it to WordPiece text."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


class BackendTokenizer:
    """The calls ChatTTS's ``Tokenizer`` makes of ``BertTokenizerFast``, answered by the backend
    that ``BertTokenizerFast`` built, with the settings it wraps around that backend."""

    def __init__(self, backend, unk_token_id: int, clean_up: bool, clean_up_allowed: bool):
        # what BertTokenizerFast sets before each call ChatTTS makes: no truncation; padding to
        # the longest of one text is none; special tokens in the text stay whole
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False
        self.backend = backend
        self.unk_token_id = unk_token_id
        self.clean_up, self.clean_up_allowed = clean_up, clean_up_allowed

    @classmethod
    def from_snapshot(cls, stored: dict) -> BackendTokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        return cls(
            RustTokenizer.from_str(stored["backend"]),
            int(stored["unk_token_id"]),
            bool(stored["clean_up"]),
            bool(stored["clean_up_allowed"]),
        )

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int:
        index = self.backend.token_to_id(token)
        return self.unk_token_id if index is None else index

    def encode_plus(
        self, text: str, return_tensors: str = "pt", add_special_tokens: bool = True, **options
    ) -> dict:
        """One text (padding it to the longest of one changes nothing)."""
        unknown = set(options) - {"padding"}
        if not isinstance(text, str) or return_tensors != "pt" or unknown:
            raise TypeError("only one text, as torch tensors, is tokenized here")
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return {
            "input_ids": torch.tensor([encoding.ids], dtype=torch.int64),
            "attention_mask": torch.tensor([encoding.attention_mask], dtype=torch.int64),
        }

    def batch_decode(
        self,
        sequences,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        sequences = [[int(i) for i in sequence] for sequence in sequences]
        clean_up = (
            self.clean_up if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        )
        texts = []
        for sequence in sequences:
            text = self.backend.decode(sequence, skip_special_tokens=skip_special_tokens)
            texts.append(_clean_up_spaces(text) if clean_up and self.clean_up_allowed else text)
        return texts


def snapshot(wrapper) -> dict:
    """What a ``BertTokenizerFast`` adds to its backend, with the backend itself."""
    backend = wrapper.backend_tokenizer
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(
        wrapper, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    if getattr(wrapper, "split_special_tokens", False):
        raise ValueError("a tokenizer that splits its special tokens is not kept")
    return {
        "backend": backend.to_str(),
        "unk_token_id": wrapper.unk_token_id,
        "clean_up": bool(wrapper.clean_up_tokenization_spaces),
        "clean_up_allowed": not bpe or bool(forced),
    }


def snapshot_key(tokenizer_dir: Path) -> str:
    return identity_key(
        {
            "snapshot": SNAPSHOT_VERSION,
            "files": listing(tokenizer_dir),
            "transformers": version("transformers"),
            "tokenizers": version("tokenizers"),
        }
    )


def from_backend(backend: BackendTokenizer):
    """ChatTTS's ``Tokenizer`` around ``backend``: what its ``__init__`` sets, looked up in the
    backend instead of in a ``BertTokenizerFast`` it would build."""
    upstream.install()
    from ChatTTS.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.__new__(Tokenizer)
    tokenizer._tokenizer = backend
    tokenizer.len = len(backend)
    for attribute, token in NAMED_TOKENS.items():
        setattr(tokenizer, attribute, backend.convert_tokens_to_ids(token))
    return tokenizer


def load_tokenizer(tokenizer_dir: Path, directory: Path | None):
    """ChatTTS's ``Tokenizer`` for ``tokenizer_dir``: from its snapshot in ``directory`` when
    one is there, else built through transformers (and its snapshot kept there, if given)."""
    path = None
    if directory is not None:
        path = Path(directory) / f"tokenizer-{snapshot_key(tokenizer_dir)}.json"
        kept = _read(path)
        if kept is not None:
            return from_backend(kept)
    upstream.install()
    from ChatTTS.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(tokenizer_dir))
    upstream.quiet_transformers()
    if path is not None:
        _write(path, tokenizer._tokenizer)
    return tokenizer


def _read(path: Path) -> BackendTokenizer | None:
    try:
        return BackendTokenizer.from_snapshot(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 (tokenizers raises its own exception types)
        log.warning("tokenizer snapshot %s is unusable (%s): building it again", path, error)
        return None


def _write(path: Path, wrapper) -> None:
    try:
        stored = snapshot(wrapper)
    except ValueError as error:
        log.info("tokenizer not kept: %s", error)
        return
    try:
        path.parent.mkdir(exist_ok=True)
        replace_atomically(path, lambda out: json.dump(stored, out), binary=False)
    except OSError as error:
        log.warning("cannot keep the tokenizer in %s (%s)", path.parent, error)
        return
    for old in path.parent.glob("tokenizer-*.json"):
        if old != path:
            old.unlink(missing_ok=True)
