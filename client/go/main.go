// folio-generate streams a completion from a Folio server with stubs generated from
// protos/folio/v1/generator.proto (run scripts/gen-go.sh first; see README.md).
//
//	folio-generate [-address 127.0.0.1:50051] [-max-tokens 64] [-temperature T] [-ignore-eos] PROMPT
//
// Text goes to stdout as it arrives (each piece is whole UTF-8 characters); the finish reason
// and token counts go to stderr. Ctrl-C cancels the call, which makes the server abort the
// request and free its KV blocks. A gRPC error prints its status code and message and exits 1.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	foliov1 "folio/client/go/gen/folio/v1"
)

func main() {
	address := flag.String("address", "127.0.0.1:50051", "the Folio server's host:port")
	maxTokens := flag.Uint("max-tokens", 64, "most tokens to generate (0: the rest of the context)")
	temperature := flag.Float64("temperature", -1, "sampling temperature (0: greedy; unset: the server's default)")
	ignoreEOS := flag.Bool("ignore-eos", false, "keep generating past the model's EOS ids")
	waitReady := flag.Duration("wait", 0, "first wait up to this long for the server to be SERVING")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: folio-generate [flags] PROMPT")
		flag.PrintDefaults()
		os.Exit(2)
	}
	os.Exit(run(*address, flag.Arg(0), uint32(*maxTokens), *temperature, *ignoreEOS, *waitReady))
}

func run(address, prompt string, maxTokens uint32, temperature float64, ignoreEOS bool,
	waitReady time.Duration) int {
	// Plain text: put TLS credentials here for a server started with --tls-cert.
	conn, err := grpc.Dial(address, grpc.WithInsecure())
	if err != nil {
		fmt.Fprintf(os.Stderr, "folio: %v\n", err)
		return 1
	}
	defer conn.Close()

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt)
	defer cancel()
	if waitReady > 0 {
		if err := waitServing(ctx, healthpb.NewHealthClient(conn), waitReady); err != nil {
			fmt.Fprintf(os.Stderr, "folio: %v\n", err)
			return 1
		}
	}

	sampling := &foliov1.SamplingParams{MaxTokens: proto.Uint32(maxTokens), IgnoreEos: ignoreEOS}
	if temperature >= 0 {
		sampling.Temperature = proto.Float32(float32(temperature))
	}
	request := &foliov1.GenerateRequest{
		Input:    &foliov1.GenerateRequest_Text{Text: prompt},
		Sampling: sampling,
	}
	stream, err := foliov1.NewGeneratorClient(conn).Generate(ctx, request)
	if err == nil {
		err = printStream(stream)
	}
	if err != nil {
		if status.Code(err) == codes.Canceled {
			return 130
		}
		s := status.Convert(err)
		fmt.Fprintf(os.Stderr, "folio: %s: %s\n", s.Code(), s.Message())
		return 1
	}
	return 0
}

// printStream writes each message's text as it comes and, per sequence, its finish line.
func printStream(stream foliov1.Generator_GenerateClient) error {
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		os.Stdout.WriteString(resp.GetText())
		if resp.GetFinishReason() != foliov1.FinishReason_FINISH_REASON_UNSPECIFIED {
			u := resp.GetUsage()
			fmt.Println()
			fmt.Fprintf(os.Stderr, "[%s] %s: %d prompt + %d completion tokens\n",
				resp.GetRequestId(), resp.GetFinishReason(), u.GetPromptTokens(),
				u.GetCompletionTokens())
		}
	}
}

// waitServing polls the standard health service until the server (service "") is SERVING,
// which Folio reports once an executor has joined.
func waitServing(ctx context.Context, health healthpb.HealthClient, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		callCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err := health.Check(callCtx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("not SERVING after %s (last answer: %v, %v)", timeout,
				resp.GetStatus(), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
