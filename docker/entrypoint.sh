#!/bin/sh
# Run the service pinned to NUMA node 0 (CPUs and memory), as
#   numactl --cpunodebind=0 --membind=0 python server.py
# Binding needs set_mempolicy, which a container only gets with CAP_SYS_NICE (compose adds it);
# without it the service still starts, unpinned, and says so.
set -e
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
