package enginesdk

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// DefaultMaxConcurrentCalls is the default cap on engine calls in flight.
const DefaultMaxConcurrentCalls = 1024

// Options are the settings every engine binary shares: the Rust SDK's
// ServeArgs, as flags (see ParseFlags).
type Options struct {
	// Listen is HOST:PORT (port 0 picks one) or unix:///PATH (the socket
	// file is created mode 0600).
	Listen string
	// StateDir is where the engine keeps its state (the engine's to use).
	StateDir string
	// Drain is how long in-flight calls may finish after SIGTERM or Ctrl-C.
	Drain time.Duration
	// MaxConcurrentCalls is how many engine calls are served at once; one
	// more is RESOURCE_EXHAUSTED with a retry pushback. GetInfo is never
	// refused.
	MaxConcurrentCalls int
	// HostAllow lists the host endpoints this engine may call back; none:
	// only the address of the peer that made the call.
	HostAllow []HostEndpoint
	// TLSCert and TLSKey serve TLS; TLSClientCA then requires client
	// certificates it signed (mTLS). Re-read on SIGHUP.
	TLSCert, TLSKey, TLSClientCA string
	// TLSClientNames, with TLSClientCA: a client's certificate must name one
	// of them (a DNS subjectAltName), or its handshake fails.
	TLSClientNames []string
	// HealthListen also serves grpc.health.v1, and nothing else, in
	// plaintext: a loopback HOST:PORT or unix:///PATH (a container's own
	// health check when TLSClientCA serves only the gateway).
	HealthListen string
	// HostCA is what https:// host endpoints' certificates must chain to
	// (default: the system roots); callbacks present TLSCert when given.
	HostCA string
	// OTLPEndpoint, when set, receives a span per traced engine method
	// (OTLP/gRPC, http://HOST:PORT) as OTLPServiceName.
	OTLPEndpoint, OTLPServiceName string
}

// DefaultOptions are the flags' defaults.
func DefaultOptions() Options {
	service := os.Getenv("OTEL_SERVICE_NAME")
	if service == "" {
		service = "ctxgate-engine"
	}
	return Options{
		Listen: "127.0.0.1:0", Drain: 10 * time.Second, MaxConcurrentCalls: DefaultMaxConcurrentCalls,
		OTLPServiceName: service,
	}
}

// Server serves one engine: the engine service (validated, bounded,
// isolated calls), grpc.health.v1 and reflection.
type Server struct {
	engine    Engine
	opts      Options
	grpc      *grpc.Server
	health    *health.Server
	healthSvc *healthService
	service   *service
	tls       *LiveTLS
	spans     *Exporter
	listener  net.Listener
	addr      Endpoint
	hangup    chan os.Signal
	// HealthListen: health alone, in plaintext.
	healthOnly     *grpc.Server
	healthListener net.Listener
	healthAddr     Endpoint
}

