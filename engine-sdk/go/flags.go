package enginesdk

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

// hostAllow is the repeatable --host-allow flag.
type hostAllow struct{ list *[]HostEndpoint }

func (h hostAllow) String() string {
	if h.list == nil {
		return ""
	}
	parts := make([]string, len(*h.list))
	for i, e := range *h.list {
		parts[i] = e.String()
	}
	return strings.Join(parts, ",")
}

func (h hostAllow) Set(v string) error {
	e, err := ParseHostEndpoint(v)
	if err != nil {
		return err
	}
	*h.list = append(*h.list, e)
	return nil
}

// RegisterFlags defines the shared flags on fs, filling opts (whose values
// are the defaults): the same command line as the Rust SDK's ServeArgs.
func RegisterFlags(fs *flag.FlagSet, opts *Options) {
	fs.StringVar(&opts.Listen, "listen", opts.Listen, "where to listen: HOST:PORT (port 0 picks one) or unix:///PATH")
	fs.StringVar(&opts.StateDir, "state-dir", opts.StateDir, "where the engine keeps its state")
	fs.DurationVar(&opts.Drain, "drain", opts.Drain, "how long in-flight calls may finish after SIGTERM or Ctrl-C")
	fs.Func("drain-seconds", "--drain in seconds (as the Rust SDK spells it)", func(v string) error {
		var secs uint64
		if _, err := fmt.Sscan(v, &secs); err != nil {
			return err
		}
		opts.Drain = time.Duration(secs) * time.Second
		return nil
	})
	fs.IntVar(&opts.MaxConcurrentCalls, "max-concurrent-calls", opts.MaxConcurrentCalls,
		"engine calls served at once; one more is RESOURCE_EXHAUSTED with a retry pushback (GetInfo is never refused)")
	fs.Var(hostAllow{&opts.HostAllow}, "host-allow",
		"a host endpoint this engine may call back (HOST:PORT, http://HOST:PORT, https://HOST:PORT or unix:///PATH), repeatable; none: only the calling peer's address")
	fs.StringVar(&opts.TLSCert, "tls-cert", opts.TLSCert, "serve TLS with this certificate (PEM), with --tls-key; re-read on SIGHUP")
	fs.StringVar(&opts.TLSKey, "tls-key", opts.TLSKey, "the key (PEM) of --tls-cert")
	fs.StringVar(&opts.TLSClientCA, "tls-client-ca", opts.TLSClientCA, "with TLS: serve only clients presenting a certificate this CA (PEM) signed (mTLS)")
	fs.Func("tls-client-name", "with --tls-client-ca: serve only a client whose certificate names NAME (a DNS subjectAltName), such as the gateway's service name; repeatable", func(v string) error {
		if problem := ClientNameProblem(v); problem != "" {
			return errors.New(problem)
		}
		opts.TLSClientNames = append(opts.TLSClientNames, v)
		return nil
	})
	fs.StringVar(&opts.HealthListen, "health-listen", opts.HealthListen, "also serve grpc.health.v1, and nothing else, in plaintext here: a loopback HOST:PORT or unix:///PATH, for a container's own health check when --tls-client-ca serves only the gateway")
	fs.StringVar(&opts.HostCA, "host-ca", opts.HostCA, "the CA (PEM) an https:// host endpoint's certificate must chain to (default: the system roots)")
	fs.StringVar(&opts.OTLPEndpoint, "otlp-endpoint", opts.OTLPEndpoint, "export a span per traced engine method over OTLP/gRPC to this collector (http://HOST:PORT)")
	fs.StringVar(&opts.OTLPServiceName, "otlp-service-name", opts.OTLPServiceName, "the service.name of those spans (default: $OTEL_SERVICE_NAME or ctxgate-engine)")
}

// ParseFlags reads the shared flags (and any the engine defined on
// flag.CommandLine) from the process's arguments.
func ParseFlags() Options {
	opts := DefaultOptions()
	RegisterFlags(flag.CommandLine, &opts)
	flag.Parse()
	return opts
}

// Main runs an engine binary: `health` as the first argument runs the
// health check (see HealthMain); otherwise it parses the shared flags (and
// any the engine defined on flag.CommandLine before), opens the engine,
// serves it, prints exactly one line `listening on ADDR` to stdout when
// ready (logs go to stderr), and drains on SIGTERM or Ctrl-C, exiting 0.
func Main(open func(opts Options) (Engine, error)) {
	if len(os.Args) > 1 && os.Args[1] == "health" {
		os.Exit(HealthMain(os.Args[0], os.Args[2:], os.Stdout, os.Stderr))
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, nil)))
	opts := ParseFlags()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := serveEngine(ctx, open, opts, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[0], err)
		os.Exit(1)
	}
}

// Run opens and serves an engine until ctx ends, then drains; ready gets
// the `listening on ADDR` line.
func Run(ctx context.Context, open func(opts Options) (Engine, error), opts Options, ready io.Writer) error {
	return serveEngine(ctx, open, opts, ready)
}

func serveEngine(ctx context.Context, open func(opts Options) (Engine, error), opts Options, ready io.Writer) error {
	engine, err := open(opts)
	if err != nil {
		return err
	}
	s, err := NewServer(engine, opts)
	if err != nil {
		return err
	}
	// The engine's declaration is checked before anyone is told to call it.
	check, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = info(check, engine)
	cancel()
	if err != nil {
		return fmt.Errorf("GetInfo: %w", errors.New(statusMessage(err)))
	}
	if err := s.Listen(); err != nil {
		return err
	}
	if _, err := fmt.Fprintf(ready, "listening on %s\n", s.Addr()); err != nil {
		return err
	}
	return s.Serve(ctx)
}
