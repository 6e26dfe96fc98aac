"""Build the decode loop's C++ kernels: an explicit step, never taken by the serving process.

``python -m chattts_service.kernels.build`` compiles ``csrc/kernels.cpp`` (which includes one
file per kernel) into ``CHATTTS_KERNEL_DIR`` (default: ``_build`` beside this file) and prints
the library's path. The image runs it at build time, ``script/setup`` and ``script/test`` run it
for a checkout. The library's file name holds a digest of what it is built from, the sources
and the flags, so a stale library is never loaded (the server finds none and says how to
build it); not of the compiler: a server whose ``CXX`` differs from the build's still finds
the library it was shipped, and the load checks every struct's layout against the bindings.

Plain C++ with OpenMP and no torch headers: a compile takes a few seconds, and the library runs
on torch's own OpenMP runtime (the same ``libgomp.so.1``, already loaded by torch). Built for
x86-64-v3 (AVX2, FMA), the int8 product's AVX512-VNNI variant chosen at run time; or for
aarch64 (Armv8.0 NEON; SIMDe's headers, Debian's ``libsimde-dev``, map the AVX2 intrinsics of
the other kernels to NEON), the int8 product's DotProd and I8MM variants chosen at run time.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = Path(__file__).parent / "csrc"
MAIN_SOURCE = SOURCES / "kernels.cpp"
# what each architecture's build asks of its CPUs at least; the rest is chosen at run time
ARCHITECTURE_FLAGS = {"x86_64": ("-mavx2", "-mfma"), "aarch64": ("-march=armv8-a",)}


def flags_for(machine: str) -> tuple[str, ...]:
    """The compiler's flags for a library that runs on ``machine`` (``platform.machine()``)."""
    return (
        "-O3",
        *ARCHITECTURE_FLAGS.get(machine, ()),
        "-fopenmp",
        "-fno-math-errno",
        "-fassociative-math",
        "-fno-signed-zeros",
        "-fno-trapping-math",
        "-shared",
        "-fPIC",
    )


FLAGS = flags_for(platform.machine())


def kernel_dir(configured: str = "") -> Path:
    """``CHATTTS_KERNEL_DIR`` (the settings' ``kernel_dir``), or ``_build`` beside this file."""
    return Path(configured) if configured else Path(__file__).parent / "_build"


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def library_path(directory: str = "", flags: tuple[str, ...] = FLAGS) -> Path:
    """The library's path, named by what it is built from: every source, and the flags."""
    digest = hashlib.sha256()
    for source in sorted(SOURCES.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(" ".join(flags).encode())
    return kernel_dir(directory) / f"kernels-{digest.hexdigest()[:16]}.so"


def build(
    path: Path | None = None,
    flags: tuple[str, ...] = FLAGS,
    source: Path = MAIN_SOURCE,
    machine: str = "",
) -> Path:
    """Compile the kernels (``source``: their main file, by default this checkout's) into
    ``path``, for ``machine`` (default: this one's; another: a cross build, with its
    ``<machine>-linux-gnu-g++`` unless ``CXX`` says); raise ``RuntimeError`` saying why it
    failed."""
    machine = machine or platform.machine()
    path = path or library_path(flags=flags)
    if machine not in ARCHITECTURE_FLAGS:
        raise RuntimeError(f"no kernels for {machine}: only for x86_64 and aarch64")
    cross = machine != platform.machine()
    chosen = os.environ.get("CXX") or (f"{machine}-linux-gnu-g++" if cross else compiler())
    found = shutil.which(chosen)
    if found is None:
        raise RuntimeError(f"no C++ compiler ({chosen}) to build the kernels")
    path.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent builder never sees half a file
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        result = subprocess.run(
            [found, *flags, str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"building the kernels failed: {result.stderr[-2000:]}")
        os.replace(built, path)
    return path


def main(arguments: list[str] | None = None) -> int:
    import argparse

    from chattts_service.config import Settings, SettingsError

    parser = argparse.ArgumentParser(description="Build the C++ kernels.")
    parser.add_argument(
        "--machine",
        default=platform.machine(),
        help="the architecture the library is for (x86_64, aarch64): another than this "
        "machine's is a cross build (tests/arm64 makes aarch64's on an x86-64 host)",
    )
    options = parser.parse_args(arguments)
    try:
        directory = Settings.from_env().kernel_dir
        flags = flags_for(options.machine)
        path = library_path(directory, flags)
        print(path if path.exists() else build(path, flags, machine=options.machine))
    except (SettingsError, RuntimeError, OSError, subprocess.SubprocessError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
