package enginesdk

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Endpoint is where an engine listens or a host is reached: an IP address
// and port, a host name and port (resolved when used), or a unix socket.
type Endpoint struct {
	// Exactly one of Addr (IP:port), Name (with Port) and Unix is set.
	Addr *net.TCPAddr
	Name string
	Port int
	Unix string
}

// BadEndpointError says an endpoint is not one of the accepted forms.
type BadEndpointError struct{ Input string }

func (e *BadEndpointError) Error() string {
	return fmt.Sprintf("invalid endpoint %q: expected http://HOST:PORT, HOST:PORT or unix:///PATH", e.Input)
}

// ParseEndpoint reads `http://HOST:PORT`, `HOST:PORT` or `unix:///PATH`
// (`localhost` is 127.0.0.1), as the Rust SDK does.
func ParseEndpoint(s string) (Endpoint, error) {
	bad := &BadEndpointError{Input: s}
	if path, ok := strings.CutPrefix(s, "unix://"); ok {
		if path == "" {
			return Endpoint{}, bad
		}
		return Endpoint{Unix: path}, nil
	}
	hostport := strings.TrimRight(strings.TrimPrefix(s, "http://"), "/")
	if rest, ok := strings.CutPrefix(hostport, "localhost:"); ok {
		hostport = "127.0.0.1:" + rest
	}
	host, portText, err := net.SplitHostPort(hostport)
	if err != nil {
		return Endpoint{}, bad
	}
	port, err := strconv.ParseUint(portText, 10, 16)
	if err != nil {
		return Endpoint{}, bad
	}
	if ip := net.ParseIP(host); ip != nil {
		return Endpoint{Addr: &net.TCPAddr{IP: ip, Port: int(port)}}, nil
	}
	if host == "" || strings.ContainsFunc(host, func(c rune) bool {
		return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.')
	}) {
		return Endpoint{}, bad
	}
	return Endpoint{Name: host, Port: int(port)}, nil
}

// String is the form engines print after `listening on`: HOST:PORT or
// unix:///PATH.
func (e Endpoint) String() string {
	switch {
	case e.Unix != "":
		return "unix://" + e.Unix
	case e.Addr != nil:
		return e.Addr.String()
	}
	return net.JoinHostPort(e.Name, strconv.Itoa(e.Port))
}

// target is the grpc-go dial target: an address is dialled as it is (no
// resolver), a name through DNS, a socket by its path.
func (e Endpoint) target() string {
	switch {
	case e.Unix != "":
		return "unix://" + e.Unix
	case e.Addr != nil:
		return "passthrough:///" + e.Addr.String()
	}
	return "dns:///" + net.JoinHostPort(e.Name, strconv.Itoa(e.Port))
}

func (e Endpoint) equal(o Endpoint) bool {
	switch {
	case e.Unix != "" || o.Unix != "":
		return e.Unix == o.Unix
	case e.Addr != nil && o.Addr != nil:
		return e.Addr.IP.Equal(o.Addr.IP) && e.Addr.Port == o.Addr.Port
	}
	return e.Addr == nil && o.Addr == nil && e.Name == o.Name && e.Port == o.Port
}
