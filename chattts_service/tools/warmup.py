"""Warm the model: the server runs this before it reports ready; ``warmup.py`` runs it by hand.

Either against a running server (``--url``: waits for readiness, then sends the warm-up texts)
or in-process (``--model-dir``: loads the engine and runs the same texts, timing each stage).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import requests

from chattts_service.inference.engine import WARMUP_TEXTS


def wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = requests.get(url.rstrip("/") + "/readyz", timeout=5)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text.strip()}"
        except requests.RequestException as error:
            last = error.__class__.__name__
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s (last answer: {last})")


def warm_server(url: str, timeout: float = 600.0) -> list[float]:
    wait_ready(url, timeout)
    durations = []
    for seed, text in enumerate(WARMUP_TEXTS):
        started = time.perf_counter()
        response = requests.post(
            url.rstrip("/") + "/synthesize", json={"text": text, "seed": seed}, timeout=timeout
        )
        response.raise_for_status()
        durations.append(time.perf_counter() - started)
    return durations


def warm_in_process(model_dir: Path, verify: bool) -> dict[str, float]:
    from chattts_service.config import Settings
    from chattts_service.inference.engine import Engine

    engine = Engine(Settings.from_env(model_dir=model_dir, verify_model=verify))
    try:
        engine.load()
        warm = engine.warm_up()
        return {"load_seconds": engine.load_seconds or 0.0, "warmup_seconds": warm}
    finally:
        engine.close()  # the model thread stops before the interpreter does


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warmup.py", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8090")
    target.add_argument("--model-dir", type=Path, help="load the engine here instead")
    parser.add_argument("--no-verify", action="store_true", help="skip checksums (test models)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    try:
        if args.url:
            durations = warm_server(args.url, args.timeout)
            print("warmed " + args.url + ": " + ", ".join(f"{d:.2f}s" for d in durations))
        else:
            timings = warm_in_process(args.model_dir, verify=not args.no_verify)
            print(", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    except (TimeoutError, requests.RequestException, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
