#!/usr/bin/env bash
# Multi-node NUMA tests: boots real Linux kernels under QEMU (TCG, no KVM needed) with the
# topologies in guest/topologies/*.topo and runs guest/src/bin/guest_alloc.rs (the allocator as the
# #[global_allocator]; again inside a cgroup with a memory.max where the topology sets
# MEMORY_MAX), guest/src/bin/guest_routes.rs (threads bound to devices on several nodes, where the
# topology sets ROUTES), guest/src/bin/guest_mixed.rs (a client's allocations with glibc and with ours,
# each inside a cgroup whose cpuset confines it to one node, where the topology sets CPUSET_NODE)
# guest/src/bin/guest_shared.rs (a shared pool on each node the topology's SHARED_NODES lists,
# attached by a second process), preload/tests/python/placed.py (Python's bytearrays and numpy
# arrays of PYTHON_MIB sizes, with and without the preload library, where the topology sets
# PYTHON_MIB) and guest/src/bin/guest_check.rs inside each guest.
#
# Usage: scripts/numa-guests.sh [--no-install] [--bless] [TOPOLOGY...]
#   TOPOLOGY      names or prefixes of guest/topologies/*.topo (default: all), e.g. "a" or "c-"
#   --no-install  never call apt-get; fail if something is missing
#   --bless       write each guest's normalised output to guest/expected/ (review the diff!)
# Environment:
#   NUMA_GUESTS_TIMEOUT   seconds one guest may run (default 120)
#   NUMA_GUESTS_KERNEL    vmlinuz to boot (default: installed or cached Debian cloud kernel)
#   NUMA_GUESTS_CACHE     where the downloaded kernel is kept (default /var/cache/numa-guests
#                         when writable, else guest/build/cache)
#   NUMA_GUESTS_ACCEL     QEMU accelerator (default tcg)
#   NUMA_GUESTS_JOBS      guests booted side by side (default: the number of cores)
#
# What it needs (installed with apt-get when missing, Debian 12 or later): qemu-system-x86,
# busybox-static, cpio, numactl, python3-numpy (with Debian's /usr/bin/python3, of which the
# Python guests get the interpreter, the modules placed.py loads and their libraries, in a second
# initramfs archive), and the vmlinuz of linux-image-cloud-amd64, which is fetched
# with `apt-get download` and unpacked into the cache instead of being installed, so the host's
# /boot and initramfs-tools are left alone. Where bookworm's QEMU 7.2 would have apt remove
# something (a qemu-utils from bookworm-backports is installed), bookworm-backports is added to
# /etc/apt/sources.list.d/ and QEMU 10 is taken from there. Logs and the initramfs go to
# guest/build/ (git-ignored): <topology>.log is the guest's serial console.
#
# Exit status: 0 when every guest printed the expected lines; 1 otherwise (a FAIL line, a diff
# against guest/expected/, a crash, or a timeout); 2 for a setup error.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GUEST="$ROOT/guest"
BUILD="$GUEST/build"
TIMEOUT=${NUMA_GUESTS_TIMEOUT:-120}
ACCEL=${NUMA_GUESTS_ACCEL:-tcg}
# The test device: virtio-rng needs no backend and no option ROM, and no driver in the guest
# (sysfs lists every enumerated PCI function). Modern virtio behind a PCIe port: 1af4:1044.
DEVICE_MODEL=virtio-rng-pci
DEVICE_ID=1af4:1044

INSTALL=1
BLESS=0
SELECT=()
for arg in "$@"; do
    case "$arg" in
    --no-install) INSTALL=0 ;;
    --bless) BLESS=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    -*)
        echo "numa-guests: unknown option $arg (try --help)" >&2
        exit 2
        ;;
    *) SELECT+=("$arg") ;;
    esac
done

log() { printf 'numa-guests: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 2
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

START=$(now)
mkdir -p "$BUILD"

# --- 1. Host packages ------------------------------------------------------------------------

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        die "need root (or sudo) to run: $*"
    fi
}

apt_install() { # apt_install [apt-get options] PACKAGE...
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends --no-remove "$@"
}

# Adds bookworm-backports (Debian 12 only) so QEMU can come from there. Needed where a newer
# qemu-utils from backports is already installed: bookworm's QEMU 7.2 conflicts with it.
add_backports() {
    local codename
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [ "$codename" = bookworm ] || return 1
    if ! apt-cache policy 2>/dev/null | grep -q "bookworm-backports"; then
        log "adding bookworm-backports to /etc/apt/sources.list.d/debian-backports.sources"
        as_root tee /etc/apt/sources.list.d/debian-backports.sources >/dev/null <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        as_root apt-get update -q >&2
    fi
}

