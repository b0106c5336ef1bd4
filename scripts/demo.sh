#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1 and stream one chat answer.
set -euo pipefail
port=${FOLIO_DEMO_PORT:-50051}
prompt=${1:-"What is the capital of France? Answer in one sentence."}
folio serve --host 127.0.0.1 --port "$port" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
echo "folio demo: serving SmolLM2-135M-Instruct (the first start converts its GGUF file)" >&2
folio generate --address "127.0.0.1:$port" --wait-ready 600 --chat --temperature 0 \
    --max-tokens 128 "$prompt"
