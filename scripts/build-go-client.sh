#!/bin/sh
# Build client/go (the Go example) offline with Debian 12's Go toolchain and libraries:
#   apt-get install golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc \
#       golang-google-grpc-dev golang-google-protobuf-dev
# No module proxy is needed: the build runs in GOPATH mode against /usr/share/gocode (Debian's
# Go sources). Usage: scripts/build-go-client.sh [OUTPUT_BINARY] (default client/go/folio-generate).
# With a module proxy, the usual way works too: scripts/gen-go.sh; cd client/go; go mod tidy; go build.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$ROOT/client/go/folio-generate}")
GOPATH_DIR=$(mktemp -d)
trap 'rm -rf "$GOPATH_DIR"' EXIT
# GOPATH mode finds a package by its import path under GOPATH/src.
PKG_DIR="$GOPATH_DIR/src/folio/client/go"
mkdir -p "$PKG_DIR"
cp "$ROOT/client/go/main.go" "$PKG_DIR/"
"$ROOT/scripts/gen-go.sh" "$PKG_DIR"
cd "$PKG_DIR"
GO111MODULE=off GOPROXY=off GOFLAGS= GOPATH="$GOPATH_DIR:/usr/share/gocode" go build -o "$OUT" .
echo "build-go-client.sh: built $OUT" >&2
