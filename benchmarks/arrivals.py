"""A stream sent just as long documents arrive: its first audio against the same stream alone.

    python benchmarks/arrivals.py [--model-dir DIR] [--rounds 6] [--documents 2] [--json]

Starts ``python server.py`` on a loopback port (cache off) and, each round, sends one short
stream alone, then the same stream (same text and seed: the same work) at the moment
``--documents`` long texts (``bench.py --mix``'s document, whole answers, its sentences
rotated so the server has never read them) are posted, and waits for the documents. A long
text is normalised as it arrives (wetext, in the service's worker process), which is when a
stream sent with it starts. Prints the CPU, the stream's first audio alone and beside the
arrivals (medians, and their ratio), and the documents' wall seconds. Without ``--model-dir``
the full-size random-weight model whose speech ends as a sentence's does
(``models/full-random``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.loadtest import DEFAULT_TEXT  # noqa: E402
from benchmarks.mix import BULK_TEXT  # noqa: E402
from benchmarks.serverproc import Server, model_arguments  # noqa: E402
from chattts_service.domain.text import split_sentences  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402


def first_audio(url: str, seed: int) -> float:
    """A streamed answer's first audio (seconds from sending), read to its end."""
    body = {"text": DEFAULT_TEXT, "seed": seed, "stream": True, "format": "pcm"}
    started = time.perf_counter()
    first = None
    with requests.post(url + "/synthesize", json=body, stream=True, timeout=120) as answer:
        answer.raise_for_status()
        for piece in answer.iter_content(chunk_size=None):
            if piece and first is None:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("a stream without audio")
    return first


def document(turn: int) -> str:
    sentences = split_sentences(BULK_TEXT)
    turn %= len(sentences)
    return "".join(sentences[turn:] + sentences[:turn])


def with_documents(url: str, seed: int, documents: list[str]) -> tuple[float, list[float]]:
    """The stream's first audio, sent as ``documents`` are posted; each document's seconds."""
    walls: list[float] = []
    failures: list[str] = []

    def post(text: str, index: int) -> None:
        started = time.perf_counter()
        body = {"text": text, "seed": 700 + index}
        answer = requests.post(url + "/synthesize", json=body, timeout=300)
        if answer.status_code != 200:
            failures.append(f"{answer.status_code} {answer.text[:200]}")
        walls.append(time.perf_counter() - started)

    threads = [
        threading.Thread(target=post, args=(text, index)) for index, text in enumerate(documents)
    ]
    for thread in threads:
        thread.start()
    first = first_audio(url, seed)
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"a document failed: {failures[0]}")
    return first, walls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1, help="the stream's seed")
    args = model_arguments(parser, rounds=6, endless=False)
    turns = random.Random().randrange(10_000)  # texts this server has not read
    server = Server(args.model_dir, Path("/tmp") / "arrivals-bench.log", CHATTTS_CACHE_SIZE="0")
    alone, beside, walls = [], [], []
    try:
        server.wait_ready()
        first_audio(server.url, args.seed + 1)  # the voice's first request
        for round_ in range(args.rounds):
            alone.append(first_audio(server.url, args.seed))
            count = args.documents
            texts = [document(turns + 7 * (round_ * count + i)) for i in range(count)]
            first, seconds = with_documents(server.url, args.seed, texts)
            beside.append(first)
            walls += seconds
    finally:
        server.stop()
    result = {
        "cpu": cpu_model(),
        "documents": args.documents,
        "first_audio_alone": alone,
        "first_audio_with_documents": beside,
        "first_audio_alone_median": statistics.median(alone),
        "first_audio_with_documents_median": statistics.median(beside),
        "ratio": statistics.median(beside) / statistics.median(alone),
        "document_seconds_median": statistics.median(walls),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"cpu {result['cpu']}")
    print(
        f"stream alone: first audio {result['first_audio_alone_median']:.3f} s; sent as "
        f"{args.documents} long texts arrive: {result['first_audio_with_documents_median']:.3f} "
        f"s ({result['ratio']:.2f}x; medians of {args.rounds}); the texts took "
        f"{result['document_seconds_median']:.1f} s (median)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