ensure_packages() {
    local missing=() pkg
    for pkg in qemu-system-x86 busybox-static cpio numactl python3-numpy; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$INSTALL" = 1 ] || die "missing packages: ${missing[*]} (run without --no-install)"
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
    local t0
    t0=$(now)
    log "installing ${missing[*]}"
    # A stale or empty package list makes install fail with "Unable to locate package".
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        as_root apt-get update -q >&2
    fi
    # Dry run first: where the distribution's QEMU would remove something (a newer qemu-utils
    # from backports), take QEMU from backports too instead.
    if apt_install -s "${missing[@]}" >/dev/null 2>&1; then
        apt_install "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
    else
        log "apt-get would have to remove packages; taking QEMU from bookworm-backports"
        add_backports || die "apt-get install ${missing[*]} conflicts with installed packages"
        apt_install -t bookworm-backports "${missing[@]}" >&2 ||
            die "apt-get install -t bookworm-backports ${missing[*]} failed"
    fi
    log "installed in $(elapsed "$t0") s"
}

# Prints the path of the vmlinuz to boot, downloading linux-image-cloud-amd64 when needed.
ensure_kernel() {
    if [ -n "${NUMA_GUESTS_KERNEL:-}" ]; then
        [ -r "$NUMA_GUESTS_KERNEL" ] || die "NUMA_GUESTS_KERNEL=$NUMA_GUESTS_KERNEL is not readable"
        echo "$NUMA_GUESTS_KERNEL"
        return
    fi
    local k cache
    # An installed cloud kernel (apt-get install linux-image-cloud-amd64) is used as it is.
    k=$(ls -1 /boot/vmlinuz-*-cloud-amd64 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$k" ] && [ -r "$k" ]; then
        echo "$k"
        return
    fi
    cache=${NUMA_GUESTS_CACHE:-}
    if [ -z "$cache" ]; then
        cache=/var/cache/numa-guests
        mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || cache="$BUILD/cache"
    fi
    mkdir -p "$cache"
    k=$(ls -1 "$cache"/boot/vmlinuz-*-cloud-amd64 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$k" ]; then
        echo "$k"
        return
    fi
    [ "$INSTALL" = 1 ] || die "no cloud kernel in /boot or $cache (run without --no-install)"
    local t0 pkg deb
    t0=$(now)
    # The metapackage depends on the versioned image package; download that one.
    pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
        awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    if [ -z "$pkg" ]; then
        as_root apt-get update -q >&2
        pkg=$(apt-cache depends linux-image-cloud-amd64 |
            awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    fi
    [ -n "$pkg" ] || die "cannot resolve linux-image-cloud-amd64 to a kernel package"
    log "downloading $pkg into $cache"
    rm -rf "$cache/dl" && mkdir -p "$cache/dl"
    (cd "$cache/dl" && apt-get download -q "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2) ||
        die "apt-get download $pkg failed"
    deb=$(ls -1 "$cache"/dl/*.deb | head -n 1)
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$cache" ./boot
    rm -rf "$cache/dl"
    k=$(ls -1 "$cache"/boot/vmlinuz-*-cloud-amd64 | sort -V | tail -n 1)
    log "kernel $(basename "$k") ready in $(elapsed "$t0") s"
    echo "$k"
}

ensure_packages
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found"
VMLINUZ=$(ensure_kernel)
BUSYBOX=/bin/busybox # from busybox-static; a dynamic busybox works too (its libraries are copied)
[ -x "$BUSYBOX" ] || BUSYBOX=$(command -v busybox) || die "busybox not found (package busybox-static)"
NUMACTL=$(command -v numactl) || die "numactl not found"
# Debian's interpreter, whose numpy is python3-numpy's (another python3 on PATH may lack it).
PYTHON=/usr/bin/python3
PYTHON_PATH=/usr/lib/python3/dist-packages
[ -x "$PYTHON" ] || die "$PYTHON not found (package python3)"

# --- 2. Guest program and initramfs --------------------------------------------------------

T0=$(now)
TARGET_DIR=${CARGO_TARGET_DIR:-target}
[[ "$TARGET_DIR" == /* ]] || TARGET_DIR="$ROOT/$TARGET_DIR"
log "building guest/ (guest_check, guest_alloc, guest_routes, guest_mixed, guest_shared; release)"
# The crate's target folder: the crate itself and its dependencies are built once.
(cd "$ROOT" && cargo build --release --quiet --manifest-path guest/Cargo.toml \
    --target-dir "$TARGET_DIR" --bins) || {
    log "error: cargo build --release of the guest programs failed"
    exit 2
}
GUEST_CHECK="$TARGET_DIR/release/guest_check"
GUEST_ALLOC="$TARGET_DIR/release/guest_alloc"
GUEST_ROUTES="$TARGET_DIR/release/guest_routes"
GUEST_MIXED="$TARGET_DIR/release/guest_mixed"
GUEST_SHARED="$TARGET_DIR/release/guest_shared"
log "building the preload library (release)"
(cd "$ROOT" && cargo build --release --quiet -p numa-gpu-alloc-preload --target-dir "$TARGET_DIR") || {
    log "error: cargo build --release -p numa-gpu-alloc-preload failed"
    exit 2
}
PRELOAD_LIB="$TARGET_DIR/release/libnuma_gpu_alloc_preload.so"
for bin in "$GUEST_CHECK" "$GUEST_ALLOC" "$GUEST_ROUTES" "$GUEST_MIXED" "$GUEST_SHARED" "$PRELOAD_LIB"; do
    [ -x "$bin" ] || die "built binary not found at $bin"
done

RD="$BUILD/rootfs"
rm -rf "$RD"
mkdir -p "$RD"/{bin,sbin,dev,proc,sys,tmp,lib64,lib/x86_64-linux-gnu}
install -m 0755 "$GUEST/init" "$RD/init"
install -m 0755 "$BUSYBOX" "$RD/bin/busybox"
install -m 0755 "$NUMACTL" "$RD/bin/numactl"
install -m 0755 "$GUEST_CHECK" "$RD/guest_check"
install -m 0755 "$GUEST_ALLOC" "$RD/guest_alloc"
install -m 0755 "$GUEST_ROUTES" "$RD/guest_routes"
install -m 0755 "$GUEST_MIXED" "$RD/guest_mixed"
install -m 0755 "$GUEST_SHARED" "$RD/guest_shared"
# Copies the shared libraries of the given programs into the root folder $1 unless the folder
# $2 has them, at the paths the host's loader found them (the guest's /lib is a real directory,
# so /lib/x86_64-linux-gnu/libc.so.6 and /usr/lib/... both work).
copy_libraries() { # copy_libraries ROOT HAVE PROGRAM...
    local root=$1 have=$2 lib
    shift 2
    for bin in "$@"; do
        { ldd "$bin" 2>/dev/null || true; } | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i }'
    done | sort -u | while read -r lib; do
        [ -e "$have$lib" ] && continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
}
copy_libraries "$RD" "$RD" "$BUSYBOX" "$NUMACTL" "$GUEST_CHECK" "$GUEST_ALLOC" "$GUEST_ROUTES" "$GUEST_MIXED" "$GUEST_SHARED"
# The kernel opens /dev/console for init before /init can mount devtmpfs.
if [ "$(id -u)" = 0 ]; then mknod -m 600 "$RD/dev/console" c 5 1; fi
# Writes the gzipped newc archive of folder $1 to $2.
archive() {
    (cd "$1" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet -R 0:0) |
        gzip -1 >"$2"
}
INITRD="$BUILD/initramfs.img"
archive "$RD" "$INITRD"
log "initramfs $(du -h "$INITRD" | cut -f1) ready in $(elapsed "$T0") s; kernel $VMLINUZ"

# The Python guests' initramfs: the one above with a second archive appended (the kernel unpacks
# both), so the other guests boot no bigger. It holds Debian's interpreter, the files placed.py
# loads (listed by guest/python-files.py, which runs it here with the guest's flags), their
# libraries, placed.py and the preload library under its shipped name. Made at the first
# topology that sets PYTHON_MIB.
INITRD_PYTHON=""
python_initrd() {
    [ -z "$INITRD_PYTHON" ] || return 0
    local t0 prd files
    t0=$(now)
    prd="$BUILD/python-rootfs"
    rm -rf "$prd"
    mkdir -p "$prd/usr/bin"
    files=$(cd "$BUILD" && PYTHONPATH=$PYTHON_PATH "$PYTHON" -S -B "$GUEST/python-files.py" \
        "$ROOT/preload/tests/python/placed.py" 0 1) || die "listing the files placed.py needs failed"
    # Modification times kept: the cached bytecode is valid only for its source's.
    while read -r f; do mkdir -p "$prd$(dirname "$f")" && cp -p "$f" "$prd$f"; done <<<"$files"
    ln -s "$(basename "$(readlink -f "$PYTHON")")" "$prd/usr/bin/python3"
    install -m 0644 "$ROOT/preload/tests/python/placed.py" "$prd/placed.py"
    install -m 0755 "$PRELOAD_LIB" "$prd/libnuma_gpu_alloc.so"
    copy_libraries "$prd" "$RD" $(grep -E '\.so$|/bin/' <<<"$files") "$PRELOAD_LIB"
    archive "$prd" "$BUILD/python.img"
    INITRD_PYTHON="$BUILD/initramfs-python.img"
    cat "$INITRD" "$BUILD/python.img" >"$INITRD_PYTHON"
    log "Python archive $(du -h "$BUILD/python.img" | cut -f1) ($(wc -l <<<"$files") files) ready in $(elapsed "$t0") s"
}

# --- 3. Boot each topology ------------------------------------------------------------------

# Reads a .topo file and sets QEMU_ARGS, MEM_TOTAL_M, APPEND. Runs in the caller's shell.
load_topology() {
    local file=$1 name=$2 spec id cpus mem c pair nodes=()
    DESCRIPTION="" SMP="" NODES="" DIST="" DEVICE_NODE="" EXPECT_HOME="" EXPECT_HOST="" MEMORY_MAX=""
    ROUTES="" CPUSET_NODE="" SHARED_NODES="" PYTHON_MIB=""
    # shellcheck source=/dev/null
    . "$file"
    if [ -z "$SMP" ] || [ -z "$NODES" ] || [ -z "$DEVICE_NODE" ]; then
        die "$file: SMP, NODES and DEVICE_NODE are required"
    fi
    QEMU_ARGS=() MEM_TOTAL_M=0
    for spec in $NODES; do
        IFS=: read -r id cpus mem <<<"$spec"
        nodes+=("$id")
        local node_opt="node,nodeid=$id"
        if [ -n "$cpus" ]; then
            for c in ${cpus//+/ }; do node_opt+=",cpus=$c"; done
        fi
        case "$mem" in
        0 | "") ;;
        *M) MEM_TOTAL_M=$((MEM_TOTAL_M + ${mem%M})) ;;
        *G) MEM_TOTAL_M=$((MEM_TOTAL_M + ${mem%G} * 1024)) ;;
        *) die "$file: memory '$mem' must end in M or G" ;;
        esac
        if [ -n "$mem" ] && [ "$mem" != 0 ]; then
            QEMU_ARGS+=(-object "memory-backend-ram,id=m$id,size=$mem")
            node_opt+=",memdev=m$id"
        fi
        QEMU_ARGS+=(-numa "$node_opt")
    done
    for pair in $DIST; do
        local a=${pair%%-*} rest=${pair#*-}
        QEMU_ARGS+=(-numa "dist,src=$a,dst=${rest%%:*},val=${pair##*:}")
    done
    # The device on DEVICE_NODE, then one more on each other node ROUTES names (NODE:HOST pairs),
    # each behind its own expander bus.
    local device_nodes=("$DEVICE_NODE") route i
    for route in $ROUTES; do
        [ "${route%%:*}" = "$DEVICE_NODE" ] || device_nodes+=("${route%%:*}")
    done
    for i in "${!device_nodes[@]}"; do
        QEMU_ARGS+=(
            -device "pxb-pcie,id=pxb$((i + 1)),bus_nr=$((0x80 + 16 * i)),numa_node=${device_nodes[$i]},bus=pcie.0"
            -device "pcie-root-port,id=rp$((i + 1)),bus=pxb$((i + 1)),chassis=$((i + 1))"
            -device "$DEVICE_MODEL,bus=rp$((i + 1))"
        )
    done
    APPEND="console=ttyS0 quiet panic=-1 numa_balancing=disable GUEST_TOPOLOGY=$name"
    APPEND+=" GUEST_DEVICE_ID=$DEVICE_ID GUEST_EXPECT_HOME=$EXPECT_HOME GUEST_EXPECT_HOST=$EXPECT_HOST"
    if [ -n "$MEMORY_MAX" ]; then APPEND+=" GUEST_MEMORY_MAX=$MEMORY_MAX"; fi
    if [ -n "$ROUTES" ]; then APPEND+=" GUEST_ROUTES=${ROUTES// /,}"; fi
    if [ -n "$CPUSET_NODE" ]; then APPEND+=" GUEST_CPUSET_NODE=$CPUSET_NODE"; fi
    if [ -n "$SHARED_NODES" ]; then APPEND+=" GUEST_SHARED_NODES=${SHARED_NODES// /,}"; fi
    if [ -n "$PYTHON_MIB" ]; then APPEND+=" GUEST_PYTHON_MIB=${PYTHON_MIB// /,}"; fi
}

# Turns a serial log into the lines compared with guest/expected/<name>.txt: the topology as
# numactl saw it (sizes reduced to yes/no, free memory dropped), the device's node, every
# PASS/FAIL line, the summary and the exit status. Kernel messages are dropped.
normalise() {
    tr -d '\r' <"$1" | awk '
        /^--- numactl --hardware/ { sec = "numa"; next }
        /^--- end numactl/ { sec = ""; next }
        sec == "numa" && /^available:/ { print; next }
        sec == "numa" && /^node [0-9]+ cpus:/ { sub(/ +$/, ""); print; next }
        sec == "numa" && /^node [0-9]+ size:/ { print $1, $2, "memory:", ($4 > 0 ? "yes" : "no"); next }
        sec == "numa" && /^node distances:/ { dist = 1; print; next }
        sec == "numa" && dist && /^ *(node|[0-9]+:)/ { gsub(/ +/, " "); sub(/^ /, ""); sub(/ $/, ""); print; next }
        sec == "numa" && /^numactl rc=/ { if ($0 != "numactl rc=0") print; next }
        /^device: / { print; next }
        /^(PASS|FAIL) / { print; next }
        /^guest .*: [0-9]+ passed, [0-9]+ failed/ { print; next }
        /^NUMA-GUEST-END / { print; next }
    '
}

mapfile -t TOPOS < <(ls -1 "$GUEST"/topologies/*.topo | sort)
[ ${#TOPOS[@]} -gt 0 ] || die "no topologies in guest/topologies"
if [ ${#SELECT[@]} -gt 0 ]; then
    chosen=()
    for f in "${TOPOS[@]}"; do
        n=$(basename "$f" .topo)
        for s in "${SELECT[@]}"; do
            if [ "$n" = "$s" ] || [[ "$n" == "$s"* ]]; then
                chosen+=("$f")
                break
            fi
        done
    done
    [ ${#chosen[@]} -gt 0 ] || die "no topology matches: ${SELECT[*]}"
    TOPOS=("${chosen[@]}")
fi

# Boots topology file $1 and compares its output; its summary line goes to file $2. Runs in a
# subshell of its own (load_topology sets globals).
boot_guest() {
    local f=$1 summary=$2
    name=$(basename "$f" .topo)
    load_topology "$f" "$name"
    logf="$BUILD/$name.log"
    actual="$BUILD/$name.actual"
    expected="$GUEST/expected/$name.txt"
    initrd=$INITRD
    if [ -n "$PYTHON_MIB" ]; then
        python_initrd
        initrd=$INITRD_PYTHON
    fi
    log "booting $name: $DESCRIPTION (${SMP} vCPUs, ${MEM_TOTAL_M} MiB)"
    t0=$(now)
    retried=""
    for attempt in 1 2; do
        rc=0
        timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 \
            -accel "$ACCEL" -machine q35 -cpu max -m "${MEM_TOTAL_M}M" -smp "$SMP" \
            -nographic -no-reboot -nic none -vga none \
            -kernel "$VMLINUZ" -initrd "$initrd" -append "$APPEND" \
            "${QEMU_ARGS[@]}" </dev/null >"$logf" 2>&1 || rc=$?
        # An emulator that aborts (SIGABRT: a failed assertion in QEMU itself, seen in TCG's
        # iotlb_to_section while SeaBIOS boots) says nothing about the guest: nothing a guest
        # does makes QEMU abort. Boot it once more; a second abort fails the topology.
        [ "$rc" = 134 ] && [ "$attempt" = 1 ] || break
        retried="$(grep -m1 'qemu-system-x86_64: ' "$logf" || echo "qemu aborted")"
        log "$name: qemu aborted ($retried); booting it once more"
    done
    secs=$(elapsed "$t0")
    normalise "$logf" >"$actual"
    line=$(grep -E '^guest .*: [0-9]+ passed, [0-9]+ failed' "$actual" | tail -n 1 || true)
    status=ok
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status="TIMEOUT after ${TIMEOUT} s"
    elif [ "$rc" != 0 ]; then
        status="qemu exited with $rc"
    elif ! grep -q '^NUMA-GUEST-END ' "$actual"; then
        status="no end marker (guest crashed?)"
    elif ! grep -q '^NUMA-GUEST-END .* rc=0$' "$actual"; then
        status="guest_check failed"
    fi
    if [ "$BLESS" = 1 ] && [ "$status" != ok ]; then
        log "not blessing $name: $status"
    elif [ "$BLESS" = 1 ]; then
        cp "$actual" "$expected"
        log "wrote $expected"
    fi
    if [ ! -f "$expected" ]; then
        status="no guest/expected/$name.txt (run with --bless, then review it)"
    elif ! grep -q '^NUMA-GUEST-END ' "$actual"; then
        : # crashed or hung: the log's tail (below) says more than a diff
    elif ! diff -q "$expected" "$actual" >/dev/null; then
        [ "$status" = ok ] && status="output differs from guest/expected/$name.txt"
        echo "--- $name: expected (guest/expected/$name.txt) vs actual (${actual#"$ROOT"/})"
        diff -u "$expected" "$actual" | tail -n +3 || true
    fi
    if [ "$status" != ok ]; then
        echo "--- $name: $status (serial log: ${logf#"$ROOT"/})"
        if ! grep -q '^NUMA-GUEST-END ' "$actual"; then
            echo "--- last lines of ${logf#"$ROOT"/}:"
            tr -d '\r' <"$logf" | sed 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g' | tail -n 40
        fi
    fi
    if [ "$status" = ok ]; then
        printf '%-26s %6s s  ok    %s\n' "$name" "$secs" "$line${retried:+ (booted twice: qemu aborted once)}" >"$summary"
    else
        printf '%-26s %6s s  FAIL  %s\n' "$name" "$secs" "${line:+$line; }$status" >"$summary"
        return 1
    fi
}

# The Python archive is made once, before guests boot side by side.
if grep -q '^PYTHON_MIB=' "${TOPOS[@]}"; then
    python_initrd
fi
# A guest under TCG keeps about one host core busy, whatever its vCPUs: one guest per core at a
# time. Each guest's output is printed whole once every guest ended.
JOBS=${NUMA_GUESTS_JOBS:-$(nproc)}
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "NUMA_GUESTS_JOBS=$JOBS: give a number of guests at a time, 1 or more"
# This run's outputs are named by its process id: a guest left running by an interrupted run
# writes only its own.
RUN=$$
# The guests that run the most (Python's buffers, the cpuset's client) boot first, so that no
# long one is left running alone at the end.
mapfile -t ORDER < <(grep -l -E '^(PYTHON_MIB|CPUSET_NODE)=' "${TOPOS[@]}" || true
    grep -L -E '^(PYTHON_MIB|CPUSET_NODE)=' "${TOPOS[@]}" || true)
[ ${#ORDER[@]} = ${#TOPOS[@]} ] || die "ordering the guests lost some: ${ORDER[*]}"
for f in "${ORDER[@]}"; do
    while (($(jobs -pr | wc -l) >= JOBS)); do
        wait -n || true
    done
    name=$(basename "$f" .topo)
    (boot_guest "$f" "$BUILD/$name.$RUN.summary" >"$BUILD/$name.$RUN.out" 2>&1) &
done
wait
FAILED=0
SUMMARY=()
for f in "${TOPOS[@]}"; do
    name=$(basename "$f" .topo)
    out="$BUILD/$name.$RUN.out" summary="$BUILD/$name.$RUN.summary"
    [ ! -f "$out" ] || cat "$out"
    if [ -s "$summary" ]; then
        SUMMARY+=("$(cat "$summary")")
    else
        SUMMARY+=("$(printf '%-26s %8s  FAIL  %s' "$name" "" "no summary (see above)")")
    fi
    grep -q '  ok  ' "$summary" 2>/dev/null || FAILED=$((FAILED + 1))
    rm -f "$out" "$summary"
done

echo
echo "numa-guests summary (kernel $(basename "$VMLINUZ"), accel $ACCEL):"
printf '  %s\n' "${SUMMARY[@]}"
echo "total $(elapsed "$START") s, ${#TOPOS[@]} guests, $FAILED failed"
[ "$FAILED" = 0 ]
