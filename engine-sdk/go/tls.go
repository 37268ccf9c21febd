package enginesdk

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
)

// TLSError says why TLS settings could not be made, naming the option
// (flag) that gave the file, as every ctxgate program words it.
type TLSError struct {
	Option, Path string
	Problem      string
}

func (e *TLSError) Error() string {
	if e.Path == "" {
		return e.Option + ": " + e.Problem
	}
	return e.Option + " " + e.Path + ": " + e.Problem
}

func readPEM(option, path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, &TLSError{Option: option, Path: path, Problem: err.Error()}
	}
	return b, nil
}

// certPool reads a CA file (PEM) into a pool.
func certPool(option, path string) (*x509.CertPool, error) {
	b, err := readPEM(option, path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, &TLSError{Option: option, Path: path, Problem: "holds no PEM certificate"}
	}
	return pool, nil
}

// keyPair reads a certificate chain and its key (PEM).
func keyPair(certOption, certPath, keyOption, keyPath string) (*tls.Certificate, error) {
	certPEM, err := readPEM(certOption, certPath)
	if err != nil {
		return nil, err
	}
	keyPEM, err := readPEM(keyOption, keyPath)
	if err != nil {
		return nil, err
	}
	if b, _ := pem.Decode(certPEM); b == nil || b.Type != "CERTIFICATE" {
		return nil, &TLSError{Option: certOption, Path: certPath, Problem: "holds no PEM certificate"}
	}
	if !hasKey(keyPEM) {
		return nil, &TLSError{Option: keyOption, Path: keyPath, Problem: "holds no PEM private key"}
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, &TLSError{Option: certOption + " and " + keyOption, Problem: err.Error()}
	}
	return &pair, nil
}

func hasKey(b []byte) bool {
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			return false
		}
		if block.Type == "PRIVATE KEY" || block.Type == "RSA PRIVATE KEY" || block.Type == "EC PRIVATE KEY" {
			return true
		}
	}
}

// TLSFiles are where a server's certificate, key and (for mTLS) client CA
// come from, and the names a client's certificate must carry one of (none:
// any client the CA signed).
type TLSFiles struct {
	Cert, Key, ClientCA string
	ClientNames         []string
}

// LiveTLS is a server's TLS that a reload (SIGHUP) can replace while it
// serves: connections accepted afterwards use the new certificate, open
// ones keep theirs (crypto/tls asks GetConfigForClient per handshake).
type LiveTLS struct {
	files   TLSFiles
	current atomic.Pointer[tls.Config]
}

// NewLiveTLS reads files now (a mistake is a sentence naming its option).
func NewLiveTLS(files TLSFiles) (*LiveTLS, error) {
	l := &LiveTLS{files: files}
	if err := l.Reload(); err != nil {
		return nil, err
	}
	return l, nil
}

func serverConfig(f TLSFiles) (*tls.Config, error) {
	pair, err := keyPair("--tls-cert", f.Cert, "--tls-key", f.Key)
	if err != nil {
		return nil, err
	}
	c := &tls.Config{Certificates: []tls.Certificate{*pair}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
	if f.ClientCA != "" {
		pool, err := certPool("--tls-client-ca", f.ClientCA)
		if err != nil {
			return nil, err
		}
		c.ClientCAs, c.ClientAuth = pool, tls.RequireAndVerifyClientCert
		if len(f.ClientNames) > 0 {
			c.VerifyConnection = clientNamed(f.ClientNames)
		}
	}
	return c, nil
}

// ClientNameProblem says why name cannot be a --tls-client-name, or ""
// when it can: a DNS name (letters, digits, '-' and '.'), matched exactly,
// so no wildcard and no IP address (every SDK applies this rule).
func ClientNameProblem(name string) string {
	dns := name != "" && len(name) <= 253
	for _, label := range strings.Split(name, ".") {
		dns = dns && label != "" && !strings.ContainsFunc(label, func(c rune) bool {
			return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-')
		})
	}
	if dns && net.ParseIP(name) == nil {
		return ""
	}
	return fmt.Sprintf("--tls-client-name %q: expected a DNS name (matched exactly against a DNS subjectAltName of the client's certificate; no wildcard, no IP address)", name)
}

// clientNamed fails a handshake whose verified client certificate carries
// none of names as a DNS subjectAltName, exactly (ASCII case aside; a
// wildcard it presents matches nothing), so an engine serves the gateway,
// not every holder of a certificate from the deployment's CA.
func clientNamed(names []string) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("no client certificate")
		}
		for _, presented := range cs.PeerCertificates[0].DNSNames {
			for _, n := range names {
				if strings.EqualFold(presented, n) {
					return nil
				}
			}
		}
		return fmt.Errorf("the client's certificate names none of %s", strings.Join(names, ", "))
	}
}

// Reload re-reads the files; on a mistake the running certificate stays
// and the sentence is returned.
func (l *LiveTLS) Reload() error {
	c, err := serverConfig(l.files)
	if err != nil {
		return err
	}
	l.current.Store(c)
	return nil
}

// Config is the server configuration to hand to credentials.NewTLS: each
// handshake takes the configuration current when it starts.
func (l *LiveTLS) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return l.current.Load(), nil
		},
	}
}

// Certificate is the running certificate (the client certificate of host
// callbacks, too).
func (l *LiveTLS) Certificate() *tls.Certificate {
	c := l.current.Load()
	return &c.Certificates[0]
}

// ClientTLS is a client configuration: trust caFile (option names it;
// empty: the system roots) and present cert when given.
func ClientTLS(caOption, caFile string, cert func() *tls.Certificate) (func(serverName string) *tls.Config, error) {
	var roots *x509.CertPool
	if caFile != "" {
		pool, err := certPool(caOption, caFile)
		if err != nil {
			return nil, err
		}
		roots = pool
	}
	return func(serverName string) *tls.Config {
		c := &tls.Config{RootCAs: roots, ServerName: serverName, MinVersion: tls.VersionTLS12}
		if cert != nil {
			c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				if got := cert(); got != nil {
					return got, nil
				}
				return &tls.Certificate{}, nil
			}
		}
		return c
	}, nil
}

// staticCert reads a client certificate once (the health subcommand).
func staticCert(certPath, keyPath string) (func() *tls.Certificate, error) {
	if certPath == "" && keyPath == "" {
		return nil, nil
	}
	if certPath == "" || keyPath == "" {
		return nil, fmt.Errorf("--tls-cert and --tls-key go together")
	}
	pair, err := keyPair("--tls-cert", certPath, "--tls-key", keyPath)
	if err != nil {
		return nil, err
	}
	return func() *tls.Certificate { return pair }, nil
}
