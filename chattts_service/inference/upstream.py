"""ChatTTS's classes, imported without what the service never runs.

``import ChatTTS`` runs the package's ``__init__``, which imports ``Chat`` and with it every
model class: the GPT (transformers' model code, which brings scipy.optimize) and the DVAE's
quantizer (``vector_quantize_pytorch``, which brings einx and ``torch._dynamo``). On a 2-core
machine that is 2-3 s of every start for code the service never calls: it runs its own
transformer and decodes through the DVAE's decoder path only.

``install()`` puts ChatTTS's two package modules in place as lazy packages (PEP 562): their
submodules import as usual, and what their ``__init__`` would export (read from the installed
``__init__`` files, so another ChatTTS release exports what it exports) is imported on first
use. ``import ChatTTS; ChatTTS.Chat`` still works; it just costs its imports when asked for.
The DVAE module's quantizer class is bound to a deferred constructor that imports
``vector_quantize_pytorch`` when a DVAE with a quantizer (the encoder the service does not use)
is built; the tokenizer module's ``BertTokenizerFast`` to a deferred class that imports
transformers (~0.7 s) when a tokenizer is built through it (see ``tokenizer``: a start that
finds the tokenizer's snapshot never does).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from pathlib import Path

PACKAGES = ("ChatTTS", "ChatTTS.model")
_lock = threading.Lock()


class _LazyPackage(types.ModuleType):
    def __init__(self, spec, exports: dict[str, str]):
        super().__init__(spec.name)
        self.__spec__, self.__loader__ = spec, spec.loader
        self.__file__, self.__package__ = spec.origin, spec.name
        self.__path__ = list(spec.submodule_search_locations)
        self._exports = exports

    def __getattr__(self, attribute: str):
        submodule = self.__dict__.get("_exports", {}).get(attribute)
        if submodule is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attribute!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{submodule}"), attribute)
        setattr(self, attribute, value)
        return value

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._exports))


class _Deferred:
    """A class of another module, imported when first called or asked for an attribute."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def resolve(self):
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return getattr(self.resolve(), attribute)


class _DeferredModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Deferred(self.__name__, name)


def _exports(init_file: str) -> dict[str, str] | None:
    """What a package ``__init__`` exports, if all it does is relative imports."""
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    exports = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                exports[alias.asname or alias.name] = node.module
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            return None  # it does more than import: run it as it is
    return exports


def install() -> bool:
    """Put the lazy packages in place (once); False where ChatTTS is imported already or its
    ``__init__`` files do more than re-export, and the plain import is used."""
    with _lock:
        if "ChatTTS" in sys.modules:
            return isinstance(sys.modules["ChatTTS"], _LazyPackage)
        packages = []
        for name in PACKAGES:
            spec = importlib.util.find_spec(name) if name == "ChatTTS" else _subspec(name)
            exports = _exports(spec.origin) if spec and spec.origin else None
            if exports is None:
                return False
            packages.append(_LazyPackage(spec, exports))
        for package in packages:
            sys.modules[package.__name__] = package
        setattr(sys.modules["ChatTTS"], "model", sys.modules["ChatTTS.model"])  # noqa: B010
        _import_deferring("ChatTTS.model.dvae", "vector_quantize_pytorch")
        _import_deferring("ChatTTS.model.tokenizer", "transformers")
        return True


def _subspec(name: str):
    """A subpackage's spec, found without importing its parent."""
    parent = importlib.util.find_spec(name.rpartition(".")[0])
    locations = parent.submodule_search_locations if parent else None
    return importlib.machinery.PathFinder.find_spec(name, list(locations)) if locations else None


def _import_deferring(module: str, dependency: str) -> None:
    """Import ``module`` with the names it takes from ``dependency`` bound to deferred ones
    (unless ``dependency`` is imported already)."""
    import_standing_in(module, dependency, _DeferredModule(dependency))


def import_standing_in(module: str, dependency: str, stand_in: types.ModuleType):
    """Import ``module`` with ``stand_in`` in the place of ``dependency`` while it imports
    (unless ``dependency`` is imported already: then with the real one); return it."""
    if dependency in sys.modules:
        return importlib.import_module(module)
    sys.modules[dependency] = stand_in
    try:
        return importlib.import_module(module)
    finally:
        del sys.modules[dependency]


def quiet_transformers() -> None:
    """transformers warns on every forward pass about ChatTTS's use of ``past_key_values`` and
    draws progress bars while loading; neither tells an operator anything. Applied where
    transformers has been imported (the service itself imports it only to build a tokenizer
    it has no snapshot of)."""
    if "transformers" not in sys.modules:
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
