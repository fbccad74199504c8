#!/usr/bin/env bash
# One command: a Debian arm64 userland (debootstrap --arch=arm64, run by qemu-user-static through binfmt_misc)
# in which `pip install .` builds the package with aarch64 gcc, then a fast subset of the suite runs there:
# kernels (every path the CPU offers: qemu's default CPU has NEON and sdot), ops, formats and the store, a
# short end-to-end generation on the bundled model. The whole suite under qemu takes hours: not here.
#
#   sudo .ci/arm64_subset.sh            # root: debootstrap, chroot and binfmt_misc need it
#   ARM64_ROOT=/path/to/rootfs ...      # where the userland lives (kept and reused: the first run builds it)
#   ARM64_TESTS="tests/test_x.py" ...   # another subset
#   ARM64_WHOLE=1 ...                   # the README's install and test commands, verbatim (the whole suite: hours)
#
# Debian packages on the host: debootstrap, qemu-user-static (installed here when apt-get exists).
# See docs/arm.md for what this shows and what it does not.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ROOTFS=${ARM64_ROOT:-/var/tmp/bitnet-arm64-rootfs}
SUITE=${ARM64_SUITE:-bookworm}
MIRROR=${ARM64_MIRROR:-http://deb.debian.org/debian}
TESTS=${ARM64_TESTS:-"tests/test_kernels.py tests/test_kernels_b3.py tests/test_kernel_tg.py tests/test_head_q4.py tests/test_model_ops.py tests/test_layout.py tests/test_store.py tests/test_gguf.py tests/test_generate.py"}
t0=$(date +%s)
say() { echo "[arm64 $(( $(date +%s) - t0 ))s] $*" >&2; }

[ "$(id -u)" -eq 0 ] || { echo "arm64_subset.sh: needs root (debootstrap, chroot, binfmt_misc); hint: run it with sudo" >&2; exit 2; }
if ! command -v debootstrap >/dev/null || ! [ -r /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
  say "installing debootstrap and qemu-user-static"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap qemu-user-static >/dev/null
fi

# binfmt_misc: aarch64 ELF files run through qemu; the F flag opens the interpreter now, so it works inside
# the chroot without a copy there
if ! mountpoint -q /proc/sys/fs/binfmt_misc; then mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; fi
if ! [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  conf=/usr/lib/binfmt.d/qemu-aarch64.conf
  [ -r "$conf" ] || { echo "arm64_subset.sh: $conf missing; hint: apt-get install qemu-user-static" >&2; exit 2; }
  cat "$conf" > /proc/sys/fs/binfmt_misc/register
fi

if ! [ -x "$ROOTFS/usr/bin/python3" ]; then
  say "debootstrap $SUITE arm64 into $ROOTFS (emulated package configuration: several minutes)"
  debootstrap --arch=arm64 --variant=minbase \
    --include=python3,python3-venv,python3-dev,gcc,g++,ca-certificates,git \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.debootstrap.log" 2>&1 \
    || { echo "arm64_subset.sh: debootstrap failed, see $ROOTFS.debootstrap.log" >&2; exit 1; }
fi

mounts=()
cleanup() { for ((i=${#mounts[@]}-1; i>=0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done; }
trap cleanup EXIT
for m in proc sys dev dev/pts; do
  mkdir -p "$ROOTFS/$m"
  if ! mountpoint -q "$ROOTFS/$m"; then mount --bind "/$m" "$ROOTFS/$m"; mounts+=("$ROOTFS/$m"); fi
done
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
# behind a TLS-intercepting proxy the host trusts an extra CA (SSL_CERT_FILE / PIP_CERT): pip in the userland
# needs the same bundle (a public certificate, nothing secret)
CA=${ARM64_CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-}}}
CA_ENV=""
if [ -n "$CA" ] && [ -r "$CA" ]; then
  cp "$CA" "$ROOTFS/etc/ssl/certs/host-ca-bundle.pem"
  CA_ENV="PIP_CERT=/etc/ssl/certs/host-ca-bundle.pem SSL_CERT_FILE=/etc/ssl/certs/host-ca-bundle.pem"
fi

# the working tree as git sees it (tracked and untracked-but-not-ignored files): no host build output
say "copying the source tree"
rm -rf "$ROOTFS/src" && mkdir -p "$ROOTFS/src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf - | tar -C "$ROOTFS/src" -xf -

say "pip install . inside the arm64 userland (gcc runs emulated: minutes)"
chroot "$ROOTFS" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 $CA_ENV /bin/bash -euo pipefail -c '
  cd /src
  [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  /opt/venv/bin/python -m pip install -q --upgrade pip
  # the package and what the subset imports (the full test extra adds ray, playwright, matplotlib: not needed)
  # pytest below 9.2 as the test extra pins it (pyproject.toml: schemathesis needs a pytest attribute 9.2 dropped)
  /opt/venv/bin/python -m pip install -q . "pytest>=8,<9.2" hypothesis pexpect gguf safetensors
  cd /tmp   # the installed package, not the source tree
  /opt/venv/bin/python -c "from bitnet_cpu import simd; print(\"kernel path:\", simd.active(), simd.supported_isas())"
' 2>&1 | tail -20
set +e
if [ "${ARM64_WHOLE:-0}" = 1 ]; then
  # the two commands a user runs, taken from the README rather than retyped here
  TEST_CMD=$(grep -m1 -E '^python -m pip install .*pytest' README.md)
  say "the whole suite: $TEST_CMD"
  chroot "$ROOTFS" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin LANG=C.UTF-8 $CA_ENV /bin/bash -c "
    cd /src && $TEST_CMD"
  rc=$?
  say "done: exit $rc"
  exit "$rc"
fi
say "running: $TESTS"
chroot "$ROOTFS" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin LANG=C.UTF-8 /bin/bash -c "
  cd /src && python -m pytest -q -ra -p no:cacheprovider $TESTS
  rc=\$?
  cd /tmp && bitnet run --prompt 'The capital of France is' -n 8 --seed 1 </dev/null || rc=1
  exit \$rc"
rc=$?
say "done: exit $rc"
exit "$rc"
