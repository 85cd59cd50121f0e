#!/usr/bin/env bash
# System packages the tests and benchmarks use: fio (the benchmarks' ceiling), PMDK's
# libpmem (the persistent-memory tier) and libaio-dev (deepspeed's DeepNVMe op builds
# against it, for `bench tiers`' DeepNVMe ceiling). The NVMe tier's AIO engine needs none
# of them: it makes the kernel's AIO system calls itself (nvme/libaio.py).
# Installed with apt-get when running as root.
set -euo pipefail
missing=()
command -v fio >/dev/null 2>&1 || missing+=(fio)
ldconfig -p 2>/dev/null | grep -q 'libpmem\.so\.1 ' || missing+=(libpmem1)
[ -e /usr/include/libaio.h ] && ldconfig -p 2>/dev/null | grep -q 'libaio\.so\.1 ' \
    || missing+=(libaio-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} ..." >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
    echo "warning: missing ${missing[*]}; install them (e.g. sudo apt-get install ${missing[*]})" >&2
fi
