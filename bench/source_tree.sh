# Sourced (not run) by bench/gpu_checks.sh and bench/on_host.sh, from the repository's root.
#
# Copies spotguard's folders into the layout the installed package has (setup.py's mapping) under
# a new temporary directory, SPOTGUARD_TREE, and puts it first on PYTHONPATH: the machine's own
# python3 and torch then run this checkout with nothing installed (a lent machine has no project
# venv and cannot reach PyPI). SPOTGUARD_TREE is removed when the sourcing shell exits (an EXIT trap).
SPOTGUARD_TREE="$(mktemp -d)"
trap 'rm -rf "$SPOTGUARD_TREE"' EXIT
mkdir -p "$SPOTGUARD_TREE/spotguard"
cp -r spotguard/. "$SPOTGUARD_TREE/spotguard/"
for part in agent hooks supervisor injector integrations trainer emulator; do
    cp -r "$part" "$SPOTGUARD_TREE/spotguard/$part"
done
export SPOTGUARD_TREE PYTHONPATH="$SPOTGUARD_TREE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
