#!/usr/bin/env bash
# Serve the embedded default model (random weights) on 127.0.0.1 and stream one completion.
set -euo pipefail
port=${FOLIO_DEMO_PORT:-50051}
prompt=${1:-"Tell me a story about a lighthouse keeper."}
folio serve --host 127.0.0.1 --port "$port" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
echo "folio demo: the embedded default model has random weights; its text is meaningless." >&2
folio generate --address "127.0.0.1:$port" --wait-ready 300 --max-tokens 48 "$prompt"
echo
