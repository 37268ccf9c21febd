package enginesdk

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
)

// HealthMain is `<engine> health --endpoint ADDR [--tls-ca …]`: a
// grpc.health.v1 check of the engine service for container health checks
// in images with no shell. It prints SERVING and answers 0 when the engine
// is SERVING, else says why on stderr and answers 1 (2 for bad flags).
func HealthMain(program string, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(program+" health", flag.ContinueOnError)
	fs.SetOutput(stderr)
	endpoint := fs.String("endpoint", "", "the engine to check: HOST:PORT, https://HOST:PORT (TLS) or unix:///PATH")
	timeout := fs.Float64("timeout-seconds", 3, "how long the check may take")
	ca := fs.String("tls-ca", "", "with https://: the CA (PEM) the engine's certificate chains to (default: the system roots)")
	cert := fs.String("tls-cert", "", "with https://: a client certificate (PEM), for an engine that requires one")
	key := fs.String("tls-key", "", "the key (PEM) of --tls-cert")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := checkHealth(*endpoint, *timeout, *ca, *cert, *key); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", program, err)
		return 1
	}
	fmt.Fprintln(stdout, "SERVING")
	return 0
}

func checkHealth(endpoint string, timeoutSeconds float64, ca, cert, key string) error {
	h, err := ParseHostEndpoint(endpoint)
	if err != nil {
		return err
	}
	creds := insecure.NewCredentials()
	if h.HTTPS {
		identity, err := staticCert(cert, key)
		if err != nil {
			return err
		}
		config, err := ClientTLS("--tls-ca", ca, identity)
		if err != nil {
			return err
		}
		creds = credentials.NewTLS(config(h.Host))
	}
	conn, err := grpc.NewClient(h.Endpoint.target(), grpc.WithTransportCredentials(creds))
	if err != nil {
		return err
	}
	defer conn.Close()
	timeout := time.Duration(min(max(timeoutSeconds, 0.1), 60) * float64(time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: contract.EngineService})
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("the engine at %s did not answer a health check within %s", h, timeout)
	case err != nil:
		return fmt.Errorf("the engine at %s cannot be checked: %s", h, statusMessage(err))
	case r.GetStatus() != healthpb.HealthCheckResponse_SERVING:
		return fmt.Errorf("the engine at %s reports %s", h, r.GetStatus())
	}
	return nil
}

func statusMessage(err error) string { return status.Convert(err).Message() }
