#!/usr/bin/env bash
# The type checker over the interfaces (make lint). mypy cannot follow the editable install's
# mapping of the top-level folders into `sluice`, so it checks a tree of links that has the
# installed layout (sluice/<part> -> <part>/), where every `sluice.*` import resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/sluice"
ln -s "$repo/sluice/__init__.py" "$tree/sluice/__init__.py"
ln -s "$repo/sluice/config" "$tree/sluice/config"
for part in flows tasks driver engines policy storage rl envs sim; do ln -s "$repo/$part" "$tree/sluice/$part"; done
cd "$tree"
"$repo/.venv/bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" "$@"
