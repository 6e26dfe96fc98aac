"""ChatTTS's text normaliser (``ChatTTS.norm.Normalizer``) without Numba.

Four helpers of ``ChatTTS.norm`` are Numba functions: splitting and joining ``[tags]``, and the
homophone replacement, which scans its 16,425-entry table once per character of the text.
Numba costs every start ~0.75 s (its import, then loading the compiled functions from its
cache on the first call) and the scan ~1.5 ms a sentence. Here ``ChatTTS.norm`` is imported with
a stand-in for Numba's ``jit`` that leaves the functions as written, and the module's four names
are then bound to the ports below, which give what the compiled functions give (the tests hold
them to Numba's compilation of upstream's code on random and adversarial texts):

- the replacement works, as upstream's does, on the text's UTF-16 code units, takes the first
  table entry for a unit, and stores the replacement into a 16-bit unit;
- ``_combine_tags`` consumes ``tags`` from the front, as upstream's does to the caller's list.

``Normalizer`` itself (language detection, character maps, invalid characters, the order of the
steps) is upstream's class, unchanged.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from pathlib import Path

import numpy as np

from chattts_service.inference import upstream

NUMBA_FUNCTIONS = ("_find_index", "_fast_replace", "_split_tags", "_combine_tags")
_lock = threading.Lock()
_tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _find_index(table: np.ndarray, val) -> int:
    hits = np.flatnonzero(table == val)
    return int(hits[0]) if hits.size else -1


def _lookup(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The table's sources, sorted, and the replacement of each one's first entry; made once
    per table."""
    found = _tables.get(id(table))
    if found is None or found[0] is not table:
        sources, first = np.unique(table[0], return_index=True)
        found = _tables[id(table)] = (table, sources, table[1][first])
    return found[1], found[2]


def _fast_replace(table: np.ndarray, text: bytes) -> tuple[np.ndarray, list[tuple[str, str]]]:
    result = np.frombuffer(text, dtype=np.uint16).copy()
    sources, targets = _lookup(table)
    if result.size == 0 or sources.size == 0:
        return result, []
    at = np.minimum(np.searchsorted(sources, result), sources.size - 1)
    hit = np.flatnonzero(sources[at] == result)
    replaced_words = []
    if hit.size:
        originals = result[hit]
        replacements = targets[at[hit]]
        result[hit] = replacements.astype(np.uint16)  # stored into 16 bits, as upstream's
        replaced_words = [
            (chr(original), chr(replacement))
            for original, replacement in zip(originals.tolist(), replacements.tolist())
        ]
    return result, replaced_words


def _split_tags(text: str) -> tuple[list[str], list[str]]:
    texts: list[str] = []
    tags: list[str] = []
    current_text = ""
    current_tag = ""
    for c in text:
        if c == "[":
            texts.append(current_text)
            current_text = ""
            current_tag = c
        elif current_tag != "":
            current_tag += c
        else:
            current_text += c
        if c == "]":
            tags.append(current_tag)
            current_tag = ""
    if current_text != "":
        texts.append(current_text)
    return texts, tags


def _combine_tags(texts: list[str], tags: list[str]) -> str:
    text = ""
    for t in texts:
        tg = ""
        if len(tags) > 0:
            tg = tags.pop(0)
        text += t + tg
    return text


PORTS = {
    "_find_index": _find_index,
    "_fast_replace": _fast_replace,
    "_split_tags": _split_tags,
    "_combine_tags": _combine_tags,
}


def _jit_stand_in(*args, **options):
    """``numba.jit`` that compiles nothing: ``@jit(...)`` and ``@jit`` return the function."""
    if len(args) == 1 and callable(args[0]) and not options:
        return args[0]
    return lambda function: function


def norm_module():
    """``ChatTTS.norm`` with its Numba functions bound to the ports (imported once)."""
    with _lock:
        norm = sys.modules.get("ChatTTS.norm")
        if norm is None:
            upstream.install()
            stand_in = types.ModuleType("numba")
            setattr(stand_in, "jit", _jit_stand_in)  # noqa: B010
            norm = upstream.import_standing_in("ChatTTS.norm", "numba", stand_in)
        if getattr(norm, "_chattts_service_ports", False):
            return norm
        for name in NUMBA_FUNCTIONS:
            setattr(norm, name, PORTS[name])
        setattr(norm, "_chattts_service_ports", True)  # noqa: B010
        return norm


def homophones_path() -> Path:
    upstream.install()
    import ChatTTS

    return Path(ChatTTS.__file__).parent / "res" / "homophones_map.json"


def chattts_normaliser():
    """ChatTTS's text normaliser, with its homophone map, as ``Chat`` makes it."""
    norm = norm_module()
    return norm.Normalizer(str(homophones_path()), logging.getLogger("ChatTTS"))
