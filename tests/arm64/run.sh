#!/usr/bin/env bash
# arm64 test, run by CI on an x86-64 machine: the aarch64 kernels' tests under qemu for each
# int8 and int4 product qemu can run, and a real server synthesizing over HTTP on them.
#
# An arm64 Debian (trixie, Python 3.13) made by debootstrap runs through qemu-user (binfmt).
# What would be slow under emulation is done natively: pip installs the pinned dependencies'
# aarch64 wheels into a directory for it (torch 2.9.1: PyPI's newer aarch64 builds are CUDA
# builds; the image takes Debian's arm64 torch instead, which tests/container/run.sh with
# CT_ARCH=arm64 covers, too slow for every CI run), and the kernels are cross-compiled with
# Debian's aarch64 g++. Then, for QEMU_CPU=max (DotProd and I8MM) and cortex-a53 (neither):
# tests/test_kernels.py and tests/test_int4.py, and server.py on the tiny random-weight model
# (int8; on max int4 too), asked for speech on /synthesize and /v1/audio/speech, whose
# /status and /metrics must name the product that qemu's CPU should get. Emulation gives no
# timings: nothing here measures speed.
#
# Environment: ARM_WORK (kept between local runs, default /var/tmp/chattts-arm64), ARM_PORT
# (loopback port, default 18290), ARM_CPUS (default "max cortex-a53"). Exits non-zero on failure.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${ARM_WORK:-/var/tmp/chattts-arm64}"
PORT="${ARM_PORT:-18290}"
CPUS="${ARM_CPUS:-max cortex-a53}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
ROOT="$WORK/root"
SITE="$WORK/site"
mkdir -p "$WORK"
LOG_TAG=arm64-test
# shellcheck source=tests/common.sh
. "$REPO/tests/common.sh"
began=$(date +%s)

# -- tools and qemu ---------------------------------------------------------------------------
need_apt=()
for package in debootstrap g++-aarch64-linux-gnu libsimde-dev; do
    dpkg -s "$package" >/dev/null 2>&1 || need_apt+=("$package")
done
if [ "${#need_apt[@]}" -gt 0 ]; then
    log "installing ${need_apt[*]} from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
enable_qemu_aarch64

# -- the arm64 root ---------------------------------------------------------------------------
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    started=$(date +%s)
    log "debootstrap arm64 trixie (its second stage runs under qemu)"
    rm -rf "$ROOT"
    debootstrap --arch arm64 --variant=minbase --include=python3,libgomp1,ca-certificates \
        trixie "$ROOT" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
    log "root ready in $(seconds_since "$started") s"
fi
chroot "$ROOT" /usr/bin/python3 -c 'import platform; assert platform.machine() == "aarch64"' \
    || fail "the root's Python does not run as aarch64"

mounted=()
cleanup() {
    set +e
    [ -z "${SERVER_PID:-}" ] || { kill "$SERVER_PID"; wait "$SERVER_PID"; } 2>/dev/null
    for (( i=${#mounted[@]}-1; i>=0; i-- )); do umount -l "${mounted[$i]}" 2>/dev/null; done
}
trap cleanup EXIT
for target in proc sys dev; do
    mountpoint -q "$ROOT/$target" && continue
    case "$target" in
        proc) mount -t proc proc "$ROOT/proc" ;;
        sys) mount -t sysfs sysfs "$ROOT/sys" ;;
        dev) mount --bind /dev "$ROOT/dev" ;;
    esac
    mounted+=("$ROOT/$target")
done

# -- the dependencies' aarch64 wheels, installed natively -------------------------------------
pins="$WORK/pins.txt"
wanted="$(cat "$REPO/requirements.txt" "$0" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$SITE/.wanted" 2>/dev/null)" != "$wanted" ]; then
    started=$(date +%s)
    log "resolving and installing the aarch64 wheels"
    grep -v -E '^(torch|torchaudio)==' "$REPO/requirements.txt" > "$WORK/rest.txt"
    echo "pytest==$(grep -E '^pytest==' "$REPO/requirements-test.txt" | cut -d= -f3)" >> "$WORK/rest.txt"
    # the versions pip picks with torch 2.9.1 (markers resolved on this host: the CUDA
    # packages torch asks for on x86-64 are left out, as they are on aarch64)
    "$PYTHON" -m pip install -q --dry-run --ignore-installed --report "$WORK/report.json" \
        -r "$WORK/rest.txt" torch==2.9.1 torchaudio==2.9.1 2>/dev/null \
        || fail "resolving the dependencies"
    "$PYTHON" - "$WORK/report.json" "$pins" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
names = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in report["install"]]
keep = [name for name in names if not name.lower().startswith(("nvidia", "triton", "cuda"))]
open(sys.argv[2], "w").write("\n".join(keep) + "\n")
PY
    rm -rf "$SITE" "$WORK/wheels" && mkdir -p "$WORK/wheels"
    install_site() {
        "$PYTHON" -m pip install -q --no-deps --target "$SITE" --find-links "$WORK/wheels" \
            --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 \
            --platform manylinux2014_aarch64 --platform linux_aarch64 --platform any \
            --python-version 3.13 --implementation cp --only-binary=:all: -r "$pins" 2>&1
    }
    # the pure-Python packages published only as source (ChatTTS, encodec) become wheels here
    for _ in 1 2 3 4 5 6; do
        missing=$(install_site | sed -n 's/.*No matching distribution found for //p' || true)
        [ -z "$missing" ] && break
        "$PYTHON" -m pip wheel -q --no-deps "$missing" -w "$WORK/wheels" >/dev/null 2>&1 \
            || fail "no aarch64 wheel of $missing, and it does not build as pure Python"
    done
    [ -z "$missing" ] || fail "still missing: $missing"
    echo "$wanted" > "$SITE/.wanted"
    log "wheels installed in $(seconds_since "$started") s ($(du -sh "$SITE" | cut -f1))"
fi

# -- the checkout and its kernels, cross-compiled ---------------------------------------------
rm -rf "$ROOT/app" && mkdir -p "$ROOT/app"
(cd "$REPO" && git ls-files -z | xargs -0 tar -cf - --no-recursion) | tar -x -C "$ROOT/app"
library=$(cd "$ROOT/app" && CHATTTS_KERNEL_DIR="$ROOT/app/chattts_service/kernels/_build" \
    PYTHONPATH="$ROOT/app" "$PYTHON" -m chattts_service.kernels.build --machine aarch64) \
    || fail "cross-compiling the kernels"
log "kernels cross-compiled: $(basename "$library")"
(cd "$REPO" && "$PYTHON" -m chattts_service.tools.testmodel "$ROOT/model" --size tiny >/dev/null) \
    || fail "building the tiny model"
ENVIRONMENT=(PATH=/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 PYTHONPATH=/opt/site)
inside() {  # inside CPU COMMAND...: a command in the root, on qemu's CPU model CPU
    local cpu="$1"; shift
    chroot "$ROOT" /usr/bin/env -i "${ENVIRONMENT[@]}" QEMU_CPU="$cpu" "$@"
}
mkdir -p "$ROOT/opt/site"
mountpoint -q "$ROOT/opt/site" || { mount --bind "$SITE" "$ROOT/opt/site"; mounted+=("$ROOT/opt/site"); }

