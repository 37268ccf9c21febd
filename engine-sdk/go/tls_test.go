package enginesdk

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// testCA issues certificates for the TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newCA(t *testing.T) *testCA {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes a certificate (serial) and its key for localhost/127.0.0.1
// into dir as NAME.pem and NAME.key.
func (ca *testCA) issue(t *testing.T, dir, name string, serial int64) (certPath, keyPath string) {
	t.Helper()
	return ca.issueFor(t, dir, name, serial, "localhost")
}

// issueFor is issue for the DNS name dns (and 127.0.0.1).
func (ca *testCA) issueFor(t *testing.T, dir, name string, serial int64, dns string) (certPath, keyPath string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		DNSNames: []string{dns}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalPKCS8PrivateKey(key)
	certPath, keyPath = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key")
	write(t, certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	write(t, keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
	return certPath, keyPath
}

func write(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// servedSerial is the serial of the certificate the server at addr
// presents to a new connection (with the client certificate given).
func servedSerial(t *testing.T, addr string, roots *x509.CertPool, client *tls.Certificate) (int64, error) {
	t.Helper()
	c := &tls.Config{RootCAs: roots, ServerName: "localhost", NextProtos: []string{"h2"}}
	if client != nil {
		c.Certificates = []tls.Certificate{*client}
	}
	conn, err := tls.Dial("tcp", addr, c)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.Int64(), nil
}

// mtlsClient dials addr over TLS (trusting roots) presenting the
// certificate in certPath and keyPath; closed when the test ends.
func mtlsClient(t *testing.T, addr string, roots *x509.CertPool, certPath, keyPath string) (*grpc.ClientConn, tls.Certificate) {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(
		credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: "localhost", Certificates: []tls.Certificate{pair}})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn, pair
}

func TestTLSAndMTLSWithTheCertificateReReadOnSIGHUP(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	caPath := filepath.Join(dir, "ca.pem")
	write(t, caPath, ca.pem)
	cert, key := ca.issue(t, dir, "engine", 100)
	clientCert, clientKey := ca.issue(t, dir, "gateway", 7)
	e := serve(t, newProbe(), Options{TLSCert: cert, TLSKey: key, TLSClientCA: caPath})
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.pem)
	conn, pair := mtlsClient(t, e.server.Addr(), roots, clientCert, clientKey)
	if _, err := pb.NewContextEngineClient(conn).GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{}); err != nil {
		t.Fatalf("an mTLS call: %v", err)
	}
	// mTLS: a client without a certificate is not served.
	noCert, err := grpc.NewClient("passthrough:///"+e.server.Addr(), grpc.WithTransportCredentials(
		credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: "localhost"})))
	if err != nil {
		t.Fatal(err)
	}
	defer noCert.Close()
	if _, err := pb.NewContextEngineClient(noCert).GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{}); err == nil {
		t.Fatal("a client without a certificate was served")
	}
	if got, err := servedSerial(t, e.server.Addr(), roots, &pair); err != nil || got != 100 {
		t.Fatalf("serial %d, %v", got, err)
	}
	// A new certificate in the same files, then SIGHUP: new connections get it.
	ca.issue(t, dir, "engine", 200)
	hangup := func() {
		if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}
	hangup()
	waitSerial := func(want int64) {
		t.Helper()
		for end := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			got, err := servedSerial(t, e.server.Addr(), roots, &pair)
			if err == nil && got == want {
				return
			}
			if time.Now().After(end) {
				t.Fatalf("serial %d (%v), want %d after SIGHUP", got, err, want)
			}
		}
	}
	waitSerial(200)
	// A mistake keeps the running certificate.
	write(t, cert, []byte("not a certificate"))
	hangup()
	time.Sleep(200 * time.Millisecond)
	waitSerial(200)
	if _, err := pb.NewContextEngineClient(conn).GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{}); err != nil {
		t.Fatalf("the open connection after the reloads: %v", err)
	}
}

