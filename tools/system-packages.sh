#!/usr/bin/env bash
# The Debian packages the tests need beyond what pip installs: the one list, used by `make test`
# (and so by .ci/run).
#   chromium    tests/e2e/test_queue_page.py: Playwright drives Debian's chromium (no browser download)
#   prometheus  ships promtool: tests/e2e/test_observability.py runs the alert rules' unit tests
#   dnsmasq-base  a real DNS server on loopback whose records tests/e2e/test_discovery.py changes
#               (the binary alone: the package dnsmasq would also install a system service)
# What is missing is installed when this may (root, with apt-get); otherwise it stops and names
# the one command to run.
set -euo pipefail
packages=(chromium:chromium promtool:prometheus dnsmasq:dnsmasq-base)  # command:package
missing=()
for entry in "${packages[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "${entry%%:*}" >/dev/null 2>&1 || missing+=("${entry#*:}")
done
((${#missing[@]})) || exit 0
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "installing the Debian packages the tests use: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "The tests need these Debian packages: ${missing[*]}. Install them, then run make test again:" >&2
  echo "  sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
