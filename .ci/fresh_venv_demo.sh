#!/usr/bin/env bash
# Runs the README's first command exactly as written, as a new user would:
# in a fresh virtual environment and a fresh clone of this checkout.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
command="$(python3 - "$repo/README.md" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
section = text.split("## Two commands")[1].split("\n## ")[0]
print(re.findall(r"```bash\n(.*?)\n```", section, re.S)[0])
PY
)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work/clone"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
export PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
cd "$work/clone"
echo "fresh venv, fresh clone: $command"
bash -euo pipefail -c "$command"
test -d runs/demo/sigmoid/train
echo "fresh venv: the README's first command ran"