# -- for each CPU: the kernel tests, then speech over HTTP ------------------------------------
serve() {  # serve CPU QUANTIZE WANT: a server on qemu's CPU, asked for speech; WANT its product
    local cpu="$1" quantize="$2" want="$3" tag="$1-$2" started
    PORT=$((PORT + 1))  # a port of its own: an earlier server can never answer for this one
    started=$(date +%s)
    log "QEMU_CPU=$cpu: server.py on the tiny model, CHATTTS_QUANTIZE=$quantize"
    # chroot itself in the background (not a function, whose subshell $! would name): the
    # server's PID, which a SIGTERM stops as the container's stop does
    chroot "$ROOT" /usr/bin/env -i "${ENVIRONMENT[@]}" QEMU_CPU="$cpu" sh -c "cd /app && exec env \
        CHATTTS_MODEL_DIR=/model CHATTTS_VERIFY_MODEL=0 CHATTTS_HOST=127.0.0.1 CHATTTS_PORT=$PORT \
        CHATTTS_WYOMING_PORT=0 CHATTTS_CACHE_SIZE=0 CHATTTS_MAX_NEW_TOKENS=24 \
        CHATTTS_QUANTIZE=$quantize python3 server.py" \
        > "$WORK/server-$tag.log" 2>&1 &
    SERVER_PID=$!
    local ready=""
    for _ in $(seq 1 900); do
        if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/readyz")" = 200 ]; then
            ready=yes; break
        fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    [ -n "$ready" ] || { tail -40 "$WORK/server-$tag.log"; fail "the server on $cpu ($quantize) never became ready"; }
    log "QEMU_CPU=$cpu: ready in $(seconds_since "$started") s"
    curl -sf -X POST -H 'Content-Type: application/json' -d '{"text":"你好，arm64。","seed":3}' \
        "http://127.0.0.1:$PORT/synthesize" -o "$WORK/out-$tag.wav" || fail "POST /synthesize on $tag"
    curl -sf -X POST -H 'Content-Type: application/json' \
        -d '{"model":"tts-1","voice":"alloy","input":"Hello from arm64.","response_format":"wav","stream":false}' \
        "http://127.0.0.1:$PORT/v1/audio/speech" -o "$WORK/speech-$tag.wav" \
        || fail "POST /v1/audio/speech on $tag"
    curl -sf "http://127.0.0.1:$PORT/status" -o "$WORK/status-$tag.json" || fail "GET /status"
    curl -sf "http://127.0.0.1:$PORT/metrics" -o "$WORK/metrics-$tag.txt" || fail "GET /metrics"
    "$PYTHON" - "$WORK" "$tag" "$quantize" "$want" <<'PY' || fail "the answers on $tag"
import json, sys, wave
work, tag, quantize, want = sys.argv[1:]
for name in (f"out-{tag}.wav", f"speech-{tag}.wav"):
    with wave.open(f"{work}/{name}") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() > 0, name
status = json.load(open(f"{work}/status-{tag}.json"))
assert status["architecture"] == "aarch64" and status["kernels"] == "on", status
assert status["quantization"] == quantize, status["quantization"]
# int8 multiplies with the product itself; int4 runs on it
linears = "int4" if quantize == "int4" else status["instructions"]
assert status["linears"] == linears, (status["linears"], linears)
assert not want or status["instructions"] == want, (status["instructions"], want)
assert "take no tuning" in status["kernel_tuning"], status["kernel_tuning"]
metrics = open(f"{work}/metrics-{tag}.txt").read()
labels = (f'architecture="aarch64",instructions="{status["instructions"]}",kernels="on",'
          f'linears="{linears}"')
assert f"chatts_kernels_info{{{labels}}} 1.0" in metrics, labels
print(f"speech ok on {tag}: linears {linears} on {status['instructions']}, "
      f"tuning {status['kernel_tuning']}")
PY
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""
    for _ in $(seq 1 60); do
        curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz" || break
        sleep 1
    done
    ! curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz" || fail "the server on $tag did not stop"
    log "QEMU_CPU=$cpu: speech over HTTP, $quantize on $want ($(seconds_since "$started") s)"
}

for cpu in $CPUS; do
    case "$cpu" in
        max) want=i8mm ;;
        cortex-a53) want=neon ;;
        *) want="" ;;
    esac
    started=$(date +%s)
    log "QEMU_CPU=$cpu: tests/test_kernels.py tests/test_int4.py"
    inside "$cpu" sh -c 'cd /app && python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py tests/test_int4.py' \
        > "$WORK/kernels-$cpu.log" 2>&1 \
        || { tail -60 "$WORK/kernels-$cpu.log"; fail "the kernel tests on $cpu"; }
    log "QEMU_CPU=$cpu: $(grep -E '[0-9]+ passed' "$WORK/kernels-$cpu.log" | tail -1) ($(seconds_since "$started") s)"
    grep -E '^SKIPPED' "$WORK/kernels-$cpu.log" | sed 's/^/    /' || true
    serve "$cpu" int8 "$want"
    # the int4 opt-in on the best product (on qemu's max: I8MM); the tests above hold every
    # product's int4 sums to the same reference
    [ "$cpu" != max ] || serve "$cpu" int4 "$want"
done

log "PASS in $(seconds_since "$began") s"
