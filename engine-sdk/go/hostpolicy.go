package enginesdk

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"
)

// HostEndpoint is a host endpoint as requests and --host-allow name it:
// http://, https:// (TLS) or bare HOST:PORT, or unix:///PATH.
type HostEndpoint struct {
	HTTPS    bool
	Endpoint Endpoint
	// Host as written: the name a TLS certificate must carry.
	Host string
}

// ParseHostEndpoint reads a host endpoint.
func ParseHostEndpoint(s string) (HostEndpoint, error) {
	rest, https := strings.CutPrefix(s, "https://")
	e, err := ParseEndpoint(rest)
	if err != nil {
		return HostEndpoint{}, &BadEndpointError{Input: s}
	}
	bare := strings.TrimRight(strings.TrimPrefix(rest, "http://"), "/")
	host := bare
	if i := strings.LastIndexByte(bare, ':'); i >= 0 {
		host = bare[:i]
	}
	return HostEndpoint{HTTPS: https, Endpoint: e, Host: strings.Trim(host, "[]")}, nil
}

func (h HostEndpoint) String() string {
	if h.HTTPS && h.Endpoint.Unix == "" {
		return "https://" + h.Endpoint.String()
	}
	return h.Endpoint.String()
}

// Peer is where a call came from: an IP address, or (nil) a local process
// on the unix socket.
type Peer struct{ IP net.IP }

func (p Peer) String() string {
	if p.IP == nil {
		return "a local process on a unix socket"
	}
	return p.IP.String()
}

// RefusedError says why a host endpoint is not called back.
type RefusedError struct {
	Endpoint string
	Why      string
}

func (e *RefusedError) Error() string { return "host endpoint " + e.Endpoint + " " + e.Why }

// HostPolicy decides which host endpoints an engine calls back. A request
// names its host endpoint, and whoever reaches the engine's port can send
// a request: an engine that dialled whatever it was told could be made to
// connect anywhere and hand over the grant. So an endpoint is called only
// when it is on the allow-list (--host-allow) or, with no list, when it is
// the address of the peer that made the call (a name is resolved once, and
// the address that matched is what gets dialled); a caller on a unix
// socket is a local process, so loopback endpoints are its. A unix socket
// named by a request is never dialled unless listed.
type HostPolicy struct {
	Allow []HostEndpoint
}

// checked is a host endpoint the policy allows: where to dial (an address
// that was checked, never a name resolved again later) and how.
type checked struct {
	dial       Endpoint
	https      bool
	serverName string
}

func (c checked) key() string { return fmt.Sprintf("%t|%s|%s", c.https, c.dial, c.serverName) }

// Check says whether endpoint may be called for a call from peer, and
// where to dial it. within bounds a name lookup (at most 2 s).
func (p HostPolicy) Check(ctx context.Context, endpoint string, peer Peer, within time.Duration) (checked, error) {
	h, err := ParseHostEndpoint(endpoint)
	if err != nil {
		return checked{}, &RefusedError{endpoint, "is not a valid endpoint"}
	}
	ok := func(dial Endpoint) checked { return checked{dial: dial, https: h.HTTPS, serverName: h.Host} }
	if len(p.Allow) > 0 {
		for _, a := range p.Allow {
			if a.HTTPS == h.HTTPS && a.Endpoint.equal(h.Endpoint) {
				// Listed by the operator: dialled as written.
				return ok(h.Endpoint), nil
			}
		}
		return checked{}, &RefusedError{endpoint, "is not on this engine's --host-allow list"}
	}
	var candidates []net.IP
	switch e := h.Endpoint; {
	case e.Unix != "":
		return checked{}, &RefusedError{endpoint, "is a unix socket named by a request; only --host-allow can name one"}
	case e.Addr != nil:
		candidates = []net.IP{e.Addr.IP}
	default:
		within = min(within, 2*time.Second)
		lookup, cancel := context.WithTimeout(ctx, within)
		addrs, _ := net.DefaultResolver.LookupIPAddr(lookup, e.Name)
		cancel()
		for _, a := range addrs {
			candidates = append(candidates, a.IP)
		}
	}
	for _, ip := range candidates {
		if peer.IP == nil && ip.IsLoopback() || peer.IP != nil && ip.Equal(peer.IP) {
			return ok(Endpoint{Addr: &net.TCPAddr{IP: ip, Port: h.Endpoint.port()}}), nil
		}
	}
	return checked{}, &RefusedError{endpoint, fmt.Sprintf(
		"is not the calling peer (%s); start the engine with --host-allow %s to trust it", peer, endpoint)}
}

func (e Endpoint) port() int {
	if e.Addr != nil {
		return e.Addr.Port
	}
	return e.Port
}
