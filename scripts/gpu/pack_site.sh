#!/usr/bin/env bash
# The wheels of ../shared/device/make_wheels.sh unpacked into one site dir and xz-compressed (.whl/site.tar.xz):
# 40 MB instead of 61 MB of wheels, so that the tree plus the wheels fit the 64 MiB a device call carries.
# env.sh unpacks it to /tmp/site on the device. Run from the repo root after make_wheels.sh.
set -euo pipefail
tmp=$(mktemp -d)
for f in .whl/*.whl; do unzip -q -o "$f" -d "$tmp/site"; done
tar cf - -C "$tmp/site" . | xz -6 -T2 > "$tmp/site.tar.xz"
rm -f .whl/*.whl && mv "$tmp/site.tar.xz" .whl/ && rm -rf "$tmp"
du -sh .whl
