module folio/client/go

go 1.19

// The versions built and tested with Debian 12's packages (scripts/build-go-client.sh). With a
// module proxy, `go mod tidy` fills in go.sum (and newer versions work too).
require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
