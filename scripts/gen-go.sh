#!/bin/sh
# Generate the Go stubs for folio.v1 into client/go/gen/ (the import path is the proto's
# go_package, folio/client/go/gen/folio/v1, inside the client/go module).
#
# Needs protoc and the two Go plugins on PATH:
#   protoc-gen-go       (google.golang.org/protobuf/cmd/protoc-gen-go, v1.20 or later:
#                        the .proto uses proto3 `optional`)
#   protoc-gen-go-grpc  (google.golang.org/grpc/cmd/protoc-gen-go-grpc)
# On Debian 12: apt-get install protobuf-compiler protoc-gen-go protoc-gen-go-grpc
# (1.28.1 and 1.0 from grpc-go 1.33.3). Elsewhere:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@latest
#   go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@latest
# or, with buf instead of protoc: `buf generate` at the repository root (buf.gen.yaml).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/client/go}
for tool in protoc protoc-gen-go protoc-gen-go-grpc; do
    command -v "$tool" >/dev/null || { echo "gen-go.sh: $tool is not on PATH" >&2; exit 1; }
done
mkdir -p "$OUT"
cd "$ROOT"
# module=...: paths below OUT follow the import path with the module prefix stripped.
protoc -I . \
    --go_out="$OUT" --go_opt=module=folio/client/go \
    --go-grpc_out="$OUT" --go-grpc_opt=module=folio/client/go \
    protos/folio/v1/generator.proto
echo "gen-go.sh: stubs in $OUT/gen/folio/v1" >&2
