# Shared by the shell tests (sourced; LOG_TAG names the caller in its log lines).

log() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*"; }
fail() { log "FAIL: $*"; exit 1; }
seconds_since() { echo $(( $(date +%s) - $1 )); }

# Let this x86-64 machine run arm64 programs through qemu-user (Debian's qemu-user-static and
# binfmt-support; binfmt_misc mounted where the sandbox has not), or fail saying so.
enable_qemu_aarch64() {
    if ! grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
        for package in qemu-user-static binfmt-support; do
            dpkg -s "$package" >/dev/null 2>&1 && continue
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null
        done
        [ -e /proc/sys/fs/binfmt_misc/register ] \
            || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    fi
    grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || fail "qemu-aarch64 is not registered"
}