// NewServer builds a server for engine with opts (Listen is used by
// Listen). TLS files are read now: a mistake is a sentence naming its flag.
func NewServer(engine Engine, opts Options) (*Server, error) {
	if opts.MaxConcurrentCalls < 1 {
		opts.MaxConcurrentCalls = 1
	}
	s := &Server{engine: engine, opts: opts, health: health.NewServer()}
	if (opts.TLSCert == "") != (opts.TLSKey == "") {
		return nil, errors.New("--tls-cert and --tls-key go together")
	}
	if opts.TLSClientCA != "" && opts.TLSCert == "" {
		return nil, errors.New("--tls-client-ca needs --tls-cert and --tls-key")
	}
	if len(opts.TLSClientNames) > 0 && opts.TLSClientCA == "" {
		return nil, errors.New("--tls-client-name needs --tls-client-ca")
	}
	for _, n := range opts.TLSClientNames {
		if problem := ClientNameProblem(n); problem != "" {
			return nil, errors.New(problem)
		}
	}
	serverOpts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(contract.MaxGRPCMessageBytes), grpc.MaxSendMsgSize(contract.MaxGRPCMessageBytes),
		// Stop (a drain that timed out) returns once every handler has:
		// they end at once then, their contexts cancelled.
		grpc.WaitForHandlers(true),
	}
	if opts.TLSCert != "" {
		live, err := NewLiveTLS(TLSFiles{Cert: opts.TLSCert, Key: opts.TLSKey, ClientCA: opts.TLSClientCA, ClientNames: opts.TLSClientNames})
		if err != nil {
			return nil, err
		}
		s.tls = live
		serverOpts = append(serverOpts, grpc.Creds(credentials.NewTLS(live.Config())))
	}
	var ownCert func() *tls.Certificate
	if s.tls != nil {
		ownCert = s.tls.Certificate
	}
	hostTLS, err := ClientTLS("--host-ca", opts.HostCA, ownCert)
	if err != nil {
		return nil, err
	}
	if opts.OTLPEndpoint != "" {
		x, err := StartExporter(opts.OTLPEndpoint, opts.OTLPServiceName)
		if err != nil {
			return nil, fmt.Errorf("--otlp-endpoint: %w", err)
		}
		s.spans = x
	}
	s.service = &service{
		engine:   engine,
		hosts:    &hostConns{policy: HostPolicy{Allow: opts.HostAllow}, tls: hostTLS},
		slots:    make(chan struct{}, opts.MaxConcurrentCalls),
		maxCalls: opts.MaxConcurrentCalls,
		spans:    s.spans,
		inflight: &calls{},
	}
	s.grpc = grpc.NewServer(serverOpts...)
	pb.RegisterContextEngineServer(s.grpc, s.service)
	s.healthSvc = &healthService{Server: s.health, ended: make(chan struct{})}
	healthpb.RegisterHealthServer(s.grpc, s.healthSvc)
	reflection.Register(s.grpc)
	if opts.HealthListen != "" {
		if s.healthAddr, err = healthEndpoint(opts.HealthListen); err != nil {
			return nil, err
		}
		s.healthOnly = grpc.NewServer()
		healthpb.RegisterHealthServer(s.healthOnly, s.healthSvc)
	}
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	s.health.SetServingStatus(contract.EngineService, healthpb.HealthCheckResponse_SERVING)
	return s, nil
}

// Health is the health server: an engine can report NOT_SERVING itself (a
// lost backend, say) and SERVING again; the server also flips it on drain.
func (s *Server) Health() *health.Server { return s.health }

// Listen binds opts.Listen (a stale unix socket file is replaced) and, with
// TLS, starts listening for SIGHUP (before `listening on` is printed, so an
// early SIGHUP never kills a TLS engine).
func (s *Server) Listen() error {
	e, err := ParseEndpoint(s.opts.Listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	if e.Unix != "" {
		if s.tls != nil {
			return errors.New("TLS is served over TCP only: --listen HOST:PORT with --tls-cert")
		}
		if s.listener, err = listenUnix(e.Unix); err != nil {
			return err
		}
		s.addr = e
	} else {
		l, err := net.Listen("tcp", e.String())
		if err != nil {
			return err
		}
		s.listener, s.addr = l, Endpoint{Addr: l.Addr().(*net.TCPAddr)}
	}
	if s.healthOnly != nil {
		if s.healthListener, s.healthAddr, err = listenHealth(s.healthAddr); err != nil {
			_ = s.listener.Close()
			s.listener = nil
			return err
		}
	}
	if s.tls != nil {
		s.hangup = make(chan os.Signal, 1)
		signal.Notify(s.hangup, syscall.SIGHUP)
	}
	return nil
}

// healthEndpoint reads --health-listen: only this machine may reach it,
// since nothing there is authenticated.
func healthEndpoint(at string) (Endpoint, error) {
	e, err := ParseEndpoint(at)
	if err != nil {
		return Endpoint{}, fmt.Errorf("--health-listen: %w", err)
	}
	if e.Unix == "" && (e.Addr == nil || !e.Addr.IP.IsLoopback()) {
		return Endpoint{}, fmt.Errorf("--health-listen %s: health is served there without TLS or authentication, so only on a loopback address or a unix socket", at)
	}
	return e, nil
}

// listenHealth binds the health endpoint (port 0 resolved).
func listenHealth(e Endpoint) (net.Listener, Endpoint, error) {
	if e.Unix != "" {
		l, err := listenUnix(e.Unix)
		return l, e, err
	}
	l, err := net.Listen("tcp", e.String())
	if err != nil {
		return nil, Endpoint{}, err
	}
	return l, Endpoint{Addr: l.Addr().(*net.TCPAddr)}, nil
}

// HealthAddr is where HealthListen serves health alone (port 0 resolved),
// empty without it.
func (s *Server) HealthAddr() string {
	if s.healthListener == nil {
		return ""
	}
	return s.healthAddr.String()
}

// listenUnix binds a unix socket readable and writable by its owner only:
// the umask is narrowed while it is created, so it is never more open.
func listenUnix(path string) (net.Listener, error) {
	if _, err := os.Lstat(path); err == nil {
		if err := os.Remove(path); err != nil {
			return nil, err
		}
	}
	old := syscall.Umask(0o177)
	l, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return nil, err
	}
	l.(*net.UnixListener).SetUnlinkOnClose(true)
	return l, nil
}

