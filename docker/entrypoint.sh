#!/bin/sh
# Run the service pinned to NUMA node 0 (CPUs and memory), as
#   numactl --cpunodebind=0 --membind=0 python server.py
# Binding needs set_mempolicy, which a container only gets with CAP_SYS_NICE (compose adds it);
# without it the service still starts, unpinned, and says so.
set -e
# ChatTTS's Numba functions as the image compiled them, into an empty NUMBA_CACHE_DIR (the
# compose file's tmpfs): the service then loads them instead of compiling them at start
if [ -n "${NUMBA_CACHE_DIR:-}" ] && [ -d /opt/numba-cache ] \
        && [ -z "$(ls -A "$NUMBA_CACHE_DIR" 2>/dev/null)" ]; then
    mkdir -p "$NUMBA_CACHE_DIR" && cp -R /opt/numba-cache/. "$NUMBA_CACHE_DIR/" \
        || echo "chattts-entrypoint: could not copy the image's Numba cache; compiling at start" >&2
fi
if [ "$#" -eq 0 ]; then
    set -- python server.py
fi
if [ "$1" = "python" ] && [ "$2" = "server.py" ]; then
    if numactl --cpunodebind=0 --membind=0 true 2>/dev/null; then
        exec numactl --cpunodebind=0 --membind=0 "$@"
    fi
    echo "chattts-entrypoint: numactl cannot bind here (no CAP_SYS_NICE?); starting unpinned" >&2
fi
exec "$@"
