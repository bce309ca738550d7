#!/usr/bin/env bash
# Runs the mixed-version checks against earlier releases, for a release engineer before a release:
#   scripts/mixed-versions.sh                the releases before each of the last 3 migrations
#   scripts/mixed-versions.sh COMMIT...      those commits
# For each: test/upgrade/rolling-upgrade.check.ts in both orders (the old leader restarted second, and
# last) and test/integration/mixed-versions-replace.test.ts, each old release built from the git
# history with this checkout's node_modules (test/support/old-release.ts). Needs the real servers
# (scripts/infra.sh up) and a build of this checkout (npm run build). About 2.5 minutes a release.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
commits=("$@")
if [[ ${#commits[@]} -eq 0 ]]; then
  # The commit before each of the last 3 commits that added a migration file, oldest first.
  mapfile -t added < <(git log --format=%H --diff-filter=A -- src/store/migrations/ | head -3 | tac)
  for c in "${added[@]}"; do
    parent="$(git rev-parse --verify --quiet "$c~1")" && commits+=("$parent")
  done
fi
failed=()
for commit in "${commits[@]}"; do
  short="$(git rev-parse --short "$commit")"
  for order in leader-second leader-last; do
    echo "== $short: rolling upgrade, $order"
    HELIOS_MIXED_OLD="$commit" HELIOS_MIXED_ORDER="$order" \
      npx --no-install node --import tsx --test test/upgrade/rolling-upgrade.check.ts || failed+=("$short $order")
  done
  echo "== $short: replace statements racing"
  HELIOS_MIXED_OLD="$commit" \
    npx --no-install node --import tsx --test test/integration/mixed-versions-replace.test.ts || failed+=("$short replace")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "every release checked: ${commits[*]}"
