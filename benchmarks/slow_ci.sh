#!/usr/bin/env bash
# CI as the slowest CPU this project has had would run it (a 2-core AVX2 Zen 1): a clean
# clone of HEAD runs `make test` with an empty kernel cache,
#   - in a cgroup holding it to CPUS CPUs' worth of time (default 1: 2 cores at half speed),
#   - seeing a /proc/cpuinfo without the AVX-512, AMX and AVX-VNNI flags (the C++ kernels then
#     build and test the generic and AVX2 rungs only, as there),
#   - with torch's own kernels and MKL held to AVX2.
# Prints the wall time; the log is in $WORK/ci.log. Needs root (the cgroup v1 cpu controller
# and a mount namespace). docs/ci.md has its figures.
#   sudo bash benchmarks/slow_ci.sh [CPUS]
set -euo pipefail
CPUS=${1:-1}
REPO=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
WORK=${WORK:-/tmp/splitserve-slow-ci}
rm -rf "$WORK" && mkdir -p "$WORK"
git clone -q "$REPO" "$WORK/clone"
sed -E '/^flags/ s/ (avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni)//g' /proc/cpuinfo > "$WORK/cpuinfo"

[ -w /sys/fs/cgroup/cpu ] || { echo "needs the cgroup v1 cpu controller, writable" >&2; exit 1; }
cg=/sys/fs/cgroup/cpu/splitserve-slow-ci-$$
mkdir "$cg"
awk -v c="$CPUS" 'BEGIN { printf "%d\n", c * 100000 }' > "$cg/cpu.cfs_quota_us"
trap 'rmdir "$cg" 2>/dev/null || true' EXIT

start=$(date +%s)
status=0
unshare -m sh -c "
    echo \$\$ > '$cg/cgroup.procs'
    mount --bind '$WORK/cpuinfo' /proc/cpuinfo
    cd '$WORK/clone'
    exec env SPLITSERVE_CACHE='$WORK/cache' ATEN_CPU_CAPABILITY=avx2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2 make test
" > "$WORK/ci.log" 2>&1 || status=$?
end=$(date +%s)
grep -E "passed|failed" "$WORK/ci.log" || true
echo "make test on $CPUS CPU(s) of time, AVX2 only: $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s, exit $status"
exit "$status"
