#!/usr/bin/env bash
# The package alone (`pip install .`, no extras) must serve: install it in a fresh venv, start
# `infer serve` on the embedded model, ask one completion, and check that `infer bench` names its extra.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PLAIN_VENV:-/tmp/infer-plain-venv}"
port="${PLAIN_PORT:-8077}"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0 # the CPU build first, as scripts/setup.sh does
"$venv/bin/python" -m pip install -q .
log="$(mktemp)"
"$venv/bin/infer" serve --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 600); do
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$log"; echo "plain install: the server exited"; exit 1; }
  sleep 1
done
reply="$(curl -sf "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "And the LORD said", "max_tokens": 8, "temperature": 0}')" || { cat "$log"; exit 1; }
echo "$reply" | "$venv/bin/python" -c 'import json, sys; r = json.load(sys.stdin); assert r["usage"]["completion_tokens"] == 8, r'
set +e
message="$("$venv/bin/infer" bench serve 2>&1)"
status=$?
set -e
[ "$status" = 2 ] && grep -q "pip install 'infer\[bench\]'" <<<"$message" ||
  { echo "plain install: infer bench said ($status): $message"; exit 1; }
echo "plain install: served a completion; infer bench names its extra"