// Addr is the address bound (port 0 resolved): HOST:PORT or unix:///PATH.
func (s *Server) Addr() string { return s.addr.String() }

// Serve serves until ctx ends, then drains: health goes NOT_SERVING, new
// calls are refused (UNAVAILABLE), in-flight calls get opts.Drain to
// finish, then the server stops. With TLS, SIGHUP re-reads the certificate
// files meanwhile.
func (s *Server) Serve(ctx context.Context) error {
	if s.listener == nil {
		if err := s.Listen(); err != nil {
			return err
		}
	}
	defer s.spans.Close()
	defer s.service.hosts.close()
	if s.hangup != nil {
		defer signal.Stop(s.hangup)
		go s.reloadOnHangup(ctx)
	}
	if s.healthOnly != nil {
		// Health alone reads NOT_SERVING through the drain, until Serve returns.
		go func() { _ = s.healthOnly.Serve(s.healthListener) }()
		defer s.healthOnly.Stop()
	}
	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(s.listener) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	slog.Info("shutdown requested, draining")
	deadline := time.After(s.opts.Drain)
	// New calls are refused before health says NOT_SERVING: whoever sees
	// it is refused from then on.
	idle := s.service.inflight.drain()
	s.health.Shutdown()
	shutdownAt := time.Now()
	stopped := make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(stopped) }()
	select {
	case <-idle:
		// Health watches never end by themselves: once the engine calls are
		// done (and the watchers have had their NOT_SERVING), end them, so
		// the graceful stop completes with every answer flushed.
		if s.healthSvc.watchers.Load() > 0 {
			time.Sleep(time.Until(shutdownAt.Add(watchGrace)))
		}
		s.healthSvc.end()
		select {
		case <-stopped:
		case <-deadline:
		}
	case <-deadline:
	}
	select {
	case <-stopped:
	default:
		slog.Warn("drain timed out; dropping remaining calls", "drain", s.opts.Drain.String())
		s.grpc.Stop()
		<-stopped
	}
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// watchGrace is how long health watchers get to receive NOT_SERVING before
// their streams are ended at the end of a drain.
const watchGrace = 200 * time.Millisecond

// healthService is grpc-go's health server whose Watch streams end when
// the server has drained (they would otherwise hold a graceful stop open).
type healthService struct {
	*health.Server
	once     sync.Once
	ended    chan struct{}
	watchers atomic.Int64
}

func (h *healthService) end() { h.once.Do(func() { close(h.ended) }) }

func (h *healthService) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	h.watchers.Add(1)
	defer h.watchers.Add(-1)
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	go func() {
		select {
		case <-h.ended:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := h.Server.Watch(req, watchStream{stream, ctx})
	select {
	case <-h.ended:
		return status.Error(codes.Unavailable, "the engine has shut down")
	default:
		return err
	}
}

type watchStream struct {
	healthpb.Health_WatchServer
	ctx context.Context
}

func (w watchStream) Context() context.Context { return w.ctx }

func (s *Server) reloadOnHangup(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.hangup:
			if err := s.tls.Reload(); err != nil {
				slog.Error("SIGHUP: TLS certificate not re-read; keeping the running one", "error", err.Error())
			} else {
				slog.Info("SIGHUP: TLS certificate re-read; new connections use it")
			}
		}
	}
}
