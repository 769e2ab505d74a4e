#!/usr/bin/env bash
# Run one command against this checkout with a machine's own python3 and torch, nothing installed:
#
#     bash bench/on_host.sh python3 bench/membership_change.py --frameworks fsdp2 --dim 4096 --layers 6 \
#         --step-sleep 0 --steps-between 3
#
# For the lent GPU machines' CPUs (16 cores: a core per rank, where this project's own machines
# have 2): docs/benchmarks.md's row "membership_change on a host with a core per rank" came from this.
# The command runs from the repository's root; its exit status is this script's.
set -u
cd "$(dirname "$0")/.."
source bench/source_tree.sh
"$@"