func TestTLSClientNameServesOnlyTheNamedClientAndHealthListenServesHealthAlone(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	caPath := filepath.Join(dir, "ca.pem")
	write(t, caPath, ca.pem)
	cert, key := ca.issue(t, dir, "engine", 1)
	e := serve(t, newProbe(), Options{TLSCert: cert, TLSKey: key, TLSClientCA: caPath,
		TLSClientNames: []string{"gateway"}, HealthListen: "127.0.0.1:0"})
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.pem)
	call := func(name string, serial int64) error {
		c, k := ca.issueFor(t, dir, name, serial, name)
		conn, _ := mtlsClient(t, e.server.Addr(), roots, c, k)
		_, err := pb.NewContextEngineClient(conn).GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{})
		return err
	}
	if err := call("gateway", 2); err != nil {
		t.Fatalf("the named client: %v", err)
	}
	// Refused at the handshake: the connection fails (UNAVAILABLE; with TLS
	// 1.3 the client may see the close as a broken pipe rather than the
	// alert), never an answer from the engine.
	if err := call("engine-lossless", 3); status.Code(err) != codes.Unavailable {
		t.Fatalf("a client whose certificate names another service: %v, want a refused connection", err)
	}
	// A wildcard the certificate presents matches no name.
	if err := call("*.gateway", 4); status.Code(err) != codes.Unavailable {
		t.Fatalf("a wildcard client certificate: %v, want a refused connection", err)
	}
	// Health alone, in plaintext: SERVING, and no engine method.
	conn, err := grpc.NewClient("passthrough:///"+e.server.HealthAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h, err := healthpb.NewHealthClient(conn).Check(timeout(5*time.Second), &healthpb.HealthCheckRequest{Service: "contextengine.v1.ContextEngine"})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health at --health-listen: %v %v", h, err)
	}
	if _, err := pb.NewContextEngineClient(conn).GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("an engine call at --health-listen: %v, want UNIMPLEMENTED", err)
	}
	// Health without authentication is served on this machine only.
	if _, err := NewServer(newProbe(), Options{Listen: "127.0.0.1:0", HealthListen: "0.0.0.0:0", MaxConcurrentCalls: 1}); err == nil ||
		!strings.Contains(err.Error(), "only on a loopback address") {
		t.Errorf("--health-listen on every interface: %v", err)
	}
	// Names are DNS names, matched exactly: no wildcard, no address.
	for _, bad := range []string{"*.example", "127.0.0.1", "", "gate way"} {
		if _, err := NewServer(newProbe(), Options{TLSCert: cert, TLSKey: key, TLSClientCA: caPath, TLSClientNames: []string{bad}}); err == nil ||
			!strings.Contains(err.Error(), "expected a DNS name") {
			t.Errorf("--tls-client-name %q: %v", bad, err)
		}
	}
	if _, err := NewServer(newProbe(), Options{TLSCert: cert, TLSKey: key, TLSClientNames: []string{"gateway"}}); err == nil ||
		!strings.Contains(err.Error(), "--tls-client-name needs --tls-client-ca") {
		t.Errorf("--tls-client-name alone: %v", err)
	}
}

func TestTLSMistakesNameTheirFlag(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	cert, key := ca.issue(t, dir, "engine", 1)
	garbage := filepath.Join(dir, "garbage")
	write(t, garbage, []byte("nothing"))
	for _, c := range []struct {
		opts Options
		want string
	}{
		{Options{TLSCert: filepath.Join(dir, "missing.pem"), TLSKey: key}, "--tls-cert " + filepath.Join(dir, "missing.pem") + ": open"},
		{Options{TLSCert: garbage, TLSKey: key}, "--tls-cert " + garbage + ": holds no PEM certificate"},
		{Options{TLSCert: cert, TLSKey: garbage}, "--tls-key " + garbage + ": holds no PEM private key"},
		{Options{TLSCert: cert, TLSKey: key, TLSClientCA: garbage}, "--tls-client-ca " + garbage + ": holds no PEM certificate"},
		{Options{HostCA: garbage}, "--host-ca " + garbage + ": holds no PEM certificate"},
		{Options{TLSCert: cert}, "--tls-cert and --tls-key go together"},
	} {
		_, err := NewServer(newProbe(), c.opts)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.opts, err, c.want)
		}
	}
	s, err := NewServer(newProbe(), Options{Listen: "unix://" + filepath.Join(dir, "e.sock"), TLSCert: cert, TLSKey: key, MaxConcurrentCalls: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err == nil || !strings.Contains(err.Error(), "TLS is served over TCP only") {
		t.Errorf("TLS on a unix socket: %v", err)
	}
}

func TestHTTPSHostCallbacksTrustTheHostCAAndPresentTheEnginesCertificate(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	caPath := filepath.Join(dir, "ca.pem")
	write(t, caPath, ca.pem)
	hostCert, hostKey := ca.issue(t, dir, "host", 5)
	engineCert, engineKey := ca.issue(t, dir, "engine", 6)
	// The host requires a client certificate its CA signed.
	pair, _ := tls.LoadX509KeyPair(hostCert, hostKey)
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.pem)
	h := &fakeHost{ended: make(chan struct{})}
	l := loopback(t, "127.0.0.1:0")
	hs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{pair}, ClientCAs: roots, ClientAuth: tls.RequireAndVerifyClientCert})))
	pb.RegisterHostServer(hs, h)
	go func() { _ = hs.Serve(l) }()
	defer hs.Stop()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	p := newProbe()
	e := serve(t, p, Options{TLSCert: engineCert, TLSKey: engineKey, HostCA: caPath})
	conn, err := grpc.NewClient("passthrough:///"+e.server.Addr(), grpc.WithTransportCredentials(
		credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: "localhost"})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := assembleReq("read")
	req.Host = access("https://localhost:" + port)
	if _, err := pb.NewContextEngineClient(conn).Assemble(timeout(5*time.Second), req); err != nil {
		t.Fatal(err)
	}
	if got := next(t, p.seen); !got.host || got.read != nil || got.entries != 3 {
		t.Fatalf("an https host callback: %+v", got)
	}
}
